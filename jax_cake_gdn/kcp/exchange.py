"""Cross-rank exchanges along the layout's chains (inside shard_map).

Piece summaries (M, B) map a piece's entry state to its exit state: S_out = M S_in + B. The
exchanges give every piece its entry state (its `carry`), composing along each chain in order:
carry[0] = 0, carry[p + 1] = M[p] carry[p] + B[p] (B[p] alone where piece p resets).

  a2a   lax.all_to_all: each rank sends its pieces' summaries to the chain's owner rank (c % W),
        the owner composes the chain and sends each piece's carry back (two all_to_alls).
  ring  lax.ppermute: states pass along the chain in layout order, rank to rank (W - 1 hops per
        direction; a zigzag chain goes up the ranks, then back down).

Both are plain JAX collectives and linear in the summaries' B, so the backward is their linear
transpose (core.py): the transposed maps, in reverse order, over the same collective (all_to_all
is its own transpose; ppermute reverses). Resets travel as flags (affine.py): a NaN in one
document never reaches the next.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..affine import apply, chain_carries
from .layout import chain_position

EXCHANGES = ("a2a", "ring")


def a2a(M, B, reset, axis_name: str, W: int):
    """M [C, m, HV, K, K], B [C, m, HV, K, V], reset [C, m] -> carries [C, m, HV, K, V]
    (owner = chain % W)."""
    C, m = M.shape[:2]
    K, V = M.shape[-1], B.shape[-1]
    Cw = -(-C // W)
    pad = Cw * W - C
    summ = jnp.pad(jnp.concatenate([M, B], axis=-1), ((0, pad),) + ((0, 0),) * (M.ndim - 1))
    flags = jnp.pad(reset, ((0, pad), (0, 0)))
    # chain c = i * W + owner -> send buffer [owner, i, m, ...]
    to_owner = lambda x: jax.lax.all_to_all(jnp.swapaxes(x.reshape((Cw, W) + x.shape[1:]), 0, 1),
                                            axis_name, 0, 0)  # [src rank, i, m, ...]
    recv, recv_flags = to_owner(summ), to_owner(flags)  # (flags apart: not linear in B)
    # owner: chain order (position p holds the piece of rank s, e with chain_position == p)
    by_pos = {}
    for s in range(W):
        for e in range(m):
            by_pos[chain_position(s, e, W)] = (s, e)
    in_order = lambda x: jnp.stack([x[by_pos[p][0], :, by_pos[p][1]] for p in range(W * m)],
                                   axis=1)
    chain, chain_flags = in_order(recv), in_order(recv_flags)
    carries = jax.vmap(lambda c, r: chain_carries(c[..., :K], c[..., K:K + V], r))(
        chain, chain_flags)  # [i, L, ...]
    back = jnp.stack([jnp.stack([carries[:, chain_position(s, e, W)] for e in range(m)], axis=1)
                      for s in range(W)])  # [dest rank, i, m, ...]
    got = jax.lax.all_to_all(back, axis_name, 0, 0)  # [owner, i, m, ...]
    got = jnp.swapaxes(got, 0, 1).reshape((Cw * W, m) + got.shape[3:])
    return got[:C]


def ring(M, B, reset, axis_name: str, W: int):
    """Same result as a2a, passing states rank to rank with ppermute along the chains."""
    m = M.shape[1]
    r = jax.lax.axis_index(axis_name)
    up = [(i, i + 1) for i in range(W - 1)]
    down = [(i + 1, i) for i in range(W - 1)]
    carry0 = jnp.zeros_like(B[:, 0])
    for _ in range(W - 1):  # after hop h, ranks <= h hold their final carry
        carry0 = jax.lax.ppermute(apply(M[:, 0], carry0, B[:, 0], reset[:, 0]), axis_name, up)
    if m == 1:
        return carry0[:, None]
    top = apply(M[:, 0], carry0, B[:, 0], reset[:, 0])  # rank W-1: its first piece feeds its second
    carry1 = jnp.where(r == W - 1, top, 0.0)
    for _ in range(W - 1):
        moved = jax.lax.ppermute(apply(M[:, 1], carry1, B[:, 1], reset[:, 1]), axis_name, down)
        carry1 = jnp.where(r == W - 1, top, moved)
    return jnp.stack([carry0, carry1], axis=1)


def neighbor_rows(tail, axis_name: str, W: int):
    """Each piece receives `tail` of the piece before it in its chain (zeros at position 0).

    tail: [C, m, ...] per piece. Used by the CP short conv for its history rows.
    """
    m = tail.shape[1]
    r = jax.lax.axis_index(axis_name)
    up = [(i, i + 1) for i in range(W - 1)]
    prev0 = jax.lax.ppermute(tail[:, 0], axis_name, up)
    if m == 1:
        return prev0[:, None]
    down = [(i + 1, i) for i in range(W - 1)]
    prev1 = jnp.where(r == W - 1, tail[:, 0], jax.lax.ppermute(tail[:, 1], axis_name, down))
    return jnp.stack([prev0, prev1], axis=1)
