"""How many units (P) to cut a sequence into: the static plan of gdn and gdn_kcp.

The state walk is sequential over a segment's chunks and parallel over segments x value heads,
one CTA of the cuda walks per SM. Units shorten the chains, but every unit that passes a state on
costs a transfer walk, and on an H200 that walk takes about as long per chunk as the main walk
(docs/performance.md, "Segments"). So:
- on one rank (gdn, gdn_kcp at W = 1) the plan is P = 1: measured, units do not pay there yet,
  not even for one long document; `segments=` still cuts them on request;
- across ranks a chain that crosses a rank pays the transfer anyway, so when the chains do not
  fill the SMs the plan models the walk as waves(P) / P of a whole chain plus the transfer's own
  waves (TRANSFER_COST of a main walk per chunk) and takes the cheapest P within WAVE_SLACK, each
  unit at least MIN_CHUNKS_PER_UNIT chunks long.
"""

from __future__ import annotations

from typing import NamedTuple

from .chunks import CHUNK

H200_SMS = 132
MIN_CHUNKS_PER_UNIT = 8
MAX_SEGMENTS = 16
WAVE_SLACK = 1.05
TRANSFER_COST = 1.0  # the transfer walk's time per chunk, relative to walk_output's


class Plan(NamedTuple):
    P: int  # units per piece (gdn: per packed sequence)
    chains: int  # document fragments x value heads the walk runs in parallel without units
    reason: str


def _waves(n: int, sms: int) -> int:
    return -(-n // sms)


def model_cost(P: int, chains: int, num_sms: int) -> float:
    """The plan's model of the forward walks' time at P units per piece on a rank whose chains
    cross its edges, in whole-chain walks: the main walk over P x chains CTAs of 1/P length, and
    the transfer (M and B of every unit) over 2 x P x chains of them."""
    return (_waves(P * chains, num_sms) + TRANSFER_COST * _waves(2 * P * chains, num_sms)) / P


def plan_segments(num_tokens: int, num_value_heads: int, num_fragments: int, *,
                  segments: int | None = None, num_ranks: int = 1, num_sms: int = H200_SMS,
                  what: str = "documents") -> Plan:
    """The plan for `num_tokens` packed tokens holding `num_fragments` document fragments, on
    one of `num_ranks` ranks."""
    chains = max(1, num_fragments) * num_value_heads
    if segments is not None:
        if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
            raise ValueError(f"segments must be a positive int or None, got {segments!r}")
        return Plan(segments, chains, "segments= given")
    if num_ranks == 1:
        return Plan(1, chains, "one rank: units do not pay there yet (the transfer walk costs "
                               "about a main walk per chunk); segments= cuts them on request")
    if chains >= num_sms:
        return Plan(1, chains, f"{num_fragments} {what} x {num_value_heads} value heads = "
                               f"{chains} chains >= {num_sms} SMs")
    top = max(1, min(MAX_SEGMENTS, num_tokens // CHUNK // MIN_CHUNKS_PER_UNIT))
    cost = {p: model_cost(p, chains, num_sms) for p in range(1, top + 1)}
    P = min(p for p, c in cost.items() if c <= WAVE_SLACK * min(cost.values()))
    return Plan(P, chains, f"{num_fragments} {what} x {num_value_heads} value heads = {chains} "
                           f"chains < {num_sms} SMs: {P} units (modelled walk time "
                           f"{cost[P]:.3f} of one chain; P <= {top})")
