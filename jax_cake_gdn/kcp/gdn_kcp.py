"""gdn_kcp(): context-parallel GDN inside jax.shard_map, over the same core op as gdn.

Per rank (its layout slice of the packed token axis):
  1. units: each piece (layout.py) cut into P units; segments = units cut again at document
     starts (chunks restart at every segment start);
  2. core.gdn_op with `KcpMerge`: the transfer kernel summarises the units that pass a state on,
     the merge composes each piece's units (locally), the exchange (a2a or ring, exchange.py) gives
     every piece its entry state, and the pieces' entries become their units' carries; then one
     walk_output from every segment's entry state. The backward is the merge's linear transpose
     (the same collectives, reversed) between the transfer's backward twin and one
     walk_chunk_bwd (core.py).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import primitives, vma
from ..affine import apply, chain_carries, matmul
from ..checks import check_arrays, check_cu_seqlens, check_gdn_inputs, concrete
from ..core import Config, gdn_op
from ..gates import apply_options
from ..guards import bounds_guard, cuda_only, floor_decay
from ..chunks import chunk_table
from ..segments import SegTable
from . import exchange as ex
from .layout import (Pieces, axis_size, chains_and_m, check_layout, doc_positions,
                     local_global_positions, rank_pieces)
from .plan import plan_kcp

__all__ = ["gdn_kcp"]


def local_tables(pieces: Pieces, cu, P: int, T_l: int, T_g: int) -> SegTable:
    """This rank's segment table: its pieces cut into P units each (piece-major), the units cut
    again at document starts. There are no initial or final states (row 0 of a zero h0)."""
    ls, ln, gs = (x.reshape(-1) for x in pieces)
    i = jnp.arange(P + 1, dtype=jnp.int32)
    ub = ls[:, None] + (ln[:, None] * i[None, :]) // P  # [pieces, P + 1]
    unit_start, unit_end = ub[:, :P].reshape(-1), ub[:, 1:].reshape(-1)
    U = unit_start.shape[0]
    doc_start = doc_positions(local_global_positions(pieces, T_l), cu) == 0
    flags = doc_start.at[unit_start].set(True, mode="drop").at[0].set(True)
    S = U + cu.shape[0] - 1
    seg_start = jnp.nonzero(flags, size=S, fill_value=T_l)[0].astype(jnp.int32)
    real = seg_start < T_l
    find = lambda a, x, side: jnp.searchsorted(a, x, side=side, method="compare_all")
    seg_unit = jnp.clip(find(unit_end, seg_start, "right"), 0, U - 1).astype(jnp.int32)
    starts_doc = real & doc_start[jnp.minimum(seg_start, T_l - 1)]
    takes_carry = real & (seg_start == unit_start[seg_unit]) & ~starts_doc
    unit_first = jnp.clip(find(seg_start, unit_start, "left"), 0, S - 1).astype(jnp.int32)
    unit_last = jnp.clip(find(seg_start, unit_end, "left") - 1, 0, S - 1).astype(jnp.int32)
    unit_empty = unit_end <= unit_start
    # the global token just past each unit: its chain goes on there unless a document starts
    piece = jnp.arange(U, dtype=jnp.int32) // P
    g_end = gs[piece] + (unit_end - ls[piece])
    goes_on = (g_end < T_g) & (doc_positions(jnp.minimum(g_end, T_g - 1), cu) != 0)
    passes = (real & (jnp.arange(S) == unit_last[seg_unit]) & goes_on[seg_unit]
              & ~unit_empty[seg_unit])
    zero, no = jnp.zeros((S,), jnp.int32), jnp.zeros((S,), bool)
    one = jnp.zeros((1,), jnp.int32)
    bounds = jnp.concatenate([seg_start, jnp.array([T_l], jnp.int32)])
    return SegTable(chunk_table(bounds, T_l), zero, starts_doc, no, seg_unit, takes_carry,
                    passes, unit_first, unit_last, unit_empty, one, one)


class KcpMerge(NamedTuple):
    """gdn_kcp's merge (core.py): units [pieces x P] (piece-major) -> their carries."""

    C: int  # chains
    m: int  # pieces per chain on this rank
    P: int  # units per piece
    W: int  # ranks
    axis_name: str
    exchange: str

    def __call__(self, M, B, reset):
        C, m, P = self.C, self.m, self.P
        unit_major = lambda x: jnp.moveaxis(x.reshape((C * m, P) + x.shape[1:]), 1, 0)
        M, B, reset = unit_major(M), unit_major(B), unit_major(reset)
        # 1. the P units of each piece compose into the piece's summary (M apart from B: the
        # backward transposes this in B alone, so no scan carry may mix the two)
        Mp, _ = jax.lax.scan(lambda acc, x: (matmul(x, acc), None), M[0], M[1:])
        rp = jnp.any(reset, axis=0)
        Mp = jnp.where(rp.reshape(rp.shape + (1, 1, 1)), 0.0, Mp)
        Bp = apply(M[-1], chain_carries(M, B, reset)[-1], B[-1], reset[-1])
        # 2. the exchange gives every piece its entry state
        xch = ex.a2a if self.exchange == "a2a" else ex.ring
        pieces = lambda x: x.reshape((C, m) + x.shape[1:])
        carry_p = xch(pieces(Mp), pieces(Bp), pieces(rp), self.axis_name, self.W)
        # 3. piece entries -> unit carries
        carry_u = chain_carries(M, B, reset, carry_p.reshape((C * m,) + carry_p.shape[2:]))
        return jnp.moveaxis(carry_u, 0, 1).reshape((C * m * P,) + carry_u.shape[2:])


