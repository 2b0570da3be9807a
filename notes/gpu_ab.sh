#!/bin/bash
# One A/B call on the GPU machine (the `run` tool), the way sessions 22-26 ran theirs:
#   build the working tree; build a baseline copy beside it (benchmarks.baseline) from
#   $BASE_SRC in the background meanwhile; run the GPU tests picked by $TESTS; device times of
#   one B23 fwd+bwd (ncu); wall times of $ARMS and the baseline's arms in one process.
# Everything goes to /tmp/r, which comes back as $OUT/r.tgz.
#
# Before the call (on the CPU machine): put the baseline's source where the call can see it,
#   rm -rf .scratch/base-src; mkdir -p .scratch/base-src; git archive main | tar -x -C .scratch/base-src
# and call: run(command="TESTS='walk_chunk_bwd_equals or poison' bash notes/gpu_ab.sh",
#               carry=[".scratch"]).
# Knobs (environment): TESTS (pytest -k of tests/test_cuda_bwd.py; empty: no tests), ARMS
# (default "cuda,cuda:full"), NGROUPS (default 4), BASE_SRC (default .scratch/base-src; absent:
# no baseline arms), EXTRA (a command run last, e.g. a second benchmarks.run with
# JAX_CAKE_GDN_PDL=0).
mkdir -p /tmp/r
trap 'tar -C /tmp -czf $OUT/r.tgz r' EXIT
export PATH=/usr/local/cuda/bin:$PATH
ARMS=${ARMS:-cuda,cuda:full}
NGROUPS=${NGROUPS:-4}
BASE_SRC=${BASE_SRC:-.scratch/base-src}
t0=$(date +%s)
stamp() { echo "t $(( $(date +%s) - t0 )) s: $*"; }

bp=
if [ -d "$BASE_SRC" ]; then
  (python3 -m benchmarks.baseline --src "$BASE_SRC" --label base --dest /tmp/base \
     > /tmp/r/base.log 2>&1; echo "baseline rc=$?" >> /tmp/r/base.log) &
  bp=$!
fi
if ! python3 -m pip install --no-build-isolation -e . -q > /tmp/r/build.log 2>&1; then
  sed -i '/^license/d' pyproject.toml  # an older setuptools metadata reader on the machine
  python3 -m pip install --no-build-isolation -e . -q >> /tmp/r/build.log 2>&1 ||
    { echo BUILD FAILED; tail -50 /tmp/r/build.log; exit 1; }
fi
stamp build

if [ -n "$TESTS" ]; then
  timeout 300 python3 -m pytest -q -s -x tests/test_cuda_bwd.py -k "$TESTS" > /tmp/r/tests.txt 2>&1
  rc=$?
  stamp "tests rc=$rc"
  grep -E "rel RMS|bitwise|passed|failed|Error" /tmp/r/tests.txt | head -40
  [ $rc -ne 0 ] && { tail -40 /tmp/r/tests.txt; exit 1; }
fi

timeout 60 python3 -m benchmarks.device_times --workload B23 --ops fwd+bwd --modes full \
  > /tmp/r/devt.txt 2>&1
stamp "device times rc=$?"
grep -E "^==|ms  x" /tmp/r/devt.txt

arms=$ARMS
if [ -n "$bp" ]; then
  wait $bp
  tail -1 /tmp/r/base.log
  arms="$ARMS,$(echo "$ARMS" | sed 's/cuda/base/g')"
  export JCG_BASELINE=/tmp/base
fi
timeout 200 python3 -m benchmarks.run --workload B23 --ops fwd+bwd --arms "$arms" \
  --groups "$NGROUPS" --calls 6 --warmup 2 --out /tmp/r/fb > /tmp/r/fb.txt 2>&1
stamp "run rc=$?"
grep -v "^[WI][0-9]" /tmp/r/fb.txt | tail -10

if [ -n "$EXTRA" ]; then
  bash -c "$EXTRA" > /tmp/r/extra.txt 2>&1
  stamp "extra rc=$?"
  grep -v "^[WI][0-9]" /tmp/r/extra.txt | tail -20
fi
