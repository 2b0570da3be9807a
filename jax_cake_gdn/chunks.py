"""The chunk table: where every 64-token chunk of a packed token axis starts, and whose it is.

Chunks restart at every segment start (a document on one device; a fragment or a segment of one
under context parallelism) and never cross one. `bounds` is cu_seqlens-like (segment s holds
tokens [bounds[s], bounds[s+1])) and may be traced: the table has static shapes, sized for the
worst case of `len(bounds) - 1` segments, so new boundaries never retrace. Lookups use
searchsorted's compare_all method: no while loop in the lowered program.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

CHUNK = 64


def num_chunks(num_tokens: int, num_segments: int) -> int:
    """Static chunk capacity: sum over segments of ceil(len / 64) is at most this."""
    return max(1, (num_tokens + (CHUNK - 1) * num_segments) // CHUNK)


class ChunkTable(NamedTuple):
    """All int32 (or bool) device arrays; NC = num_chunks(T, S)."""

    start: jax.Array  # [NC] first token of the chunk (T for an unused chunk)
    length: jax.Array  # [NC] tokens in the chunk, 0..64 (0: unused)
    seg: jax.Array  # [NC] segment of the chunk (clamped to S - 1 for unused chunks)
    first: jax.Array  # [NC] bool: first chunk of its segment (the entry state is loaded here)
    last: jax.Array  # [NC] bool: last chunk of its segment (its exit state is the segment's)
    seg_first: jax.Array  # [S] index of the segment's first chunk (valid when seg_len > 0)
    seg_last: jax.Array  # [S] index of the segment's last chunk (valid when seg_len > 0)
    seg_len: jax.Array  # [S] tokens in the segment
    # [S] the segments longest first (ties in table order): the order in which the cuda walks
    # start their CTAs, so that no long segment starts last and runs alone (longest first)
    seg_order: jax.Array
    token_chunk: jax.Array  # [T] chunk of each token
    token_pos: jax.Array  # [T] position of each token inside its chunk

    @property
    def num_chunks(self) -> int:
        return self.start.shape[0]

    @property
    def num_segments(self) -> int:
        return self.seg_len.shape[0]


def chunk_table(bounds, num_tokens: int) -> ChunkTable:
    """Build the table for segments `bounds` ([S + 1], 0 = bounds[0] <= ... <= bounds[S] = T)."""
    bounds = jnp.asarray(bounds).astype(jnp.int32)
    S = bounds.shape[0] - 1
    T = num_tokens
    NC = num_chunks(T, S)
    seg_len = bounds[1:] - bounds[:-1]
    nch = (seg_len + CHUNK - 1) // CHUNK
    off_end = jnp.cumsum(nch).astype(jnp.int32)
    off = off_end - nch

    c = jnp.arange(NC, dtype=jnp.int32)
    seg_raw = jnp.searchsorted(off_end, c, side="right", method="compare_all").astype(jnp.int32)
    used = seg_raw < S
    seg = jnp.minimum(seg_raw, S - 1)
    start = bounds[seg] + (c - off[seg]) * CHUNK
    length = jnp.where(used, jnp.clip(bounds[seg + 1] - start, 0, CHUNK), 0)
    start = jnp.where(used, start, T)
    first = used & (c == off[seg])
    last = used & (c == off_end[seg] - 1)

    t = jnp.arange(T, dtype=jnp.int32)
    tseg = jnp.searchsorted(bounds[1:], t, side="right", method="compare_all")
    tseg = jnp.minimum(tseg, S - 1).astype(jnp.int32)
    rel = t - bounds[tseg]
    token_chunk = off[tseg] + rel // CHUNK
    token_pos = rel % CHUNK
    seg_order = jnp.argsort(-seg_len, stable=True).astype(jnp.int32)
    return ChunkTable(start, length, seg, first, last, off, off_end - 1, seg_len, seg_order,
                      token_chunk, token_pos)
