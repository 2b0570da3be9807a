"""The per-shard primitive set and backend choice.

The custom_vjp rules (gdn.py) and the context-parallel logic (kcp/) are written once over these
functions; `xla` implements all of them in jax.numpy, `cuda` replaces them with FFI kernels as
they land and takes the rest from `xla` (CUDA_KERNELS says which are kernels today).

Forward: gate_cumsum, l2norm_rstd, solve_a (A), wy (w, u), state_walk (h, v_new, exit states),
output (o, scores). Backward: walk_bwd (reverse state walk), chunk_bwd (all input gradients).
Signatures: see primitives/xla.py.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from . import xla


class Primitives(NamedTuple):
    name: str
    gate_cumsum: Callable
    l2norm_rstd: Callable
    solve_a: Callable
    wy: Callable
    state_walk: Callable
    output: Callable
    walk_bwd: Callable
    chunk_bwd: Callable


XLA = Primitives("xla", xla.gate_cumsum, xla.l2norm_rstd, xla.solve_a, xla.wy, xla.state_walk,
                 xla.output, xla.walk_bwd, xla.chunk_bwd)

# Primitives that run as CUDA kernels under backend="cuda"; the others run the xla versions.
CUDA_KERNELS = ("gate_cumsum",)
BACKENDS = ("xla", "cuda")


def _cuda_primitives() -> Primitives:
    from . import cuda

    return XLA._replace(
        name="cuda",
        gate_cumsum=lambda g, ct: cuda.gate_cumsum(g, ct.start, ct.length),
    )


def cuda_ready() -> bool:
    """True when the extension is built and a CUDA GPU is visible."""
    from . import cuda

    return cuda.available() and cuda.gpu_available()


def resolve(backend: str | None) -> Primitives:
    """Pick the primitive set: None -> cuda where the extension and a GPU exist, else xla."""
    if backend is None:
        return _cuda_primitives() if cuda_ready() else XLA
    if backend == "xla":
        return XLA
    if backend == "cuda":
        from . import cuda

        if not cuda.available():
            raise RuntimeError(f"backend='cuda' requested but {cuda.unavailable_reason()}")
        return _cuda_primitives()
    raise ValueError(f"backend must be None, 'xla' or 'cuda', got {backend!r}")
