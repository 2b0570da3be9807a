"""short_conv(): causal depthwise convolution per document (the conv in front of GDN's q/k/v)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import primitives, sharding, vma
from .checks import bounds_ok, check_arrays, check_cu_seqlens, concrete
from .guards import bounds_guard, cuda_only, nan_guard
from .rows import packed_bounds

__all__ = ["short_conv"]

ACTIVATIONS = ("silu", None)
MAX_WIDTH = 4


def _conv_packed(x, weight, pos, activation, history=None):
    """x [T, C]; weight [C, W]; pos [T] = token position inside its document.

    y[t] = act(sum_j weight[:, j] * x[t - (W - 1) + j]), rows before the document start are zero.
    `history(s)` gives the rows s tokens back where they lie before this array (CP), else zeros.
    """
    W = weight.shape[1]
    xf = x.astype(jnp.float32)
    wf = weight.astype(jnp.float32)
    y = xf * wf[:, W - 1]
    for s in range(1, W):  # tap W-1-s looks s tokens back
        shifted = jnp.pad(xf, ((s, 0), (0, 0)))[: x.shape[0]] if history is None else history(s)
        y = y + jnp.where((pos >= s)[:, None], shifted, 0.0) * wf[:, W - 1 - s]
    if activation == "silu":
        y = y * (1.0 / (1.0 + jnp.exp(-y)))
    return y.astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _conv_cuda(x, weight, pos, activation):
    """`_conv_packed` as the cuda kernels (cuda/conv.cu), forward and backward."""
    from .primitives import cuda

    return cuda.conv_fwd(x, weight, pos, activation=activation)


def _conv_cuda_fwd(x, weight, pos, activation):
    return _conv_cuda(x, weight, pos, activation), (x, weight, pos)


def _conv_cuda_bwd(activation, res, dy):
    from .primitives import cuda

    x, weight, pos = res
    dx, dweight = cuda.conv_bwd(x, weight, pos, dy, activation=activation)
    return dx, dweight, None


_conv_cuda.defvjp(_conv_cuda_fwd, _conv_cuda_bwd)


def _conv_kcp(x, weight, cu, axis_name, layout, activation):
    """The rank's conv: rows before a piece's first token come from the previous piece of its
    chain (kcp/layout.py), never across a document start; autodiff sends their gradient back."""
    from .kcp import exchange as ex
    from .kcp.layout import (axis_size, check_layout, doc_positions, local_global_positions,
                             rank_pieces)

    W_ranks = axis_size(axis_name)
    T_l, C = x.shape
    T_g = T_l * W_ranks
    check_layout(layout, cu, T_g, W_ranks)
    cu = jnp.asarray(cu).astype(jnp.int32)
    pieces = rank_pieces(layout, cu, jax.lax.axis_index(axis_name), W_ranks, T_g)
    ls, ln = pieces.local_start, pieces.length  # [Cc, m]
    H = weight.shape[1] - 1  # history rows
    xf = x.astype(jnp.float32)
    hist = jnp.zeros(ls.shape + (H, C), jnp.float32)
    i = jnp.arange(H)
    # a piece's tail = its last H rows, reaching into its own history when it is shorter than H;
    # H rounds of neighbour exchange make every history exact, whatever the piece lengths
    for _ in range(H):
        e = ln[..., None] + i  # index into concat(history, piece)
        own = xf[jnp.clip(ls[..., None] + e - H, 0, T_l - 1)]
        tail = jnp.where((e >= H)[..., None], own,
                         jnp.take_along_axis(hist, jnp.clip(e, 0, H - 1)[..., None], axis=-2))
        hist = ex.neighbor_rows(tail, axis_name, W_ranks)
    gpos = local_global_positions(pieces, T_l)
    pos = doc_positions(gpos, cu)
    flat_ls = ls.reshape(-1)
    starts = jnp.where(ln.reshape(-1) > 0, flat_ls, T_l + 1)
    order = jnp.argsort(starts, stable=True)
    t = jnp.arange(T_l)
    piece = order[jnp.clip(jnp.sum(starts[None, :] <= t[:, None], 1) - 1, 0, starts.shape[0] - 1)]
    off = t - flat_ls[piece]  # offset of t inside its piece
    hist_flat = hist.reshape((-1, H, C))

    def history(s):
        inside = xf[jnp.clip(t - s, 0, T_l - 1)]
        before = hist_flat[piece, jnp.clip(H - s + off, 0, H - 1)]
        return jnp.where((off >= s)[:, None], inside, before)

    return _conv_packed(x, weight, pos, activation, history)


def doc_positions(bounds, T):
    """Position of every token inside its document, for bounds [N + 1] over T tokens."""
    bounds = jnp.asarray(bounds).astype(jnp.int32)
    t = jnp.arange(T, dtype=jnp.int32)
    doc = jnp.searchsorted(bounds[1:], t, side="right", method="compare_all")
    return t - bounds[jnp.minimum(doc, bounds.shape[0] - 2)]


def _local(cuda: bool, activation, guard: bool, args: dict):
    """short_conv on one device's block (sharding.call): args holds x, weight and optionally
    cu_seqlens."""
    x, weight, cu = args["x"], args["weight"], args.get("cu_seqlens")
    B, T, C = x.shape
    bounds, _ = packed_bounds(cu, B, T)
    if cuda:
        bounds = cuda_only(bounds)
    pos = doc_positions(bounds, B * T)
    axes = vma.union(x, weight)  # the cuda backward returns dx, dweight with both's axes
    x, weight = vma.cast(x, axes), vma.cast(weight, axes)
    if cuda:
        from .primitives import cuda as prims  # (its nan_unless)
    else:
        prims = primitives.XLA
    guard_inputs, guard_outputs = nan_guard(prims, bounds_ok(cu, T) if guard else None)
    x, weight = guard_inputs((x, weight))
    y = (_conv_cuda if cuda else _conv_packed)(x.reshape(B * T, C), weight, pos, activation)
    return (guard_outputs(y.reshape(B, T, C)),)


def short_conv(x: jax.Array, weight: jax.Array, *, cu_seqlens: jax.Array | None = None,
               activation: str | None = "silu", backend: str | None = None,
               axis_name: str | None = None, layout: str = "contiguous") -> jax.Array:
    """Causal depthwise conv of width W <= 4 per document, then SiLU (or none).

    Args:
      x: [B, T, C] bfloat16 or float32.  weight: [C, W] bfloat16 or float32.
      cu_seqlens: optional int32 document bounds, as in `gdn`: [N + 1] over T (then B == 1), or
        per row [B, N + 1], each row's bounds over its own T tokens. May be traced; concrete
        bounds are checked (ValueError), traced ones that break the rules make y NaN on every
        device holding a bad row (all of y on one device) and put NaN into its gradients.
      activation: "silu" or None.
      backend: None (cuda when the extension is built and a GPU is visible, else xla), "xla" or
        "cuda". cuda: CUDA kernels forward and backward (cuda/conv.cu, a custom_vjp; dweight is
        deterministic); xla: jax.numpy with JAX autodiff.
      axis_name, layout: the context-parallel form, inside jax.shard_map: x is this rank's slice
        [1, T / W, C] of the layout-ordered tokens (see `to_layout`), cu_seqlens is global and
        required. The first W - 1 rows of a continuing document come from the previous piece in
        layout order. This form is jax.numpy (autodiff) on every backend.

    Sharding (without axis_name; jax_cake_gdn.sharding): x may be sharded over the batch and the
    channels (weight's channels with them) on Explicit or Auto mesh axes, or be one device's
    block inside jax.shard_map; each device convolves its block, with no collective beyond
    summing dweight over the batch shards. A sharded token axis is a ValueError: use axis_name.

    Returns y [B, T, C] in x's dtype.
    """
    check_arrays("short_conv", x=x, weight=weight, cu_seqlens=cu_seqlens)
    if not hasattr(x, "ndim") or x.ndim != 3:
        raise ValueError(f"x must be [B, T, C], got {getattr(x, 'shape', type(x).__name__)}")
    if not hasattr(weight, "ndim") or weight.ndim != 2:
        raise ValueError(f"weight must be [C, W], got {getattr(weight, 'shape', type(weight))}")
    B, T, C = x.shape
    if weight.shape[0] != C:
        raise ValueError(f"weight must be [C, W] with C = {C}, got {tuple(weight.shape)}")
    if not 1 <= weight.shape[1] <= MAX_WIDTH:
        raise ValueError(f"weight width W must be in 1..{MAX_WIDTH}, got {weight.shape[1]}")
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        raise TypeError(f"x must be bfloat16 or float32, got {x.dtype}")
    if weight.dtype not in (jnp.bfloat16, jnp.float32):  # the same rule on every backend
        raise TypeError(f"weight must be bfloat16 or float32, got {weight.dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    if backend not in (None, "xla", "cuda"):
        raise ValueError(f"backend must be None, 'xla' or 'cuda', got {backend!r}")
    if axis_name is not None:
        if cu_seqlens is None:
            raise ValueError("short_conv with axis_name (context parallel) needs cu_seqlens")
        from .kcp.layout import axis_size

        W = axis_size(axis_name)
        check_cu_seqlens(cu_seqlens, B, T * W)
        guard_inputs, guard_outputs = bounds_guard(primitives.XLA, cu_seqlens, T * W,
                                                   2 * W if layout == "doc_zigzag" else 1)
        x, weight = guard_inputs((x, weight))
        y = _conv_kcp(x.reshape(T, C), weight, cu_seqlens, axis_name, layout, activation)
        return guard_outputs(y.reshape(B, T, C))
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, B, T, per_row=True)
    args = {n: a for n, a in dict(x=x, weight=weight, cu_seqlens=cu_seqlens).items()
            if a is not None}
    ins = dict(x="b t h", weight="h w")
    if cu_seqlens is not None:
        ins["cu_seqlens"] = "m" if cu_seqlens.ndim == 1 else "b m"
    rule = sharding.Rule("short_conv", ins, ("b t h",), {},
                         {"b": "batch rows B", "h": "channels C"})
    guard = cu_seqlens is not None and concrete(cu_seqlens) is None  # concrete: checked above
    local = functools.partial(_local, primitives.use_cuda(backend), activation, guard)
    return sharding.call(local, rule, args)[0]
