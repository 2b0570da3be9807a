"""Packed rows: B rows of T tokens as one packed axis of B * T tokens, documents never crossing a
row. Document bounds come per row, as [B, N + 1] (row b's bounds over its own T tokens), or as
one [N + 1] array when B == 1; both flatten to one bounds array over the packed axis."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def packed_bounds(cu_seqlens, B: int, T: int):
    """(bounds [M + 1] over B * T tokens, M documents): one document per row without cu_seqlens,
    cu_seqlens as given when 1-D, and row b's bounds + b * T when [B, N + 1] (M = B * N; row b's
    documents are b * N ... b * N + N - 1). Traceable, static sizes."""
    if cu_seqlens is None:
        return np.arange(B + 1, dtype=np.int32) * T, B
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    if cu.ndim == 1:
        return cu, cu.shape[0] - 1
    rows = cu[:, :-1] + (jnp.arange(B, dtype=jnp.int32) * T)[:, None]
    return jnp.concatenate([rows.reshape(-1), jnp.full((1,), B * T, jnp.int32)]), rows.size
