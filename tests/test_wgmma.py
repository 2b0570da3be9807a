"""cuda/wgmma.cuh (Hopper warpgroup MMA helpers): tests/cuda/wgmma_check.cu compiles wherever nvcc
is (CPU hosts included) and, on an sm_90 GPU, its exact check of D = C + s A B passes (m64nNk16,
N = 32, 64, 128, A and B K-major or MN-major, s = +-1, 128-byte swizzled, N = 32 blocks at an
offset inside a tile, A from registers; see the program's header). The check is a standalone
program: it needs nvcc and a GPU, not the extension.
The kernels that use wgmma compile without ptxas serializing their wgmma instructions (warning
C7520, e.g. for a wgmma under a branch): that would cost their speed silently."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "tests", "cuda", "wgmma_check.cu")
CASES = 15


def _nvcc_or_skip() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    return nvcc


def _cuda_flags():
    import jax.ffi

    return ["-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-O3",
            "--expt-relaxed-constexpr", "-isystem", jax.ffi.include_dir(),
            "-I" + os.path.join(ROOT, "cuda")]


@pytest.fixture(scope="module")
def wgmma_check(tmp_path_factory) -> str:
    nvcc = _nvcc_or_skip()
    exe = str(tmp_path_factory.mktemp("wgmma") / "wgmma_check")
    r = subprocess.run([nvcc, "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                        "-I" + os.path.join(ROOT, "cuda"), SRC, "-o", exe],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return exe


def test_wgmma_check_compiles(wgmma_check):
    assert os.path.getsize(wgmma_check) > 0


def test_gpu_wgmma_matches_reference(wgmma_check):
    r = subprocess.run([wgmma_check], capture_output=True, text=True, timeout=120)
    print(r.stdout)
    if r.returncode == 2:  # the program's "no CUDA device" / "needs an sm_90 GPU"
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(", OK") == CASES, r.stdout


def test_wgmma_kernels_not_serialized():
    """Every kernel source that includes cuda/wgmma.cuh compiles with no C7520 from ptxas."""
    nvcc = _nvcc_or_skip()
    srcs = sorted(f for f in os.listdir(os.path.join(ROOT, "cuda")) if f.endswith(".cu"))
    users = []
    for f in srcs:
        r = subprocess.run([nvcc, *_cuda_flags(), "-M", os.path.join(ROOT, "cuda", f)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        if "wgmma.cuh" in r.stdout:
            users.append(f)
    assert "walk_fwd.cu" in users, users
    for f in users:
        r = subprocess.run([nvcc, *_cuda_flags(), "-Xptxas", "-v", "-c",
                            os.path.join(ROOT, "cuda", f), "-o", os.devnull],
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        bad = [line for line in r.stderr.splitlines() if "C7520" in line]
        assert not bad, f"{f}: ptxas serializes wgmma\n" + "\n".join(bad[:4])