def gdn_kcp(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
            cu_seqlens: jax.Array, axis_name: str, layout: str = "contiguous",
            exchange: str = "a2a", save_mode: str = "full", segments: int | None = None,
            num_docs: int | None = None, scale: float | None = None, qk_l2norm: bool = False,
            deterministic: bool = False, backend: str | None = None,
            use_gate_in_kernel: bool = False, A_log: jax.Array | None = None,
            dt_bias: jax.Array | None = None, use_beta_sigmoid_in_kernel: bool = False,
            allow_neg_eigval: bool = False) -> jax.Array:
    """Context-parallel `gdn`, called inside `jax.shard_map` over mesh axis `axis_name`.

    Each rank passes its slice of the layout-ordered packed token axis (`to_layout` makes that
    order from a global array): q, k [1, T/W, H, K]; v [1, T/W, HV, V]; g, beta [1, T/W, HV].
    `cu_seqlens` [N + 1] is global (replicated, may be traced; traced bounds that break the
    rules, e.g. a doc_zigzag document not a multiple of 2W, make o all NaN). Returns this rank's o.

    Cost per rank: gdn's kernels over its tokens, plus, for the units whose chain crosses a
    boundary (a rank's or a unit's edge inside a document), one state-only transfer walk over the
    units that pass a state on and its backward twin over the units that take one, and the
    exchange of one [K, K + V] summary and one [K, V] state per piece (twice in the backward).
    At W = 1 with the contiguous layout and P = 1 nothing crosses a boundary: gdn's kernels alone.

    layout: "contiguous" | "zigzag" | "doc_zigzag" (every document a multiple of 2W tokens).
    exchange: "a2a" (all_to_all to a chain owner and back) | "ring" (ppermute chain).
    save_mode: "full" (default) | "light" as in `gdn` (bitwise-equal gradients with
      deterministic=True).
      Both keep every segment's entry state and the units' transfer matrices (`gdn_M`, read by
      the backward's transposed merge).
    segments: P, the units per piece (default: `plan_kcp`, from document fragments x value
      heads against the SMs).
    num_docs: the number of documents the plan assumes when cu_seqlens is traced (default: its
      capacity N); concrete bounds are counted.
    deterministic: as in `gdn` (False lets the cuda backward sum dq, dk over each GVA group with
      atomic adds); the exchanges only move data. (The gradients of a replicated A_log / dt_bias
      are summed over the ranks by JAX's all-reduce, whose order is NCCL's.)
    use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval: FLA's gate
      options, as in `gdn` (g, beta are then this rank's raw inputs; A_log, dt_bias [HV] float32
      are replicated, and their gradients are summed over the ranks). Computed in jax.numpy
      before the kernels on every backend today.
    No initial/final state: documents start from zero.
    """
    check_arrays("gdn_kcp", q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens)
    W = axis_size(axis_name)
    if exchange not in ex.EXCHANGES:
        raise ValueError(f"exchange must be one of {ex.EXCHANGES}, got {exchange!r}")
    d = check_gdn_inputs(q, k, v, g, beta, cu_seqlens=None, scale=scale, initial_state=None,
                         save_mode=save_mode)
    if d.B != 1:
        raise ValueError(f"gdn_kcp needs the packed layout (B == 1), got B = {d.B}")
    g, beta = apply_options(g, beta, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                            dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                            allow_neg_eigval=allow_neg_eigval)
    g = floor_decay(g)
    T_l, T_g = d.T, d.T * W
    N = check_cu_seqlens(cu_seqlens, 1, T_g)
    check_layout(layout, cu_seqlens, T_g, W)
    cu_host = concrete(cu_seqlens)
    if cu_host is not None:
        num_docs = max(1, int(np.count_nonzero(np.diff(cu_host))))
    P = plan_kcp(T_l, d.HV, layout=layout, num_ranks=W, num_docs=N if num_docs is None else
                 num_docs, segments=segments).P
    cfg = Config(primitives.resolve(backend, K=d.K, V=d.V),
                 float(d.K**-0.5 if scale is None else scale),
                 bool(qk_l2norm), save_mode, deterministic=bool(deterministic))
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    if cfg.prims.name == "cuda":
        cu = cuda_only(cu)
    r = jax.lax.axis_index(axis_name)
    pieces = rank_pieces(layout, cu, r, W, T_g)
    C, m = chains_and_m(layout, N)
    tabs = local_tables(pieces, cu, P, T_l, T_g)
    q, k, v, g, beta = (x.reshape((T_l,) + x.shape[2:]) for x in (q, k, v, g, beta))
    guard_inputs, guard_outputs = bounds_guard(cfg.prims, cu_seqlens, T_g,
                                               2 * W if layout == "doc_zigzag" else 1)
    q, k, v, g, beta = guard_inputs((q, k, v, g, beta))
    # no unit can take a carry when the rank's one piece starts the sequence and is one unit
    alone = W == 1 and layout == "contiguous" and P == 1
    merge = None if alone else KcpMerge(C, m, P, W, axis_name, exchange)
    h0 = vma.zeros((1, d.HV, d.K, d.V), jnp.float32, v)
    o, _ = gdn_op(cfg, merge, q, k, v, g, beta, h0, tabs)
    return guard_outputs(o).reshape(1, T_l, d.HV, d.V)
