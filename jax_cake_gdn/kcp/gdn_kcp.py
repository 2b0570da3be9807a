"""gdn_kcp(): context-parallel GDN inside jax.shard_map, written once over the gdn op.

Per rank (its layout slice of the packed token axis):
  1. units: each piece (layout.py) cut into P segments; local segments = units cut further at
     document starts (chunks restart at every segment start);
  2. transfer walks: two `_gdn_packed` calls give every unit's affine summary: B_seg [K, V] (v from
     a zero entry) and M_seg [K, K] (zero values from the entry I); a document start inside a
     unit resets both, so M_seg = 0 there;
  3. merge: units -> piece summaries (local), exchange (a2a or ring) -> piece carries, then
     piece carries -> unit carries (local);
  4. state walk + output: one `_gdn_packed` call with every segment's entry state.
The backward is JAX's transpose of steps 2-4: each `_gdn_packed` call runs its custom_vjp rules
(the primitives' backward twins), merges run with M_seg^T, collectives in reverse.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from .. import primitives, vma
from ..checks import check_cu_seqlens, check_gdn_inputs
from ..chunks import chunk_table
from ..gates import apply_options
from ..gdn import _Config, _gdn_packed, bounds_guard
from . import exchange as ex
from .layout import Pieces, chains_and_m, check_layout, local_global_positions, rank_pieces
from .plan import plan_kcp

__all__ = ["gdn_kcp"]


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


class LocalTables(NamedTuple):
    seg_bounds: jax.Array  # [S + 1] local segment bounds (S = U + N)
    seg_unit: jax.Array  # [S] unit of each segment
    takes_carry: jax.Array  # [S] bool: the segment's entry state is its unit's carry (else zero)
    unit_last_seg: jax.Array  # [U] the unit's last segment
    unit_nonempty: jax.Array  # [U] bool


def local_tables(pieces: Pieces, cu, P: int, T_l: int) -> LocalTables:
    ls = pieces.local_start.reshape(-1)
    ln = pieces.length.reshape(-1)
    i = jnp.arange(P + 1, dtype=jnp.int32)
    ub = ls[:, None] + (ln[:, None] * i[None, :]) // P  # [pieces, P + 1]
    unit_start = ub[:, :P].reshape(-1)
    unit_end = ub[:, 1:].reshape(-1)
    gpos = local_global_positions(pieces, T_l)
    doc_start = doc_positions(gpos, cu) == 0
    flags = doc_start.at[unit_start].set(True, mode="drop").at[0].set(True)
    S = unit_start.shape[0] + cu.shape[0] - 1
    seg_start = jnp.nonzero(flags, size=S, fill_value=T_l)[0].astype(jnp.int32)
    bounds = jnp.concatenate([seg_start, jnp.array([T_l], jnp.int32)])
    nonempty = bounds[1:] > bounds[:-1]
    U = unit_start.shape[0]
    seg_unit = jnp.searchsorted(unit_end, seg_start, side="right", method="compare_all")
    seg_unit = jnp.minimum(seg_unit, U - 1)
    first_of_unit = nonempty & (seg_start == unit_start[seg_unit])
    starts_doc = nonempty & doc_start[jnp.minimum(seg_start, T_l - 1)]
    unit_last_seg = jnp.searchsorted(seg_start, unit_end, side="left", method="compare_all") - 1
    return LocalTables(bounds, seg_unit.astype(jnp.int32), first_of_unit & ~starts_doc,
                       jnp.maximum(unit_last_seg, 0).astype(jnp.int32), unit_end > unit_start)


def _bcast(mask, x):
    return mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim))


def gdn_kcp(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
            cu_seqlens: jax.Array, axis_name: str, layout: str = "contiguous",
            exchange: str = "a2a", save_mode: str = "light", save_transfer: bool | None = None,
            segments: int | None = None, scale: float | None = None, qk_l2norm: bool = False,
            deterministic: bool = False, backend: str | None = None,
            use_gate_in_kernel: bool = False, A_log: jax.Array | None = None,
            dt_bias: jax.Array | None = None, use_beta_sigmoid_in_kernel: bool = False,
            allow_neg_eigval: bool = False) -> jax.Array:
    """Context-parallel `gdn`, called inside `jax.shard_map` over mesh axis `axis_name`.

    Each rank passes its slice of the layout-ordered packed token axis (`to_layout` makes that
    order from a global array): q, k [1, T/W, H, K]; v [1, T/W, HV, V]; g, beta [1, T/W, HV].
    `cu_seqlens` [N + 1] is global (replicated, may be traced; traced bounds that break the
    rules, e.g. a doc_zigzag document not a multiple of 2W, make o all NaN). Returns this rank's o.

    layout: "contiguous" | "zigzag" | "doc_zigzag" (every document a multiple of 2W tokens).
    exchange: "a2a" (all_to_all to a chain owner and back) | "ring" (ppermute chain).
    save_mode: "light" | "full" as in `gdn` (bitwise-equal gradients with deterministic=True). In
      "full", the units' transfer matrices M_seg are kept whenever P > 1, in either
      save_transfer form.
    save_transfer: keep the transfer walk's residuals and the received summaries (default True
      for a2a, False for ring; ring with True is an error). False replays them in the backward.
    segments: P, the units per piece (default: `plan_kcp`).
    deterministic: as in `gdn` (False lets the cuda backward sum dq, dk over each GVA group with
      atomic adds); the exchanges only move data. (The gradients of a replicated A_log / dt_bias
      are summed over the ranks by JAX's all-reduce, whose order is NCCL's.)
    use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval: FLA's gate
      options, as in `gdn` (g, beta are then this rank's raw inputs; A_log, dt_bias [HV] float32
      are replicated, and their gradients are summed over the ranks). Computed in jax.numpy
      before the kernels on every backend today; fusing it into the cuda prep kernel is future
      work.
    No initial/final state: documents start from zero.
    """
    W = axis_size(axis_name)
    if exchange not in ex.EXCHANGES:
        raise ValueError(f"exchange must be one of {ex.EXCHANGES}, got {exchange!r}")
    if save_transfer is None:
        save_transfer = exchange == "a2a"
    if exchange == "ring" and save_transfer:
        raise ValueError("exchange='ring' passes states, not summaries: it requires "
                         "save_transfer=False")
    d = check_gdn_inputs(q, k, v, g, beta, cu_seqlens=None, scale=scale, initial_state=None,
                         save_mode=save_mode)
    if d.B != 1:
        raise ValueError(f"gdn_kcp needs the packed layout (B == 1), got B = {d.B}")
    g, beta = apply_options(g, beta, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                            dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                            allow_neg_eigval=allow_neg_eigval)
    T_l, T_g = d.T, d.T * W
    N = check_cu_seqlens(cu_seqlens, 1, T_g)
    check_layout(layout, cu_seqlens, T_g, W)
    P = plan_kcp(T_l, d.HV, layout=layout, num_ranks=W, num_docs=N, segments=segments).P
    cfg = _Config(primitives.resolve(backend, K=d.K, V=d.V),
                  float(d.K**-0.5 if scale is None else scale),
                  bool(qk_l2norm), save_mode, deterministic=bool(deterministic))
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    r = jax.lax.axis_index(axis_name)
    pieces = rank_pieces(layout, cu, r, W, T_g)
    C, m = chains_and_m(layout, N)
    tab = local_tables(pieces, cu, P, T_l)
    ct = chunk_table(tab.seg_bounds, T_l)
    S = ct.num_segments
    q, k, v, g, beta = (x.reshape((T_l,) + x.shape[2:]) for x in (q, k, v, g, beta))
    guard_inputs, guard_output = bounds_guard(cfg.prims, cu_seqlens, T_g,
                                              2 * W if layout == "doc_zigzag" else 1)
    q, k, v, g, beta = guard_inputs((q, k, v, g, beta))
    HV, K, V = d.HV, d.K, d.V

    def carries(q, k, v, g, beta):
        # transfer walks: B = exit from a zero entry; M = exit of [K x K] states from I with
        # zero values (at each unit's first segment that continues a document; else 0)
        cfg_t = cfg._replace(with_output=False)
        # (constants vary like v: a custom_vjp's cotangents must match its inputs' vma)
        h0_b = vma.zeros((S, HV, K, V), jnp.float32, v)
        _, exit_b = _gdn_packed(cfg_t, q, k, v, g, beta, h0_b, ct)
        eye = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (HV, K, K))
        h0_m = vma.cast(jnp.where(_bcast(tab.takes_carry, eye[None]), eye[None], 0.0),
                        vma.of(v))
        v_m = vma.zeros((T_l, HV, K), v.dtype, v)
        _, exit_m = _gdn_packed(cfg_t, q, k, v_m, g, beta, h0_m, ct)
        final = jnp.concatenate([exit_b, exit_m], axis=-1)
        fu = final[tab.unit_last_seg]
        ne = _bcast(tab.unit_nonempty, fu)
        # unit summaries, unit-major [P, pieces, HV, K, *]: the merges scan over P
        unit_major = lambda x: jnp.moveaxis(x.reshape((C * m, P) + x.shape[1:]), 1, 0)
        M = checkpoint_name(unit_major(jnp.where(ne, fu[..., V:], eye)), "kcp_M_seg")
        B = checkpoint_name(unit_major(jnp.where(ne, fu[..., :V], 0.0)), "kcp_B_seg")
        # merge 1: the P units of each piece compose into the piece summary
        (Mp, Bp), _ = jax.lax.scan(lambda acc, mb: (ex.compose(*acc, *mb), None),
                                   (M[0], B[0]), (M[1:], B[1:]))
        xch = ex.a2a if exchange == "a2a" else ex.ring
        carry_p = xch(Mp.reshape((C, m) + Mp.shape[1:]), Bp.reshape((C, m) + Bp.shape[1:]),
                      axis_name, W)
        carry_p = checkpoint_name(carry_p.reshape((C * m,) + carry_p.shape[2:]), "kcp_received")
        # merge 2: piece carry -> unit carries
        carry_u = ex.chain_carries(M, B, carry_p)  # [P, pieces, HV, K, V]
        return jnp.moveaxis(carry_u, 0, 1).reshape((C * m * P,) + carry_u.shape[2:])

    if not save_transfer:
        keep = ("kcp_M_seg",) if (save_mode == "full" and P > 1) else ()
        carries = jax.checkpoint(carries,
                                 policy=jax.checkpoint_policies.save_only_these_names(*keep))
    carry_u = carries(q, k, v, g, beta)
    h0 = jnp.where(_bcast(tab.takes_carry, carry_u[tab.seg_unit]), carry_u[tab.seg_unit], 0.0)
    h0 = vma.cast(h0, vma.of(v))
    o, _ = _gdn_packed(cfg, q, k, v, g, beta, h0, ct)
    return guard_output(o).reshape(1, T_l, HV, V)
