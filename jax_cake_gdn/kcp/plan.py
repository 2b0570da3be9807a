"""plan_kcp(): the static segment count P per piece.

The state walk is sequential over a segment's chunks and parallel over (segments x value heads):
P = 1 when the rank's pieces x value heads already fill the GPU's SMs, else enough segments per
piece to fill them (each segment at least a few chunks long). Static: the plan sees shapes, not the
traced document bounds.
"""

from __future__ import annotations

from typing import NamedTuple

from ..chunks import CHUNK
from .layout import chains_and_m

H200_SMS = 132
MIN_CHUNKS_PER_SEGMENT = 4
MAX_SEGMENTS = 16


class KcpPlan(NamedTuple):
    P: int  # segments (units) per piece
    pieces: int  # pieces per rank (chains x m)
    reason: str


def plan_kcp(num_tokens_local: int, num_value_heads: int, *, layout: str = "contiguous",
             num_ranks: int = 1, num_docs: int = 1, segments: int | None = None,
             num_sms: int = H200_SMS) -> KcpPlan:
    """The static plan for one rank: P segments per piece, and why."""
    C, m = chains_and_m(layout, num_docs)
    pieces = C * m
    if segments is not None:
        if not isinstance(segments, int) or segments < 1:
            raise ValueError(f"segments must be a positive int or None, got {segments!r}")
        return KcpPlan(segments, pieces, "segments= given")
    work = pieces * num_value_heads
    if work >= num_sms:
        return KcpPlan(1, pieces, f"{pieces} pieces x {num_value_heads} value heads = {work} "
                                  f">= {num_sms} SMs")
    want = -(-num_sms // work)
    chunks_per_piece = max(1, num_tokens_local // pieces // CHUNK)
    P = max(1, min(want, MAX_SEGMENTS, chunks_per_piece // MIN_CHUNKS_PER_SEGMENT))
    return KcpPlan(P, pieces, f"{pieces} pieces x {num_value_heads} value heads = {work} < "
                              f"{num_sms} SMs: {P} segments per piece (wanted {want}, "
                              f"{chunks_per_piece} chunks per piece, >= "
                              f"{MIN_CHUNKS_PER_SEGMENT} chunks per segment)")
