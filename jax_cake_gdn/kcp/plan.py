"""plan_kcp(): the static unit count P per piece of gdn_kcp, from document fragments per rank.

The same model as gdn's intra-GPU segments (jax_cake_gdn/plan.py), fed with the document
fragments one rank holds: about N / W + 1 for the contiguous layout, N / W + 2 for zigzag (its two
pieces) and 2N for doc_zigzag (two parts of every document). Static: the plan sees shapes and a
document count (concrete bounds are counted; traced ones use the capacity or the caller's hint).
"""

from __future__ import annotations

from ..plan import H200_SMS, Plan, plan_segments
from .layout import LAYOUTS

KcpPlan = Plan


def fragments_per_rank(layout: str, num_ranks: int, num_docs: int) -> int:
    """Document fragments one rank holds (an estimate for contiguous and zigzag)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    n, W = max(1, num_docs), num_ranks
    if layout == "contiguous":
        return min(n, -(-n // W) + (W > 1))
    if layout == "zigzag":
        return min(n + 1, -(-n // W) + 2)
    return 2 * n


def plan_kcp(num_tokens_local: int, num_value_heads: int, *, layout: str = "contiguous",
             num_ranks: int = 1, num_docs: int = 1, segments: int | None = None,
             num_sms: int = H200_SMS) -> Plan:
    """The static plan for one rank: P units per piece, and why."""
    frags = fragments_per_rank(layout, num_ranks, num_docs)
    return plan_segments(num_tokens_local, num_value_heads, frags, segments=segments,
                         num_ranks=num_ranks, num_sms=num_sms, what="document fragments")
