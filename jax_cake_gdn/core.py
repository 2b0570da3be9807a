"""The custom_vjp op that gdn and gdn_kcp share, written once over the per-shard primitives.

`gdn_op(cfg, merge, q, k, v, g, beta, h0, tabs)` runs on packed arrays (q, k [T, H, K], v
[T, HV, V], g, beta [T, HV], h0 [N, HV, K, V]) cut into segments by `tabs` (segments.SegTable).

Forward: gate cumsum, L2-norm rstd, A; without `merge`, outside light's VJP, A and the walk come
from one primitive (solve_a_walk_output: the cuda one overlaps them when few chains leave SMs
idle). When `merge` is given (units that take a carry can exist), the transfer kernel summarises
only the units that need it (M of a unit that takes a carry and passes it on, B of a unit that
passes one on), `merge` composes the summaries along the units' chains into every unit's entry
state (locally, or across ranks with a collective), and one walk_output runs every segment from
its entry state. Without `merge` (no unit can take a carry: one device, one unit) this is
exactly gdn's kernels.

Backward: the state walk's tapes (full) or their replay (light); when `merge` is given, the
transfer's backward twin gives each carry-taking unit the gradient of its entry from what is known
at its exit (a document's final-state gradient, else zero), the VJP of `merge` (linear in B: its
transpose) carries those back along the chains (M^T, in reverse) into the gradient at every unit's
exit, and one walk_chunk_bwd from those exit gradients gives
every input gradient. Nothing is differentiated through the transfer itself: with the right exit
gradient per segment the segment walks' backward is the whole sequential backward.

Residuals carry checkpoint names `gdn_<name>` for remat policies (`gdn_h0`: the entry state of
every segment; `gdn_M`: the units' transfer matrices, which the transposed merge reads).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from . import affine, vma
from .primitives import Primitives
from .segments import SegTable

__all__ = ["Config", "LocalMerge", "gdn_op", "forward"]


class Config(NamedTuple):
    prims: Primitives
    scale: float
    qk_l2norm: bool
    save_mode: str
    deterministic: bool = False  # False: the cuda backward may sum dq, dk with atomic adds


class LocalMerge(NamedTuple):
    """The merge of gdn's intra-GPU segments: the units form one chain, in order."""

    def __call__(self, M, B, reset):
        return affine.chain_carries(M, B, reset)


def _bc(mask, x):
    return mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim))


def _name(res: dict) -> dict:
    """Tag every residual array with a checkpoint name `gdn_<key>` for remat policies."""
    return {n: (None if x is None else checkpoint_name(x, f"gdn_{n}")) for n, x in res.items()}


def _resets(tabs: SegTable, m_seg):
    """[U] bool: the unit's exit does not depend on its entry (a document starts in it, or its
    exit is not passed on); empty units pass their entry through."""
    return ~tabs.unit_empty & (m_seg < 0)


def _per_doc(merge, h0, tabs: SegTable) -> bool:
    """True when the segments are the documents themselves (gdn at P = 1): then entry states,
    exit states and their gradients need no gather."""
    return merge is None and h0.shape[0] == tabs.ct.num_segments


def forward(cfg: Config, merge: Optional[Callable], q, k, v, g, beta, h0, tabs: SegTable):
    """(o, final), (residuals, tabs): the custom_vjp forward (also saved_layout's). Light keeps A
    but none of the walk's results, so it makes A apart from the walk: under jax.checkpoint the
    recomputation then runs solve_a alone."""
    return _forward(cfg, merge, q, k, v, g, beta, h0, tabs, fuse=cfg.save_mode == "full")


