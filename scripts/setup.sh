#!/usr/bin/env bash
# Set up .venv for jax-cake-gdn: Python 3.12, jax/jaxlib 0.11.2, the package (editable, with the
# CUDA extension when nvcc is found). Idempotent; prints what it does.
set -euo pipefail
cd "$(dirname "$0")/.."

candidates() {
  # pyenv hosts: python3.12 is a shim that needs PYENV_VERSION, so ask pyenv for the path
  if command -v pyenv >/dev/null 2>&1; then
    local v
    v=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | sort -V | tail -n 1 || true)
    [ -n "$v" ] && echo "$(pyenv prefix "$v")/bin/python3"
  fi
  for c in python3.12 python3; do command -v "$c" 2>/dev/null || true; done
}

find_python() {
  # a Python 3.12, preferring one that already has jax 0.11.2 (a GPU host with no network)
  local c
  for want in 'import jax; assert jax.__version__ == "0.11.2"' 'pass'; do
    for c in $(candidates); do
      if "$c" -c "import sys; assert sys.version_info[:2] == (3, 12); $want" 2>/dev/null; then
        echo "$c"; return
      fi
    done
  done
  echo "error: jax-cake-gdn needs Python 3.12 (jax 0.11); none found (pyenv, python3.12, python3)" >&2
  exit 1
}

if [ ! -x .venv/bin/python ]; then
  PY=$(find_python)
  echo "setup: creating .venv with $PY ($("$PY" --version))" >&2
  "$PY" -m venv .venv
  # The creating Python's packages stay visible (behind the venv's own): on a GPU host whose
  # python3 is itself a venv holding jax's CUDA plugin, --system-site-packages would not reach them.
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$PY" -c 'import site, sys; print("\n".join(p for p in sys.path if p.endswith("-packages")))' \
    > "$site/_base_python_site.pth"
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python - <<'PYEOF' 2>/dev/null
import jax, jaxlib, pytest, nanobind, scikit_build_core, flax, ruff
assert jax.__version__ == "0.11.2" and jaxlib.__version__ == "0.11.2"
PYEOF
then
  echo "setup: installing jax==0.11.2 jaxlib==0.11.2, flax and the build/test tools" >&2
  "${PIP[@]}" "jax==0.11.2" "jaxlib==0.11.2" pytest "nanobind>=2.0" "scikit-build-core>=0.11" \
    numpy "flax>=0.12" ruff
fi
echo "setup: building and installing jax-cake-gdn (editable; the CUDA extension takes a few" \
  "minutes on two cores, its compile lines follow)" >&2
log=$(mktemp "${TMPDIR:-/tmp}/jcg-build.XXXXXX")
set +e
.venv/bin/python -m pip install -v --disable-pip-version-check --no-build-isolation -e . >"$log" 2>&1 &
pid=$!
shown=0
while kill -0 "$pid" 2>/dev/null; do  # ninja's [n/m] lines as they come
  sleep 2
  n=$(grep -c -E '^ *\[[0-9]+/[0-9]+\] ' "$log")
  [ "$n" -gt "$shown" ] && grep -E '^ *\[[0-9]+/[0-9]+\] ' "$log" | tail -n "+$((shown + 1))" \
    | sed 's/^/setup:   /' >&2
  shown=$n
done
wait "$pid"
rc=$?
set -e
if [ "$rc" -ne 0 ]; then tail -n 40 "$log" >&2; echo "setup: the install failed ($log)" >&2; exit 1; fi
rm -f "$log"
.venv/bin/python -c "
from jax_cake_gdn.primitives import cuda
import jax
print('setup: jax', jax.__version__, 'devices', jax.devices(), '| cuda extension:',
      'built' if cuda.available() else cuda.unavailable_reason())" >&2
