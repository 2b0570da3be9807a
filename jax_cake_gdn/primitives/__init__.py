"""The per-shard primitive set and backend choice.

The custom_vjp rules (gdn.py) and the context-parallel logic (kcp/) are written once over these
functions; `xla` implements all of them in jax.numpy, `cuda` replaces them with FFI kernels as
they land and takes the rest from `xla` (CUDA_KERNELS says which are kernels today).

Forward: gate_cumsum, l2norm_rstd, prep (A, w, u), state_walk (h, v_new, exit states), output (o,
scores; xla only: the cuda walk_output fuses it); solve_a (prep's A alone) and walk_output (w, u
from A, state_walk and output in one: o and exit states; with tapes=True also w, u, h, v_new as
replay returns them), which gdn's forward uses (light: without the tapes; full: with them);
solve_a_walk_output (the two in one call, where no unit takes a carry: the cuda one runs solve_a on
the SMs a walk of few chains leaves idle). Backward: replay (w, u from the saved A and state_walk in
one: the light mode's replay; the cuda one makes w, u on chip, bit for bit prep's, and returns u as
None), walk_bwd (reverse state walk: dS_end, dh0 and each chunk's dvn), chunk_bwd (all input
gradients from them), walk_chunk_bwd (the two in one, gdn's backward: the cuda one starts
chunk_bwd's CTAs on the SMs the walk leaves idle). nan_unless (o, or NaN everywhere when traced
cu_seqlens are malformed; the cuda one works in place). Segments and context parallelism: transfer
(the affine summaries M, B of the units that need them, one state-only walk) and transfer_bwd (its
backward twin: each carry-taking unit's entry gradient from a zero exit gradient).
Signatures: see primitives/xla.py.

The cuda set keeps A, w, u, v_new and the state tapes in bfloat16: its prep returns
A, w and u (solve_a: A), its state_walk returns h and v_new and its
walk_bwd returns dS_end and dvn as bf16 (rounded to nearest from f32: the values the kernels
that read them use as operands; u starts the walks' f32 v_new accumulator), and those kernels accept
only bf16 there; the xla set keeps them float32. Primitives of the two sets do not mix at these
arrays (cast explicitly where a test does: `h.astype(jnp.bfloat16)`); exit states, dh0 and every
other intermediate are float32 in both. The cuda walk_output makes w, u on chip from A with other
bf16 roundings than xla's output after state_walk; with tapes=True its o and its w, h, v_new are
bit for bit the o without and the replay's (gdn's two save modes rely on it).

The cuda set's walk_bwd and chunk_bwd kernels recompute the intra-chunk scores instead of reading
saved ones (chunk_bwd needs neither w nor u; dvn comes from walk_bwd, which makes it for its own
update); gdn keeps no scores in either save mode.
chunk_bwd(..., deterministic=False) lets the cuda kernel sum dq, dk over each GVA group with
atomic adds (run-to-run differences in the last bits); the xla one sums in a fixed order either
way.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, NamedTuple

from . import xla


class Primitives(NamedTuple):
    name: str
    gate_cumsum: Callable
    l2norm_rstd: Callable
    prep: Callable
    solve_a: Callable
    state_walk: Callable
    replay: Callable
    output: Callable
    walk_bwd: Callable
    chunk_bwd: Callable
    walk_chunk_bwd: Callable
    walk_output: Callable
    solve_a_walk_output: Callable
    nan_unless: Callable
    transfer: Callable
    transfer_bwd: Callable


XLA = Primitives("xla", **{name: getattr(xla, name) for name in Primitives._fields[1:]})

# Primitives that run as CUDA kernels under backend="cuda"; the others run the xla versions.
CUDA_KERNELS = ("gate_cumsum", "l2norm_rstd", "prep", "solve_a", "state_walk", "replay",
                "walk_output", "solve_a_walk_output", "walk_bwd", "chunk_bwd", "walk_chunk_bwd",
                "nan_unless", "transfer", "transfer_bwd")
BACKENDS = ("xla", "cuda")


@functools.cache
def _cuda_primitives() -> Primitives:
    from . import cuda  # its wrappers take the primitives' arguments, as xla's

    return XLA._replace(name="cuda", **{name: getattr(cuda, name) for name in CUDA_KERNELS})


def cuda_ready() -> bool:
    """True when the extension is built and a CUDA GPU is visible."""
    from . import cuda

    return cuda.available() and cuda.gpu_available()


_warned_dims: set = set()  # (K, V) pairs already warned about


def resolve(backend: str | None, *, K: int, V: int) -> Primitives:
    """Pick the primitive set for head dims K (q/k) and V (v).

    None: cuda where the extension and a GPU exist and the kernels support K and V
    (`cuda.supports`), else xla; on a GPU host, head dims the kernels lack give xla with a warning,
    once per (K, V) (the xla backend is many times slower). "cuda": the cuda set (RuntimeError,
    after a one-time warning, when the extension is missing; ValueError naming K or V when the
    kernels lack them).
    """
    from . import cuda

    if not use_cuda(backend):
        return XLA
    if backend is None:
        if cuda.supports(K, V):
            return _cuda_primitives()
        if (K, V) not in _warned_dims:
            _warned_dims.add((K, V))
            warnings.warn(f"jax_cake_gdn: head dims K = {K}, V = {V} are not supported by the cuda "
                          f"kernels (K and V must be one of {cuda.SUPPORTED_DIMS}); running the "
                          "xla backend, which is many times slower. Pass backend='xla' to say so "
                          "and silence this.", stacklevel=3)
        return XLA
    cuda._check_dims("backend='cuda'", K=K, V=V)
    return _cuda_primitives()


def use_cuda(backend: str | None) -> bool:
    """The backend rule of every op (gdn, short_conv): None -> True where `cuda_ready()`;
    "xla" -> False; "cuda" -> True (RuntimeError, after a one-time warning, when the extension
    is missing); anything else ValueError."""
    from . import cuda

    if backend is None:
        return cuda_ready()
    if backend == "xla":
        return False
    if backend == "cuda":
        if not cuda.require():
            raise RuntimeError(f"backend='cuda' requested but {cuda.unavailable_reason()}")
        return True
    raise ValueError(f"backend must be None, 'xla' or 'cuda', got {backend!r}")
