"""A baseline revision of the library next to the current one, for A/B timing in one process.

    python -m benchmarks.baseline REV --dest DIR
    python -m benchmarks.baseline --src TREE --label REV --dest DIR   (no git here: a source tree)

builds revision REV (`git archive`, then `pip wheel --no-build-isolation`, which compiles its CUDA
extension against the jaxlib installed here) and installs it under DIR as the package `jcg_base`:
every `jax_cake_gdn` in its Python files reads `jcg_base`, and its FFI targets register as
`jcg_base_*`, so both copies load side by side. Then

    JCG_BASELINE=DIR python -m benchmarks.run --arms cuda,base --baseline base ...

times the current library (`cuda`, `cuda:full`) against the baseline (`base`, `base:full`) in
one process, same inputs, same protocol; the run's JSON records REV under the arm's options.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = "jax_cake_gdn"
BASE = "jcg_base"
ENV = "JCG_BASELINE"  # the directory that holds jcg_base
REV_FILE = "BASELINE_REVISION"

# The registration loop of primitives/cuda.py (after the rename), and what it becomes: the
# extension's targets are named jax_cake_gdn_<op>; the copy's wrappers call jcg_base_<op>.
_REGISTER = 'jax.ffi.register_ffi_target(name, capsule, platform="CUDA")'
_REGISTER_RENAMED = (f'jax.ffi.register_ffi_target("{BASE}_" + name[len("{PACKAGE}_"):], capsule, '
                     f'platform="CUDA")')


def rename_copy(pkg_dir: str, dest: str, revision: str = "") -> str:
    """Copy the built package `pkg_dir` (a jax_cake_gdn directory with its _cuda*.so) to
    dest/jcg_base with the renames above; returns the new package directory."""
    if not os.path.isfile(os.path.join(pkg_dir, "__init__.py")):
        raise ValueError(f"{pkg_dir} is not a package directory")
    out = os.path.join(dest, BASE)
    if os.path.exists(out):
        shutil.rmtree(out)
    shutil.copytree(pkg_dir, out, ignore=shutil.ignore_patterns("__pycache__"))
    for path in glob.glob(os.path.join(out, "**", "*.py"), recursive=True):
        with open(path) as f:
            text = f.read()
        text = re.sub(r"\b" + PACKAGE, BASE, text)  # module names and FFI target prefixes
        if os.path.relpath(path, out) == os.path.join("primitives", "cuda.py"):
            if _REGISTER not in text:
                raise RuntimeError(f"{path}: no FFI registration line of the expected form "
                                   f"({_REGISTER}); this tool does not know this revision")
            text = text.replace(_REGISTER, _REGISTER_RENAMED)
        with open(path, "w") as f:
            f.write(text)
    with open(os.path.join(out, REV_FILE), "w") as f:
        f.write(revision + "\n")
    return out


def export_revision(rev: str, workdir: str) -> str:
    """`git archive` of `rev` (of the repository this file is in) into workdir/src."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    src = os.path.join(workdir, "src")
    os.makedirs(src)
    archive = subprocess.run(["git", "archive", rev], capture_output=True, check=True, cwd=root)
    subprocess.run(["tar", "-x", "-C", src], input=archive.stdout, check=True)
    return src


def build_tree(src: str, workdir: str, label: str = "") -> str:
    """Build the source tree `src` (its pyproject.toml may be rewritten: copy it first); returns
    the built package directory under workdir."""
    rev = label or src
    wheels = os.path.join(workdir, "wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
           "-w", wheels, src]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        # older packaging (GPU machine): the PEP 639 license fields, in their older spelling
        pp = os.path.join(src, "pyproject.toml")
        with open(pp) as f:
            text = f.read()
        text = re.sub(r'(?m)^license = "MIT"$', 'license = {text = "MIT"}', text)
        text = re.sub(r"(?m)^license-files.*\n", "", text)
        with open(pp, "w") as f:
            f.write(text)
        r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"building {rev} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    (wheel,) = glob.glob(os.path.join(wheels, "*.whl"))
    unpacked = os.path.join(workdir, "unpacked")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(unpacked)
    pkg = os.path.join(unpacked, PACKAGE)
    if not glob.glob(os.path.join(pkg, "_cuda*.so")):
        raise RuntimeError(f"the wheel of {rev} has no CUDA extension (was nvcc found?)")
    return pkg


def load(dest: str | None = None):
    """Import jcg_base from `dest` (default: $JCG_BASELINE); returns (module, revision)."""
    dest = dest or os.environ.get(ENV)
    if not dest:
        raise RuntimeError(f"no baseline: set {ENV} to a directory made by "
                           f"`python -m benchmarks.baseline REV --dest DIR`")
    if not os.path.isdir(os.path.join(dest, BASE)):
        raise RuntimeError(f"{dest} holds no {BASE} package")
    if dest not in sys.path:
        sys.path.insert(0, dest)
    mod = importlib.import_module(BASE)
    with open(os.path.join(dest, BASE, REV_FILE)) as f:
        rev = f.read().strip()
    return mod, rev


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rev", nargs="?", help="git revision to build as the baseline")
    p.add_argument("--src", help="a source tree of the baseline instead (no git needed)")
    p.add_argument("--label", default="", help="with --src: the revision it is, for the records")
    p.add_argument("--dest", required=True, help="directory to hold the jcg_base package")
    a = p.parse_args(argv)
    if (a.rev is None) == (a.src is None):
        p.error("give exactly one of: a revision, --src TREE")
    with tempfile.TemporaryDirectory() as work:
        if a.rev is not None:
            rev = subprocess.run(["git", "rev-parse", "--short", a.rev], capture_output=True,
                                 text=True, check=True).stdout.strip()
            src = export_revision(a.rev, work)
        else:
            rev = a.label or os.path.abspath(a.src)
            src = os.path.join(work, "src")
            shutil.copytree(a.src, src)
        print(f"[baseline] building {rev} ...", flush=True)
        pkg = build_tree(src, work, rev)
        out = rename_copy(pkg, a.dest, rev)
    print(f"[baseline] {out} (revision {rev}); time it with {ENV}={a.dest} and the arm `base`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
