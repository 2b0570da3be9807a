"""cuda/wgmma.cuh (Hopper warpgroup MMA helpers): tests/cuda/wgmma_check.cu compiles wherever nvcc
is (CPU hosts included) and, on an sm_90 GPU, its exact check of D = C + s A B passes (m64nNk16,
N = 32, 64, 128, A and B K-major or MN-major, s = +-1, 128-byte swizzled, N = 32 blocks at an
offset inside a tile, A from registers; see the program's header). The check is a standalone
program: it needs nvcc and a GPU, not the extension.
The kernels that use wgmma must compile without ptxas serializing their wgmma instructions (warning
C7520, e.g. for a wgmma under a branch): CMakeLists.txt makes every ptxas warning an error."""

from __future__ import annotations

import os
import re
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


def test_build_fails_on_ptxas_warnings():
    """The kernels' build turns ptxas warnings into errors, so a kernel whose wgmma ptxas would
    serialize (C7520) fails to build instead of losing its speed silently."""
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        cmake = f.read()
    flags = re.search(r"target_compile_options\(jcg_kernels PRIVATE(.*?)\)\n", cmake, re.S)
    assert flags and "-Xptxas=--warning-as-error" in flags.group(1), "ptxas warnings not fatal"
