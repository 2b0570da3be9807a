#!/bin/bash
# The protocol rows of issue 5 on the GPU machine (the `run` tool), one step a call, the calls
# back to back so the machine stays warm (idle release ~30 s) and keeps /tmp/anchors and the build:
#   run(command="bash notes/gpu_protocol.sh build", carry=[".anchors-a"])   # ~100 s
#   run(command="bash notes/gpu_protocol.sh B23", carry=[".anchors-b"])     # fwd+bwd, all arms
#   run(command="bash notes/gpu_protocol.sh B23-ckpt")
#   run(command="bash notes/gpu_protocol.sh small_heads")                   # FlashQLA compiles
#   run(command="bash notes/gpu_protocol.sh long")
# Session 28 ran them in 25 minutes of device time (ckpt then lacked cuda:full:det, small_heads and
# long had 3 x 5 calls; both mended here: ~30 s more).
# (.anchors-a/-b: ../shared/tools/anchor-wheels.sh, run here first.) Each step writes its
# output and JSON under $OUT/<step>; a step past its timeout still returns what it printed.
set -u
step=${1:?step: build, B23, B23-ckpt, small_heads or long}
export PATH=/usr/local/cuda/bin:$PATH FLA_FLASH_QLA=0 PYTHONPATH=/tmp/anchors
out=$OUT/$step; mkdir -p "$out"
t0=$(date +%s)
install() {  # the peers' wheels carried in folder $1
  [ -d "$1" ] && python3 -m pip install -q --no-index --no-deps --no-compile \
    --target /tmp/anchors "$1"/*.whl > "$out/install.log" 2>&1
  echo "installed $1: rc=$? ($(ls /tmp/anchors 2>/dev/null | wc -l) entries in /tmp/anchors)"
}
bench() {  # benchmarks.run with a timeout, the summary table printed
  timeout "$1" python3 -m benchmarks.run --out "$out" "${@:2}" > "$out/run.txt" 2>&1
  echo "benchmarks.run rc=$? after $(( $(date +%s) - t0 )) s"
  grep -v "^[WI][0-9]" "$out/run.txt" | grep -E "^arm|^---|^[a-z:]+ +(fwd|ckpt)|x flashqla:|^skipped:" \
    || tail -20 "$out/run.txt"
}
case $step in
  build)
    install .anchors-a
    if ! python3 -m pip install --no-build-isolation -e . -q > "$out/build.log" 2>&1; then
      sed -i '/^license/d' pyproject.toml  # an older setuptools metadata reader on the machine
      python3 -m pip install --no-build-isolation -e . -q >> "$out/build.log" 2>&1 ||
        { echo BUILD FAILED; tail -40 "$out/build.log"; exit 1; }
    fi
    echo "built in $(( $(date +%s) - t0 )) s" ;;
  B23)
    install .anchors-b
    bench 540 --workload B23 --ops fwd,fwd+bwd --baseline flashqla --groups 4 --calls 6 \
      --warmup 3 --arms cuda,cuda:det,cuda:full,cuda:full:det,xla,flashqla,fla ;;
  B23-ckpt)
    bench 540 --workload B23 --ops ckpt --baseline flashqla --groups 4 --calls 6 --warmup 3 \
      --arms cuda,cuda:det,cuda:full,cuda:full:det,xla,flashqla,fla ;;
  small_heads|long)
    bench 560 --workload "$step" --ops fwd,fwd+bwd --baseline flashqla --groups 4 --calls 5 \
      --warmup 2 --arms cuda,cuda:full,flashqla ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