def _forward(cfg: Config, merge, q, k, v, g, beta, h0, tabs: SegTable, fuse: bool):
    """forward; fuse: A and the walk from one primitive where no unit takes a carry."""
    P, ct = cfg.prims, tabs.ct
    rq = P.l2norm_rstd(q) if cfg.qk_l2norm else None
    rk = P.l2norm_rstd(k) if cfg.qk_l2norm else None
    G = P.gate_cumsum(g, ct)
    if _per_doc(merge, h0, tabs):
        entry = h0
    else:
        entry = jnp.where(_bc(tabs.starts_doc, h0[:1]), h0[tabs.seg_doc], 0.0)
    entry = vma.cast(entry, vma.of(v))
    full = cfg.save_mode == "full"
    M_u = None
    if merge is None and fuse:  # no unit takes a carry: A and the walk in one primitive
        A, *out = P.solve_a_walk_output(q, k, v, beta, G, entry, rq, rk, ct, scale=cfg.scale,
                                        out_dtype=v.dtype, tapes=full)
    else:
        A = P.solve_a(k, beta, G, rk, ct)
        if merge is not None:
            m_seg, b_seg, _ = tabs.unit_needs()
            M, B = P.transfer(k, v, beta, G, A, entry, rk, ct, m_seg, b_seg)
            K = k.shape[-1]
            eye = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), M.shape)
            M_u = jnp.where(_bc(tabs.unit_empty, M), eye, M)
            carry = merge(M_u, B, _resets(tabs, m_seg))
            entry = jnp.where(_bc(tabs.takes_carry, entry), carry[tabs.seg_unit], entry)
        out = P.walk_output(q, k, v, beta, A, G, entry, rq, rk, ct, scale=cfg.scale,
                            out_dtype=v.dtype, tapes=full)
    o, exits = out[:2]
    final = exits if _per_doc(merge, h0, tabs) else exits[tabs.doc_last_seg]
    res = dict(q=q, k=k, v=v, beta=beta, h0=entry, G=G, A=A, rstd_q=rq, rstd_k=rk, M=M_u)
    if full:
        res.update(zip(("w", "u", "h", "v_new"), out[2:]))
    return (o, final), (_name(res), tabs)


def _backward(cfg: Config, merge, residuals, cts):
    res, tabs = residuals
    do, dfinal = jnp.asarray(cts[0]), jnp.asarray(cts[1])
    P, ct = cfg.prims, tabs.ct
    q, k, v, beta, G, A = res["q"], res["k"], res["v"], res["beta"], res["G"], res["A"]
    rq, rk = res["rstd_q"], res["rstd_k"]
    if cfg.save_mode == "full":  # the forward walk's tapes, bit for bit the replay's
        w, u, h, v_new = res["w"], res["u"], res["h"], res["v_new"]
    else:  # light: replay w, u (bitwise as prep made them) and the state walk
        w, u, h, v_new = P.replay(k, v, beta, G, A, res["h0"], rk, ct)
    per_doc = _per_doc(merge, dfinal, tabs)
    if per_doc:
        dexit = dfinal
    else:
        dexit = jnp.where(_bc(tabs.ends_doc, dfinal[:1]), dfinal[tabs.seg_doc], 0.0)
    if merge is not None:
        m_seg, _, g_seg = tabs.unit_needs()
        g_carry = P.transfer_bwd(q, k, w, G, do, dexit, rq, rk, ct, g_seg, scale=cfg.scale)
        M_u, reset = res["M"], _resets(tabs, m_seg)
        # the merge is linear in B: its VJP at any B is its transpose (the primal is dead code)
        _, transpose = jax.vjp(lambda b: merge(M_u, b, reset), jnp.zeros_like(g_carry))
        (d_unit_exit,) = transpose(g_carry)
        dexit = jnp.where(_bc(tabs.passes, dexit), d_unit_exit[tabs.seg_unit], dexit)
    dexit = vma.cast(dexit, vma.union(do, dexit))
    dq, dk, dv, dg, dbeta, dentry = P.walk_chunk_bwd(q, k, v, beta, G, A, w, u, h, v_new, do,
                                                     dexit, rq, rk, ct, scale=cfg.scale,
                                                     deterministic=cfg.deterministic)
    return dq, dk, dv, dg, dbeta, dentry if per_doc else dentry[tabs.doc_first_seg], None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def gdn_op(cfg: Config, merge, q, k, v, g, beta, h0, tabs: SegTable):
    """(o [T, HV, V], final [N, HV, K, V]) of the packed op (module docstring). Called without
    differentiation it runs light's forward in either save mode: full's tapes would be written
    for nothing (o and the exit states are bit for bit the same)."""
    return _forward(cfg._replace(save_mode="light"), merge, q, k, v, g, beta, h0, tabs,
                    fuse=True)[0]


gdn_op.defvjp(forward, _backward)
