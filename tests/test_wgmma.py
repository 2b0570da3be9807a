"""cuda/wgmma.cuh (Hopper warpgroup MMA helpers): tests/cuda/wgmma_check.cu compiles wherever nvcc
is (CPU hosts included) and, on an sm_90 GPU, its exact check of D = C + s A B passes (m64n64k16
and m64n128k16, A and B K-major or MN-major, s = +-1, 128-byte swizzled; see the program's
header)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from conftest import need_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "tests", "cuda", "wgmma_check.cu")


def _build(tmp_path) -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    exe = str(tmp_path / "wgmma_check")
    r = subprocess.run([nvcc, "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                        "-I" + os.path.join(ROOT, "cuda"), SRC, "-o", exe],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return exe


def test_wgmma_check_compiles(tmp_path):
    assert os.path.getsize(_build(tmp_path)) > 0


def test_gpu_wgmma_matches_reference(tmp_path):
    need_gpu()
    exe = _build(tmp_path)
    r = subprocess.run([exe], capture_output=True, text=True, timeout=120)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(", OK") == 7, r.stdout
