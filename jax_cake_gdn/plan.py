"""How many units (intra-GPU segments) to cut a sequence into: the static plan of gdn and gdn_kcp.

The state walk is sequential over a segment's chunks and parallel over segments x value heads, one
CTA of the cuda walks per SM. When the *chains* (document fragments x value heads) already fill
the SMs, P = 1 and no transfer runs. Otherwise the packed axis is cut into P units: the walk then
takes about waves(P) / P of a whole chain (waves = ceil(P x chains / SMs)), and the transfer kernel
adds its own walk over the units that pass a state on, about TRANSFER_COST of a main walk's time
per chunk, in waves of its own. P is the cheapest value of that model within WAVE_SLACK, each unit
at least MIN_CHUNKS_PER_UNIT chunks long.
"""

from __future__ import annotations

from typing import NamedTuple

from .chunks import CHUNK

H200_SMS = 132
MIN_CHUNKS_PER_UNIT = 8
MAX_SEGMENTS = 16
WAVE_SLACK = 1.05
TRANSFER_COST = 0.5  # the transfer walk's time per chunk, relative to walk_output's


class Plan(NamedTuple):
    P: int  # units per piece (gdn: per packed sequence)
    chains: int  # document fragments x value heads the walk runs in parallel without units
    reason: str


def _waves(n: int, sms: int) -> int:
    return -(-n // sms)


def model_cost(P: int, chains: int, value_heads: int, num_sms: int) -> float:
    """The plan's model of the forward walk's time at P units, in whole-chain walks."""
    walk = _waves(P * chains, num_sms) / P
    if P == 1:
        return walk
    # a unit inside a document summarises M and B (two CTAs), the first one B alone
    transfer_ctas = value_heads * (2 * P - 3) * max(1, chains // value_heads)
    return walk + TRANSFER_COST * _waves(transfer_ctas, num_sms) / P


def plan_segments(num_tokens: int, num_value_heads: int, num_fragments: int, *,
                  segments: int | None = None, num_sms: int = H200_SMS,
                  what: str = "documents") -> Plan:
    """The plan for `num_tokens` packed tokens holding `num_fragments` document fragments."""
    chains = max(1, num_fragments) * num_value_heads
    if segments is not None:
        if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
            raise ValueError(f"segments must be a positive int or None, got {segments!r}")
        return Plan(segments, chains, "segments= given")
    if chains >= num_sms:
        return Plan(1, chains, f"{num_fragments} {what} x {num_value_heads} value heads = "
                               f"{chains} chains >= {num_sms} SMs")
    top = max(1, min(MAX_SEGMENTS, num_tokens // CHUNK // MIN_CHUNKS_PER_UNIT))
    cost = {p: model_cost(p, chains, num_value_heads, num_sms) for p in range(1, top + 1)}
    P = min(p for p, c in cost.items() if c <= WAVE_SLACK * min(cost.values()))
    return Plan(P, chains, f"{num_fragments} {what} x {num_value_heads} value heads = {chains} "
                           f"chains < {num_sms} SMs: {P} units (modelled walk time "
                           f"{cost[P]:.3f} of one chain; P <= {top})")
