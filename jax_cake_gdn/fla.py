"""flash-linear-attention's call signatures over `gdn` and `gdn_step`: porting is an import change.

    from fla.ops.gated_delta_rule import chunk_gated_delta_rule      # PyTorch
    from jax_cake_gdn.fla import chunk_gated_delta_rule             # JAX, same call

Both functions take FLA's names, positional order and defaults, and return what FLA returns:
always the pair `(o, final_state)`, final_state None unless output_final_state. (`gdn` itself
returns o alone by default, so FLA's habit `o, _ = gdn(...)` would unpack the batch axis.)
The signatures are those of fla-org/flash-linear-attention at commit bc3b101d (August 2026, the
last one we could read before the 0.6.0 release; `fla/ops/gated_delta_rule/chunk.py` and
`fused_recurrent.py`).

dtypes: FLA's kernels take any floating dtype and compute in float32. Here g, beta, A_log,
dt_bias and initial_state are cast to float32 (from bfloat16 or float16), float16 q, k, v are
cast to bfloat16 (our kernels take bfloat16 or float32) and o is cast back to q's dtype, as FLA
returns it. final_state is float32, as in FLA.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from .gdn import gdn
from .recurrent import gdn_step

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]

_GATE_KW = ("use_gate_in_kernel", "A_log", "dt_bias")


def _state_layout(kwargs, state_v_first):
    """FLA's deprecated alias `transpose_state_layout` for state_v_first."""
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated "
                             "`transpose_state_layout`.")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
                      DeprecationWarning, stacklevel=3)
        state_v_first = kwargs.pop("transpose_state_layout")
    return bool(state_v_first)


def _float(name, x, to):
    """x cast to `to` when it is a floating array of another floating dtype; None stays None."""
    if x is None:
        return None
    if not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != to:
        return jnp.asarray(x).astype(to)
    return x


def _qkv(*xs):
    """float16 -> bfloat16 (our kernels take bf16 or f32); other dtypes go to gdn's checks."""
    return tuple(x.astype(jnp.bfloat16) if getattr(x, "dtype", None) == jnp.float16 else x
                 for x in xs)


def _transpose_state(x):
    return None if x is None else jnp.swapaxes(x, -1, -2)


def _prepare(q, k, v, g, beta, initial_state, state_v_first, gate_kw):
    """Cast FLA's dtypes to ours; a V-first ([.., V, K]) initial state to our [.., K, V]."""
    out_dtype = getattr(q, "dtype", None)
    q, k, v = _qkv(q, k, v)
    g, beta = _float("g", g, jnp.float32), _float("beta", beta, jnp.float32)
    h0 = _float("initial_state", initial_state, jnp.float32)
    if state_v_first:
        h0 = _transpose_state(h0)
    for name in ("A_log", "dt_bias"):
        if name in gate_kw:
            gate_kw[name] = _float(name, gate_kw[name], jnp.float32)
    return q, k, v, g, beta, h0, out_dtype


def _finish(o, final, out_dtype, output_final_state, state_v_first):
    if out_dtype is not None and o.dtype != out_dtype:
        o = o.astype(out_dtype)
    if not output_final_state:
        return o, None
    return o, (_transpose_state(final) if state_v_first else final)


def _take_gate_kw(kwargs):
    return {n: kwargs.pop(n) for n in _GATE_KW if n in kwargs}


def _no_more(fn, kwargs):
    if kwargs:
        raise TypeError(f"{fn}() got unexpected keyword arguments {sorted(kwargs)}")


