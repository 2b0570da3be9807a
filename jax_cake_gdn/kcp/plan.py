"""plan_kcp(): the static segment count P per piece.

The state walk is sequential over a segment's chunks and parallel over (segments x value heads),
one CTA per SM (the cuda walks at K = V = 128). P = 1 when the rank's pieces x value heads already
fill the SMs. Else the walk's time is modelled as waves / P (waves = ceil(P x pieces x heads /
SMs), each wave a 1/P-long chain), and P is the smallest value within WAVE_SLACK of that model's
minimum, with each segment at least MIN_CHUNKS_PER_SEGMENT chunks long. For 48 value heads: P = 8
(0.375 of a whole-piece chain; P = 3 gives 0.67). Measured on two H200s, one 262144-token
document, fwd+bwd: P = 1, 2, 3, 4, 5, 8, 11 took 146.5, 107.6, 122.6, 108.7, 101.5, 101.0, 100.8
ms (notes/performance.md, session 13). Static: the plan sees shapes, not the traced document bounds.
"""

from __future__ import annotations

from typing import NamedTuple

from ..chunks import CHUNK
from .layout import chains_and_m

H200_SMS = 132
MIN_CHUNKS_PER_SEGMENT = 4
MAX_SEGMENTS = 16
WAVE_SLACK = 1.05


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
    chunks_per_piece = max(1, num_tokens_local // pieces // CHUNK)
    top = max(1, min(MAX_SEGMENTS, chunks_per_piece // MIN_CHUNKS_PER_SEGMENT))
    cost = {p: -(-p * work // num_sms) / p for p in range(1, top + 1)}
    P = min(p for p, c in cost.items() if c <= WAVE_SLACK * min(cost.values()))
    return KcpPlan(P, pieces, f"{pieces} pieces x {num_value_heads} value heads = {work} < "
                              f"{num_sms} SMs: {P} segments per piece (walk time {cost[P]:.3f} "
                              f"of a whole-piece chain; P <= {top}: {chunks_per_piece} chunks "
                              f"per piece, >= {MIN_CHUNKS_PER_SEGMENT} chunks per segment)")
