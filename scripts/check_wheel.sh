#!/usr/bin/env bash
# Build jax-cake-gdn's wheels with `python -m build` and install each into a FRESH venv; import the
# package there and run gdn (forward + backward) on the CPU. Run by .ci/run after scripts/test.sh.
#
#   1. the pure wheel: JAX_CAKE_GDN_NO_CUDA=1 -> py3-none-any, no CMake, no extension
#   2. the native wheel: CMake + nvcc -> cp312-...-linux_x86_64 with jax_cake_gdn/_cuda*.so
#      (on a host without nvcc this wheel holds only Python; the check then expects no extension)
#
# Builds use --no-isolation with .venv (made by scripts/setup.sh; it holds scikit-build-core,
# nanobind and jax, the build requirements), so building needs no network. The fresh venv is made
# with the Python 3.12 that setup.sh found (the interpreter .venv was created from) and gets its
# dependencies (jax, jaxlib, numpy, ...) from the package index like any user's install.
# Prints "wheel check: OK ..." per wheel; exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
t0=$SECONDS

[ -x .venv/bin/python ] || bash scripts/setup.sh
VPY=.venv/bin/python
PIP=(-m pip install -q --disable-pip-version-check)
# -I / -P: never take the repository's build/ folder (CMake's) for the 'build' package
if ! "$VPY" -I -c 'import build.__main__' 2>/dev/null; then
  echo "check_wheel: installing the 'build' frontend into .venv" >&2
  "$VPY" "${PIP[@]}" build
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/jcg-wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

build_wheel() {  # build_wheel OUTDIR [ENV=VALUE...]
  local out=$1; shift
  if ! env "$@" "$VPY" -P -m build --wheel --no-isolation --outdir "$out" . > "$out.log" 2>&1; then
    cat "$out.log" >&2
    echo "check_wheel: FAILED: python -m build --wheel ($*)" >&2
    exit 1
  fi
  ls "$out"/*.whl
}

echo "check_wheel: building the pure wheel (JAX_CAKE_GDN_NO_CUDA=1)" >&2
PURE=$(build_wheel "$WORK/pure" JAX_CAKE_GDN_NO_CUDA=1)
echo "check_wheel: building the native wheel (CMake; the CUDA extension when nvcc is found)" >&2
NATIVE=$(build_wheel "$WORK/native")

# what each wheel must hold
"$VPY" - "$PURE" "$NATIVE" <<'PYEOF'
import os, sys, zipfile
pure, native = sys.argv[1:]
for path in (pure, native):
    z = zipfile.ZipFile(path)
    names = set(z.namelist())
    info = "jax_cake_gdn-%s.dist-info" % os.path.basename(path).split("-")[1]
    for need in ("jax_cake_gdn/__init__.py", "jax_cake_gdn/py.typed", f"{info}/licenses/LICENSE"):
        assert need in names, f"{path}: {need} missing"
    meta = z.read(f"{info}/METADATA")
    assert b"License-Expression: MIT" in meta and b"Description-Content-Type: text/markdown" in meta
assert pure.endswith("-py3-none-any.whl"), f"the pure wheel is not py3-none-any: {pure}"
assert not any(n.endswith(".so") for n in zipfile.ZipFile(pure).namelist()), "pure wheel has a .so"
PYEOF
EXPECT=$("$VPY" -c 'import sys, zipfile
print("yes" if any(n.startswith("jax_cake_gdn/_cuda") and n.endswith(".so")
                   for n in zipfile.ZipFile(sys.argv[1]).namelist()) else "no")' "$NATIVE")
echo "check_wheel: built $(basename "$PURE") and $(basename "$NATIVE") (CUDA extension inside: $EXPECT)" \
     "in $((SECONDS - t0)) s" >&2

# a fresh venv from the interpreter setup.sh chose (no .pth, no system site-packages)
BASE=$("$VPY" -c 'import sys; print(sys._base_executable)')
"$BASE" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version'
"$BASE" -m venv "$WORK/venv"
FPY=$WORK/venv/bin/python
t1=$SECONDS
# jax and jaxlib pinned to the versions .venv tests with (the rest resolves freely), so this check
# does not move when a new jax is released
"$VPY" -c 'import jax, jaxlib; print(f"jax=={jax.__version__}\njaxlib=={jaxlib.__version__}")' \
  > "$WORK/constraints.txt"
echo "check_wheel: fresh venv with $BASE; pip install $(basename "$PURE")" \
     "(dependencies from the index, constrained to $(tr '\n' ' ' < "$WORK/constraints.txt"))" >&2
"$FPY" "${PIP[@]}" -c "$WORK/constraints.txt" "$PURE"
echo "check_wheel: installed in $((SECONDS - t1)) s" >&2

smoke() {  # smoke WHEEL EXPECT_CUDA: from a neutral directory, isolated mode, CPU only
  (cd "$WORK" && JAX_PLATFORMS=cpu "$FPY" -I "$ROOT/scripts/wheel_smoke.py" \
     --expect-cuda "$2" --wheel "$(basename "$1")")
}
smoke "$PURE" no

"$FPY" "${PIP[@]}" --force-reinstall --no-deps "$NATIVE"
smoke "$NATIVE" "$EXPECT"
echo "check_wheel: done in $((SECONDS - t0)) s" >&2