def chunk_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                           beta: jax.Array, scale: float | None = None,
                           initial_state: jax.Array | None = None,
                           output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False,
                           use_beta_sigmoid_in_kernel: bool = False,
                           allow_neg_eigval: bool = False, state_v_first: bool = False,
                           cu_seqlens: jax.Array | None = None, cu_seqlens_cpu=None,
                           chunk_indices=None, cp_context=None, *, backend: str | None = None,
                           save_mode: str = "full", deterministic: bool = False,
                           **kwargs) -> tuple[jax.Array, jax.Array | None]:
    """FLA's `chunk_gated_delta_rule` (fla/ops/gated_delta_rule/chunk.py) over `gdn`.

    Same arguments, order and defaults as FLA; shapes batch first: q, k [B, T, H, K],
    v [B, T, HV, V], g, beta [B, T, HV], cu_seqlens [N + 1] (then B == 1), initial_state and
    final_state [N or B, HV, K, V] ([N or B, HV, V, K] with state_v_first=True, FLA's V-first
    layout: transposed on the way in and out, a copy of the state each way).

    From FLA's **kwargs: use_gate_in_kernel, A_log, dt_bias (g raw, decay
    -exp(A_log) softplus(g + dt_bias)); chunk_size (only 64, FLA's default: other values raise
    ValueError, the result does not depend on it); transpose_state_layout (FLA's deprecated
    alias of state_v_first). cu_seqlens_cpu and chunk_indices are accepted and unused (we build
    our own chunk table from cu_seqlens); cp_context (FLA's torch context parallelism) raises
    ValueError: use `jax_cake_gdn.gdn_kcp` inside `jax.shard_map` instead.

    Ours, keyword only: backend, save_mode, deterministic (see `gdn`). Costs what `gdn` costs,
    plus the dtype casts of the module docstring and the state transposes.

    Returns:
      (o [B, T, HV, V] in q's dtype, final_state float32 or None), as FLA does.
    """
    state_v_first = _state_layout(kwargs, state_v_first)
    if "head_first" in kwargs:
        raise ValueError("head_first was removed from FLA; inputs are [B, T, H, ...]")
    chunk_size = kwargs.pop("chunk_size", 64)
    if chunk_size != 64:
        raise ValueError(f"chunk_size must be 64 here (our kernels' chunk), got {chunk_size!r}; "
                         "the result does not depend on the chunk size, drop the argument")
    if cp_context is not None:
        raise ValueError("cp_context (FLA's torch context parallelism) is not supported: call "
                         "jax_cake_gdn.gdn_kcp inside jax.shard_map")
    del cu_seqlens_cpu, chunk_indices  # FLA's precomputed host copies; gdn derives its own
    gate_kw = _take_gate_kw(kwargs)
    _no_more("chunk_gated_delta_rule", kwargs)
    q, k, v, g, beta, h0, out_dtype = _prepare(q, k, v, g, beta, initial_state, state_v_first,
                                               gate_kw)
    o, final = gdn(q, k, v, g, beta, cu_seqlens=cu_seqlens, scale=scale,
                   qk_l2norm=use_qk_l2norm_in_kernel, initial_state=h0, output_final_state=True,
                   save_mode=save_mode, deterministic=deterministic, backend=backend,
                   use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                   allow_neg_eigval=allow_neg_eigval, **gate_kw)
    return _finish(o, final, out_dtype, output_final_state, state_v_first)


def fused_recurrent_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array,
                                     g: jax.Array | None = None, gk=None, gv=None,
                                     beta: jax.Array | None = None, scale: float | None = None,
                                     initial_state: jax.Array | None = None,
                                     output_final_state: bool = False,
                                     use_qk_l2norm_in_kernel: bool = False,
                                     use_gate_in_kernel: bool = False,
                                     A_log: jax.Array | None = None,
                                     dt_bias: jax.Array | None = None,
                                     use_beta_sigmoid_in_kernel: bool = False,
                                     allow_neg_eigval: bool = False, state_v_first: bool = False,
                                     cu_seqlens: jax.Array | None = None, *,
                                     backend: str | None = None,
                                     **kwargs) -> tuple[jax.Array, jax.Array | None]:
    """FLA's `fused_recurrent_gated_delta_rule` (the decode op HF's Qwen3-Next calls).

    Same arguments, order and defaults as FLA. Without cu_seqlens it is `gdn_step` (a scan over
    the T tokens of each of the B rows; the cost grows with T, like FLA's); with cu_seqlens it
    runs the chunked `gdn` (the same recurrence; `backend` applies there). g None means no decay
    and beta None means beta = 1, as in FLA. gk and gv (FLA's per-channel decays, other
    operators than GDN's) raise ValueError. State layout, dtypes and return value as in
    `chunk_gated_delta_rule`.
    """
    state_v_first = _state_layout(kwargs, state_v_first)
    _no_more("fused_recurrent_gated_delta_rule", kwargs)
    for name, x in (("gk", gk), ("gv", gv)):
        if x is not None:
            raise ValueError(f"{name} (per-channel decay) is not supported: Gated DeltaNet's "
                             "decay g is one value per value head")
    if not hasattr(v, "shape"):
        raise TypeError(f"v must be an array, got {type(v).__name__}")
    shape = tuple(v.shape[:3])
    if g is None:
        if use_gate_in_kernel:
            raise ValueError("g (raw pre-activation) must be given when use_gate_in_kernel=True")
        g = jnp.zeros(shape, jnp.float32)
    if beta is None:
        beta = jnp.ones(shape, jnp.float32)
    gate_kw = dict(use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias) \
        if use_gate_in_kernel else {}
    q, k, v, g, beta, h0, out_dtype = _prepare(q, k, v, g, beta, initial_state, state_v_first,
                                               gate_kw)
    common = dict(scale=scale, qk_l2norm=use_qk_l2norm_in_kernel,
                  use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                  allow_neg_eigval=allow_neg_eigval, **gate_kw)
    if cu_seqlens is None:
        o, final = gdn_step(q, k, v, g, beta, h0, **common)
    else:
        o, final = gdn(q, k, v, g, beta, cu_seqlens=cu_seqlens, initial_state=h0,
                       output_final_state=True, backend=backend, **common)
    return _finish(o, final, out_dtype, output_final_state, state_v_first)
