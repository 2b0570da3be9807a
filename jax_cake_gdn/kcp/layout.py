"""Context-parallel layouts: which global tokens each rank holds, and the helpers to move a global
packed array into layout order and back.

A rank's tokens are `pieces`: runs of consecutive global tokens. Every piece belongs to a
`chain` (the pieces whose states flow into each other, in global order) at a position in it:

    contiguous  1 chain of W pieces     rank r: piece r of the whole sequence
    zigzag      1 chain of 2W pieces    rank r: parts r and 2W-1-r of the sequence
    doc_zigzag  N chains of 2W pieces   rank r: parts r and 2W-1-r of every document

So a rank holds C chains x m pieces (m = 1 for contiguous, else 2), piece e of chain c at chain
position r (e = 0) or 2W-1-r (e = 1). Everything here is jnp and works on traced cu_seqlens.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..checks import concrete

LAYOUTS = ("contiguous", "zigzag", "doc_zigzag")


class Pieces(NamedTuple):
    """One rank's pieces, [C, m] each, in local order (row-major)."""

    local_start: jax.Array  # first local token of the piece
    length: jax.Array  # tokens
    global_start: jax.Array  # first global token


def axis_size(axis_name) -> int:
    """Ranks on `axis_name`; a clear error outside shard_map."""
    try:
        return jax.lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(f"gdn_kcp/short_conv with axis_name={axis_name!r} must be called inside "
                         f"jax.shard_map over a mesh with that axis ({e})") from None


def doc_positions(gpos, cu):
    """In-document position of global token positions gpos, for global bounds cu."""
    doc = jnp.searchsorted(cu[1:], gpos, side="right", method="compare_all")
    return gpos - cu[jnp.minimum(doc, cu.shape[0] - 2)]


def chains_and_m(layout: str, num_docs: int) -> tuple[int, int]:
    """(C chains, m pieces per chain per rank)."""
    return {"contiguous": (1, 1), "zigzag": (1, 2), "doc_zigzag": (num_docs, 2)}[layout]


def chain_position(rank, e: int, W: int):
    """Position in its chain of a rank's piece e."""
    return rank if e == 0 else 2 * W - 1 - rank


def check_layout(layout, cu_seqlens, num_tokens: int, W: int) -> None:
    """ValueError for an unknown layout or token counts the layout cannot split."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if isinstance(W, bool) or not isinstance(W, (int, np.integer)) or W < 1:
        raise ValueError(f"num_ranks must be a positive int, got {W!r}")
    parts = W if layout == "contiguous" else 2 * W
    if num_tokens % parts:
        raise ValueError(f"layout {layout!r} over {W} ranks needs the global token count "
                         f"({num_tokens}) to be a multiple of {parts}")
    if layout == "doc_zigzag":
        cu = concrete(cu_seqlens)
        if cu is not None:
            lengths = np.diff(cu)
            bad = np.nonzero(lengths % (2 * W))[0]
            if len(bad):
                n = int(bad[0])
                raise ValueError(f"layout 'doc_zigzag' needs every document's length to be a "
                                 f"multiple of 2W = {2 * W}: document {n} (cu_seqlens[{n}:{n + 2}]"
                                 f" = {cu[n:n + 2].tolist()}) has {int(lengths[n])} tokens")


def rank_pieces(layout: str, cu_seqlens, rank, W: int, num_tokens: int) -> Pieces:
    """Pieces of `rank` (int or traced) for global token count `num_tokens`."""
    T_l = num_tokens // W
    if layout == "contiguous":
        ls = jnp.zeros((1, 1), jnp.int32)
        ln = jnp.full((1, 1), T_l, jnp.int32)
        gs = jnp.reshape(rank * T_l, (1, 1)).astype(jnp.int32)
        return Pieces(ls, ln, gs)
    if layout == "zigzag":
        Z = num_tokens // (2 * W)
        ls = jnp.array([[0, Z]], jnp.int32)
        ln = jnp.full((1, 2), Z, jnp.int32)
        gs = jnp.stack([rank * Z, (2 * W - 1 - rank) * Z]).reshape(1, 2).astype(jnp.int32)
        return Pieces(ls, ln, gs)
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    z = (cu[1:] - cu[:-1]) // (2 * W)  # part length per document [N]
    ln = jnp.stack([z, z], axis=1)
    ls = (jnp.cumsum(2 * z) - 2 * z)[:, None] + jnp.stack([jnp.zeros_like(z), z], axis=1)
    gs = cu[:-1, None] + jnp.stack([rank * z, (2 * W - 1 - rank) * z], axis=1)
    return Pieces(ls.astype(jnp.int32), ln, gs.astype(jnp.int32))


def local_global_positions(pieces: Pieces, T_l: int):
    """Global position of every local token [T_l]."""
    ls = pieces.local_start.reshape(-1)
    ln = pieces.length.reshape(-1)
    gs = pieces.global_start.reshape(-1)
    t = jnp.arange(T_l, dtype=jnp.int32)
    # the piece holding t: the last non-empty piece starting at or before t
    starts = jnp.where(ln > 0, ls, T_l + 1)
    j = jnp.sum(starts[None, :] <= t[:, None], axis=1) - 1  # pieces are in local order
    order = jnp.argsort(starts, stable=True)
    j = order[jnp.clip(j, 0, ls.shape[0] - 1)]
    return gs[j] + (t - ls[j])


def layout_permutation(cu_seqlens, layout: str, W: int, num_tokens: int):
    """perm [T]: layout position p holds global token perm[p]."""
    T_l = num_tokens // W
    return jnp.concatenate([
        local_global_positions(rank_pieces(layout, cu_seqlens, r, W, num_tokens), T_l)
        for r in range(W)])


def _permute(x, perm, axis):
    """x[..., perm, ...] along axis, keeping x's sharding (explicit meshes need it said)."""
    x = jnp.asarray(x)
    idx = (slice(None),) * axis + (perm,)
    return x.at[idx].get(out_sharding=jax.typeof(x).sharding)


def to_layout(x: jax.Array, cu_seqlens: jax.Array, layout: str, num_ranks: int,
              axis: int = 1) -> jax.Array:
    """Global packed x -> layout order along `axis` (then shard it with P(..., axis_name, ...))."""
    T = x.shape[axis]
    check_layout(layout, cu_seqlens, T, num_ranks)
    return _permute(x, layout_permutation(cu_seqlens, layout, num_ranks, T), axis)


def from_layout(xs: jax.Array, cu_seqlens: jax.Array, layout: str, num_ranks: int,
                axis: int = 1) -> jax.Array:
    """Layout order -> global packed order along `axis` (the inverse of to_layout)."""
    T = xs.shape[axis]
    check_layout(layout, cu_seqlens, T, num_ranks)
    perm = layout_permutation(cu_seqlens, layout, num_ranks, T)
    inv = jnp.zeros((T,), jnp.int32).at[perm].set(jnp.arange(T, dtype=jnp.int32))
    return _permute(xs, inv, axis)
