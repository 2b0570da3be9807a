#!/usr/bin/env bash
# Set up .venv for jax-cake-gdn: Python 3.12, jax/jaxlib 0.11.2, the package (editable, with the
# CUDA extension when nvcc is found). Idempotent; prints what it does.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  # pyenv hosts: python3.12 is a shim that needs PYENV_VERSION; elsewhere any python3.12 will do.
  if command -v pyenv >/dev/null 2>&1; then
    local v
    v=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | sort -V | tail -n 1 || true)
    if [ -n "$v" ]; then echo "$(pyenv prefix "$v")/bin/python3"; return; fi
  fi
  for c in python3.12 python3; do
    if command -v "$c" >/dev/null 2>&1 &&
       "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      command -v "$c"; return
    fi
  done
  echo "error: jax-cake-gdn needs Python 3.12 (jax 0.11); none found (pyenv, python3.12, python3)" >&2
  exit 1
}

if [ ! -x .venv/bin/python ]; then
  PY=$(find_python)
  echo "setup: creating .venv with $PY ($("$PY" --version))" >&2
  # system site packages: a GPU host's preinstalled jax CUDA plugin stays visible
  "$PY" -m venv --system-site-packages .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python - <<'PYEOF' 2>/dev/null
import jax, jaxlib, pytest, nanobind, scikit_build_core
assert jax.__version__ == "0.11.2" and jaxlib.__version__ == "0.11.2"
PYEOF
then
  echo "setup: installing jax==0.11.2 jaxlib==0.11.2 and the build/test tools" >&2
  "${PIP[@]}" "jax==0.11.2" "jaxlib==0.11.2" pytest "nanobind>=2.0" "scikit-build-core>=0.10" numpy
fi
echo "setup: building and installing jax-cake-gdn (editable)" >&2
"${PIP[@]}" --no-build-isolation -e .
.venv/bin/python -c "
from jax_cake_gdn.primitives import cuda
import jax
print('setup: jax', jax.__version__, 'devices', jax.devices(), '| cuda extension:',
      'built' if cuda.available() else cuda.unavailable_reason())" >&2
