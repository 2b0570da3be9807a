"""Affine state summaries: the algebra of segments, context parallelism and their merges.

A span of chunks maps its entry state to its exit state by S_out = M S_in + B (M [.., K, K],
B [.., K, V]; docs/design.md section 3). A span with a document start inside `resets`: its exit
does not depend on its entry (M = 0). Resets are carried as a flag and applied with `where`, not
by multiplying with M = 0, so a NaN in one document never reaches the next (NaN * 0 is NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import vma

_HI = jax.lax.Precision.HIGHEST


def _flag(reset, x):
    return reset.reshape(reset.shape + (1,) * (x.ndim - reset.ndim))


def matmul(M, S):
    """M S over the state's key axis (M [..., K, K], S [..., K, V]), in full f32."""
    return jnp.einsum("...kj,...jv->...kv", M, S, precision=_HI)


def apply(M, S, B, reset):
    """M S + B, or B alone where `reset` (M [..., K, K], S, B [..., K, V], reset [...])."""
    return jnp.where(_flag(reset, B), B, matmul(M, S) + B)


def chain_carries(M, B, reset, carry0=None):
    """Entry states along axis 0: carry[0] = carry0 (or 0), carry[i + 1] = apply(i, carry[i])."""
    c0 = vma.zeros(B.shape[1:], B.dtype, M, B, reset) if carry0 is None else carry0

    def step(c, mbr):
        return apply(*mbr[:1], c, *mbr[1:]), c

    _, out = jax.lax.scan(step, c0, (M, B, reset))
    return out
