"""short_conv(): causal depthwise convolution per document (the conv in front of GDN's q/k/v)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .checks import check_cu_seqlens

__all__ = ["short_conv"]

ACTIVATIONS = ("silu", None)
MAX_WIDTH = 4


def _conv_packed(x, weight, pos, activation):
    """x [T, C]; weight [C, W]; pos [T] = token position inside its document.

    y[t] = act(sum_j weight[:, j] * x[t - (W - 1) + j]), rows before the document start are zero.
    """
    W = weight.shape[1]
    xf = x.astype(jnp.float32)
    wf = weight.astype(jnp.float32)
    y = xf * wf[:, W - 1]
    for s in range(1, W):  # tap W-1-s looks s tokens back
        shifted = jnp.pad(xf, ((s, 0), (0, 0)))[: x.shape[0]]
        y = y + jnp.where((pos >= s)[:, None], shifted, 0.0) * wf[:, W - 1 - s]
    if activation == "silu":
        y = y * (1.0 / (1.0 + jnp.exp(-y)))
    return y.astype(x.dtype)


def doc_positions(bounds, T):
    """Position of every token inside its document, for bounds [N + 1] over T tokens."""
    bounds = jnp.asarray(bounds).astype(jnp.int32)
    t = jnp.arange(T, dtype=jnp.int32)
    doc = jnp.searchsorted(bounds[1:], t, side="right")
    return t - bounds[jnp.minimum(doc, bounds.shape[0] - 2)]


def short_conv(x, weight, *, cu_seqlens=None, activation="silu", backend=None):
    """Causal depthwise conv of width W <= 4 per document, then SiLU (or none).

    Args:
      x: [B, T, C] bfloat16 or float32.  weight: [C, W].
      cu_seqlens: optional int32 [N + 1] document bounds (B == 1); may be traced.
      activation: "silu" or None.
      backend: None, "xla" or "cuda"; the conv is jax.numpy on every backend today.
    Returns y [B, T, C] in x's dtype; gradients through JAX autodiff.
    """
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
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    if backend not in (None, "xla", "cuda"):
        raise ValueError(f"backend must be None, 'xla' or 'cuda', got {backend!r}")
    if cu_seqlens is None:
        bounds = np.arange(B + 1, dtype=np.int32) * T
    else:
        check_cu_seqlens(cu_seqlens, B, T)
        bounds = cu_seqlens
    pos = doc_positions(bounds, B * T)
    y = _conv_packed(x.reshape(B * T, C), weight, pos, activation)
    return y.reshape(B, T, C)
