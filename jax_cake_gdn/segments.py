"""The segment table: how the packed token axis is cut into segments, units and documents.

A *segment* is a run of tokens walked as one chain (chunks restart at every segment start). A
*unit* is a run of tokens whose affine summary the merges compose: gdn cuts the packed axis into P
equal units (intra-GPU segments, docs/design.md section 3), gdn_kcp cuts each rank's pieces into P
units. Segments are the units cut again at document starts, so a segment's entry is either its
document's initial state (`starts_doc`) or its unit's carry (`takes_carry`), and its exit is
either its document's final state (`ends_doc`) or its unit's exit passed to the next unit
(`passes`). Everything here is jax.numpy on possibly traced bounds, with static sizes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .chunks import ChunkTable, chunk_table


class SegTable(NamedTuple):
    ct: ChunkTable  # the chunks of the segments
    seg_doc: jax.Array  # [S] int32: the row of h0 / final of the segment's document
    starts_doc: jax.Array  # [S] bool: the entry is the document's initial state
    ends_doc: jax.Array  # [S] bool: the exit is the document's final state
    seg_unit: jax.Array  # [S] int32: the unit holding the segment
    takes_carry: jax.Array  # [S] bool: the entry is the unit's carry (the unit's first segment)
    passes: jax.Array  # [S] bool: the exit is the unit's, taken by the next unit of its chain
    unit_first: jax.Array  # [U] int32: the unit's first segment
    unit_last: jax.Array  # [U] int32: the unit's last segment
    unit_empty: jax.Array  # [U] bool: no tokens (its summary is the identity)
    doc_first_seg: jax.Array  # [N] int32: the document's first segment (its entry)
    doc_last_seg: jax.Array  # [N] int32: the document's last segment (its exit)

    @property
    def num_units(self) -> int:
        return self.unit_first.shape[0]

    def unit_needs(self):
        """(m_seg, b_seg, g_seg) [U] int32, -1 where nothing is needed: the segment whose
        transfer matrix is the unit's (its one segment takes a carry and passes it on), the
        segment whose exit the unit passes on, and the segment whose entry gradient the unit's
        carry gets (its first segment takes a carry)."""
        first, last = self.unit_first, self.unit_last
        ok = ~self.unit_empty
        m_seg = jnp.where(ok & self.takes_carry[first] & self.passes[first], first, -1)
        b_seg = jnp.where(ok & self.passes[last], last, -1)
        g_seg = jnp.where(ok & self.takes_carry[first], first, -1)
        return m_seg.astype(jnp.int32), b_seg.astype(jnp.int32), g_seg.astype(jnp.int32)


def _find(sorted_, x, side):
    """searchsorted without a while loop in the lowered program (as chunks.py)."""
    return jnp.searchsorted(sorted_, x, side=side, method="compare_all")


def doc_segments(bounds, num_tokens: int, P: int) -> SegTable:
    """gdn's table: documents `bounds` ([N + 1], cu_seqlens-like, may be traced) over
    `num_tokens` packed tokens, cut into P equal units. P = 1: one segment per document (S = N).
    P > 1: S = N + P; every document keeps its own segments (an empty one a zero-length one),
    and unused segments are zero-length at the end."""
    cu = jnp.asarray(bounds).astype(jnp.int32)
    N, T = cu.shape[0] - 1, num_tokens
    i32 = lambda x: jnp.asarray(x).astype(jnp.int32)
    if P == 1:  # (distinct arrays: JAX keeps a residual once however often it appears)
        docs = lambda: jnp.arange(N, dtype=jnp.int32)
        flag = lambda x: jnp.full((N,), x)
        none = lambda dtype: jnp.zeros((0,), dtype)
        return SegTable(chunk_table(cu, T), docs(), flag(True), flag(True),
                        jnp.zeros((N,), jnp.int32), flag(False), flag(False), none(jnp.int32),
                        none(jnp.int32), none(bool), docs(), docs())
    u = jnp.arange(P, dtype=jnp.int32)
    unit_start, unit_end = i32(u * T // P), i32((u + 1) * T // P)
    is_doc_start = jnp.any(unit_start[:, None] == cu[None, :-1], axis=1)
    cand = jnp.concatenate([cu[:-1], jnp.where(is_doc_start, T, unit_start)])
    order = jnp.argsort(cand, stable=True)  # documents before units at equal positions
    start = cand[order]
    S = N + P
    real = start < T
    is_doc = order < N
    sentinel = ~is_doc & ~real
    doc = jnp.where(is_doc, order, _find(cu, start, "right") - 1)
    doc = i32(jnp.clip(doc, 0, N - 1))
    nxt_doc = jnp.concatenate([is_doc[1:] | sentinel[1:], jnp.ones((1,), bool)])
    ends_doc = ~sentinel & nxt_doc
    takes_carry = ~is_doc & real
    passes = real & ~ends_doc
    seg_unit = i32(jnp.clip(_find(unit_end, start, "right"), 0, P - 1))
    unit_first = i32(_find(start, unit_start, "left"))
    unit_last = i32(jnp.clip(_find(start, unit_end, "left") - 1, 0, S - 1))
    doc_first_seg = i32(jnp.argsort(order)[:N])
    used = jnp.sum(~sentinel).astype(jnp.int32)  # the unused segments follow every document's
    doc_last_seg = jnp.concatenate([doc_first_seg[1:], used[None]]) - 1
    bounds_s = jnp.concatenate([start, jnp.array([T], jnp.int32)])
    return SegTable(chunk_table(bounds_s, T), doc, is_doc, ends_doc, seg_unit, takes_carry,
                    passes, jnp.minimum(unit_first, S - 1), unit_last, unit_end <= unit_start,
                    doc_first_seg, doc_last_seg)
