"""The per-shard primitives in jax.numpy: runs on any JAX device, and is the kernels' oracle.

Token arrays are packed ([T, heads, dim]); each primitive gathers them into zero-padded chunks
([NC, HV, 64, dim]) internally and returns token arrays again, so the interface is the one the
CUDA kernels implement. Every accumulation is float32 at HIGHEST matmul precision.

Notation per chunk and value head (docs/design.md section 1): G = in-chunk inclusive cumsum of g,
Gam_ij = exp(G_i - G_j) (i >= j), GC = G of the chunk's last row, Kd = K * exp(GC - G),
A = (I + strictly_lower(beta_i Gam_ij k_i.k_j))^-1, u = A diag(beta) V, w = A diag(beta e^G) K,
v_new = u - w S0, S_end = e^GC S0 + Kd^T v_new, o = scale (Q e^G S0 + tril(Gam o QK^T) v_new).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import vma
from ..chunks import CHUNK, ChunkTable

F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST


def _mm(spec, *xs):
    return jnp.einsum(spec, *xs, precision=_HI, preferred_element_type=F32)


# ---------------------------------------------------------------- layout helpers


def to_chunks(x, ct: ChunkTable):
    """[T, ...] -> [NC, 64, ...], zero outside each chunk's tokens."""
    T = x.shape[0]
    pos = jnp.arange(CHUNK, dtype=jnp.int32)
    idx = jnp.minimum(ct.start[:, None] + pos[None, :], T - 1)
    valid = pos[None, :] < ct.length[:, None]
    xc = jnp.take(x, idx, axis=0)
    return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 1)), xc, jnp.zeros((), x.dtype))


def from_chunks(xc, ct: ChunkTable):
    """[NC, 64, ...] -> [T, ...]."""
    return xc[ct.token_chunk, ct.token_pos]


def _th(x, ct):
    """Token-major [T, HV(, D)] -> chunked head-major [NC, HV, 64(, D)]."""
    xc = to_chunks(x, ct)
    return jnp.moveaxis(xc, 2, 1)


def _ht(xc, ct):
    """Chunked head-major [NC, HV, 64(, D)] -> token-major [T, HV(, D)]."""
    return from_chunks(jnp.moveaxis(xc, 1, 2), ct)


def _qk_heads(x, rstd, HV):
    """q or k [T, H, K] -> float32 [T, HV, K], L2-normalised when rstd is given, GVA-repeated."""
    x = x.astype(F32)
    if rstd is not None:
        x = x * rstd[..., None]
    return jnp.repeat(x, HV // x.shape[1], axis=1)


def _group_sum(dx, H):
    """[T, HV, K] -> [T, H, K]: value head i reads q/k head i // (HV // H)."""
    T, HV, K = dx.shape
    return dx.reshape(T, H, HV // H, K).sum(axis=2)


def _l2norm_bwd(dy, x, rstd):
    """dx = rstd (dy - (dy . y) y) for y = x rstd."""
    if rstd is None:
        return dy
    y = x.astype(F32) * rstd[..., None]
    return rstd[..., None] * (dy - jnp.sum(dy * y, axis=-1, keepdims=True) * y)


class _Gates(NamedTuple):
    G: jax.Array  # [NC, HV, 64]
    GC: jax.Array  # [NC, HV, 1]
    eG: jax.Array  # exp(G)
    eGC: jax.Array  # exp(GC)
    dec: jax.Array  # exp(GC - G)
    Gam: jax.Array  # [NC, HV, 64, 64], exp(G_i - G_j) for i >= j, else 0


def _gates(G, ct):
    Gc = _th(G, ct)
    last = jnp.maximum(ct.length - 1, 0)[:, None, None]
    GC = jnp.take_along_axis(Gc, jnp.broadcast_to(last, Gc.shape[:2] + (1,)), axis=-1)
    Gc = jnp.where(jnp.arange(CHUNK) < ct.length[:, None, None], Gc, GC)  # padding rows: G = GC
    diff = Gc[..., :, None] - Gc[..., None, :]
    low = jnp.tril(jnp.ones((CHUNK, CHUNK), bool))
    Gam = jnp.where(low, jnp.exp(jnp.where(low, diff, 0.0)), 0.0)
    return _Gates(Gc, GC, jnp.exp(Gc), jnp.exp(GC), jnp.exp(GC - Gc), Gam)


def _scores(Qc, Kc, gt):
    """Att = tril_incl(Gam o Q K^T) (unscaled)."""
    return gt.Gam * _mm("nhik,nhjk->nhij", Qc, Kc)


# ---------------------------------------------------------------- forward primitives


def gate_cumsum(g, ct: ChunkTable):
    """g [T, HV] f32 -> G [T, HV], the inclusive cumsum inside each chunk."""
    return from_chunks(jnp.cumsum(to_chunks(g, ct), axis=1), ct)


def l2norm_rstd(x):
    """x [T, H, K] -> 1 / sqrt(sum x^2 + 1e-6), float32 [T, H]."""
    x = x.astype(F32)
    return jax.lax.rsqrt(jnp.sum(x * x, axis=-1) + 1e-6)


def solve_a(k, beta, G, rstd_k, ct: ChunkTable):
    """A = (I + strictly_lower(beta_i Gam_ij k_i.k_j))^-1, float32 [NC, HV, 64, 64]."""
    HV = G.shape[1]
    gt = _gates(G, ct)
    Kc = _th(_qk_heads(k, rstd_k, HV), ct)
    bc = _th(beta, ct)
    L = jnp.tril(bc[..., :, None] * gt.Gam * _mm("nhik,nhjk->nhij", Kc, Kc), -1)
    eye = jnp.eye(CHUNK, dtype=F32)
    return jax.lax.linalg.triangular_solve(eye + L, jnp.broadcast_to(eye, L.shape),
                                           left_side=True, lower=True, unit_diagonal=True)


def prep(k, v, beta, G, rstd_k, ct: ChunkTable):
    """A [NC, HV, 64, 64] (as solve_a), then w [T, HV, K] and u [T, HV, V] from it (as wy),
    all float32."""
    A = solve_a(k, beta, G, rstd_k, ct)
    w, u = wy(k, v, beta, G, A, rstd_k, ct)
    return A, w, u


def wy(k, v, beta, G, A, rstd_k, ct: ChunkTable):
    """w = A diag(beta e^G) K [T, HV, K] and u = A diag(beta) V [T, HV, V], float32 (the light
    backward's replay from the saved A)."""
    HV = v.shape[1]
    Kc = _th(_qk_heads(k, rstd_k, HV), ct)
    bc = _th(beta, ct)[..., None]
    eG = jnp.exp(_th(G, ct))[..., None]
    u = _mm("nhij,nhjv->nhiv", A, bc * _th(v.astype(F32), ct))
    w = _mm("nhij,nhjk->nhik", A, bc * eG * Kc)
    return _ht(w, ct), _ht(u, ct)


def state_walk(k, w, u, G, h0, rstd_k, ct: ChunkTable):
    """Walk the chunks in order. h0 [S, HV, K, V] is each segment's entry state.

    Returns h [NC, HV, K, V] (the state entering each chunk), v_new [T, HV, V] and the exit state
    of each segment [S, HV, K, V] (h0 itself for an empty segment).
    """
    HV = w.shape[1]
    gt = _gates(G, ct)
    Kd = _th(_qk_heads(k, rstd_k, HV), ct) * gt.dec[..., None]
    wc, uc = _th(w, ct), _th(u, ct)

    def step(S, xs):
        first, seg, wk, uk, kdk, egc = xs
        S = jnp.where(first, h0[seg], S)
        vn = uk - _mm("hik,hkv->hiv", wk, S)
        S_end = egc[..., None] * S + _mm("hik,hiv->hkv", kdk, vn)
        return S_end, (S, vn)

    xs = (ct.first, ct.seg, wc, uc, Kd, gt.eGC)
    S0 = vma.zeros(h0.shape[1:], F32, h0, *xs)  # the carry varies like everything it meets
    _, (h, vn) = jax.lax.scan(step, S0, xs)
    # exit states: one more transition on each segment's last chunk
    lc = ct.seg_last
    S_end = gt.eGC[lc][..., None] * h[lc] + _mm("shik,shiv->shkv", Kd[lc], vn[lc])
    final = jnp.where((ct.seg_len > 0)[:, None, None, None], S_end, h0)
    return h, _ht(vn, ct), final


def output(q, k, G, h, v_new, rstd_q, rstd_k, ct: ChunkTable, *, scale: float, out_dtype,
           with_scores: bool = False):
    """o = scale (Q e^G h + Att v_new) [T, HV, V] in out_dtype; Att [NC, HV, 64, 64] if asked."""
    HV = v_new.shape[1]
    gt = _gates(G, ct)
    Qc = _th(_qk_heads(q, rstd_q, HV), ct)
    Kc = _th(_qk_heads(k, rstd_k, HV), ct)
    att = _scores(Qc, Kc, gt)
    o = _mm("nhik,nhkv->nhiv", Qc * gt.eG[..., None], h) + _mm("nhij,nhjv->nhiv", att,
                                                                _th(v_new, ct))
    o = _ht(scale * o, ct).astype(out_dtype)
    return o, (att if with_scores else None)


def replay(k, v, beta, G, A, h0, rstd_k, ct: ChunkTable):
    """wy, then state_walk on its w, u: the light backward's replay from the saved A.

    Returns w [T, HV, K], u [T, HV, V] (as wy), h [NC, HV, K, V] and v_new [T, HV, V] (as
    state_walk).
    """
    w, u = wy(k, v, beta, G, A, rstd_k, ct)
    h, v_new, _ = state_walk(k, w, u, G, h0, rstd_k, ct)
    return w, u, h, v_new


def walk_output(q, k, v, beta, A, G, h0, rstd_q, rstd_k, ct: ChunkTable, *, scale: float,
                out_dtype, tapes: bool = False):
    """wy, state_walk then output from A (as solve_a returns it): gdn's forward.

    Returns o [T, HV, V] in out_dtype and the exit state of each segment [S, HV, K, V] f32; with
    `tapes` also w, u, h, v_new (as replay returns them: the full save mode keeps them).
    """
    w, u = wy(k, v, beta, G, A, rstd_k, ct)
    h, v_new, final = state_walk(k, w, u, G, h0, rstd_k, ct)
    o, _ = output(q, k, G, h, v_new, rstd_q, rstd_k, ct, scale=scale, out_dtype=out_dtype)
    return (o, final, w, u, h, v_new) if tapes else (o, final)


def solve_a_walk_output(q, k, v, beta, G, h0, rstd_q, rstd_k, ct: ChunkTable, *, scale: float,
                        out_dtype, tapes: bool = False):
    """solve_a, then walk_output on its A (gdn's forward where no unit takes a carry): A first,
    then walk_output's results."""
    A = solve_a(k, beta, G, rstd_k, ct)
    return (A,) + walk_output(q, k, v, beta, A, G, h0, rstd_q, rstd_k, ct, scale=scale,
                              out_dtype=out_dtype, tapes=tapes)


def transfer(k, v, beta, G, A, h0, rstd_k, ct: ChunkTable, m_seg, b_seg):
    """The affine summaries of the units that need them (DESIGN section 3): per unit u,

    M [U, HV, K, K]: the transfer matrix of segment m_seg[u] (exit = M S_in + ..., the walk of
    [K x K] states from the identity with zero values); zero where m_seg[u] < 0;
    B [U, HV, K, V]: the exit state of segment b_seg[u] from its entry h0[b_seg[u]]; zero where
    b_seg[u] < 0. Both float32; h0 [S, HV, K, V] as state_walk takes it.
    """
    HV, K = A.shape[1], k.shape[2]
    w, u = wy(k, v, beta, G, A, rstd_k, ct)
    _, _, exit_b = state_walk(k, w, u, G, h0, rstd_k, ct)
    S = h0.shape[0]
    eye = vma.cast(jnp.broadcast_to(jnp.eye(K, dtype=F32), (S, HV, K, K)), vma.of(h0))
    _, _, exit_m = state_walk(k, w, vma.zeros(u.shape[:2] + (K,), F32, u), G, eye, rstd_k, ct)
    pick = lambda x, seg: jnp.where((seg >= 0)[:, None, None, None], x[jnp.maximum(seg, 0)], 0.0)
    return pick(exit_m, m_seg), pick(exit_b, b_seg)


def transfer_bwd(q, k, w, G, do, dfinal, rstd_q, rstd_k, ct: ChunkTable, seg, *, scale: float):
    """The backward twin of `transfer`: per unit u, the gradient of segment seg[u]'s entry state
    from the exit gradient dfinal[seg[u]] (walk_bwd's dh0), float32 [U, HV, K, V]; zero where
    seg[u] < 0. dfinal [S, HV, K, V] holds what is known at each exit (a document's final state
    gradient; zero where the exit passes a state on, which the transposed merge adds)."""
    _, dh0, _ = walk_bwd(q, k, w, G, do, dfinal, None, rstd_q, rstd_k, ct, scale=scale)
    return jnp.where((seg >= 0)[:, None, None, None], dh0[jnp.maximum(seg, 0)], 0.0)


# ---------------------------------------------------------------- backward primitives


def walk_bwd(q, k, w, G, do, dfinal, scores, rstd_q, rstd_k, ct: ChunkTable, *, scale: float):
    """Reverse walk for the state gradients.

    Returns dS_end [NC, HV, K, V] (gradient of each chunk's exit state), dh0 [S, HV, K, V]
    (gradient of each segment's entry state) and dvn [NC, HV, 64, V] (gradient of each chunk's
    v_new rows; padding rows 0), which chunk_bwd takes. `scores` is the saved Att or None
    (recomputed).
    """
    HV = w.shape[1]
    gt = _gates(G, ct)
    Qc = _th(_qk_heads(q, rstd_q, HV), ct)
    Kc = _th(_qk_heads(k, rstd_k, HV), ct)
    att = _scores(Qc, Kc, gt) if scores is None else scores
    dOc = _th(do.astype(F32), ct)
    dh_direct = scale * _mm("nhik,nhiv->nhkv", Qc * gt.eG[..., None], dOc)
    dv_local = scale * _mm("nhij,nhiv->nhjv", att, dOc)
    Kd = Kc * gt.dec[..., None]
    wc = _th(w, ct)

    def step(dS, xs):
        last, seg, wk, kdk, egc, dhd, dvl = xs
        dS_end = jnp.where(last, dfinal[seg], dS)
        dvn = dvl + _mm("hik,hkv->hiv", kdk, dS_end)
        dS_in = dhd + egc[..., None] * dS_end - _mm("hik,hiv->hkv", wk, dvn)
        return dS_in, (dS_end, dS_in, dvn)

    xs = (ct.last, ct.seg, wc, Kd, gt.eGC, dh_direct, dv_local)
    dS0 = vma.zeros(dfinal.shape[1:], F32, dfinal, *xs)
    _, (dS_end, dS_in, dvn) = jax.lax.scan(step, dS0, xs, reverse=True)
    dh0 = jnp.where((ct.seg_len > 0)[:, None, None, None], dS_in[ct.seg_first], dfinal)
    return dS_end, dh0, dvn


def chunk_bwd(q, k, v, beta, G, A, w, u, h, v_new, scores, dS_end, dvn, do, rstd_q, rstd_k,
              ct: ChunkTable, *, scale: float, deterministic: bool = True):
    """Everything after the reverse walk, parallel over chunks; dS_end and dvn as walk_bwd
    returns them.

    Returns (dq, dk [T, H, K], dv [T, HV, V]) in the dtypes of q, k, v and (dg, dbeta) [T, HV] f32.
    deterministic: accepted for the primitive signature; every sum here has a fixed order.
    """
    del deterministic
    HV = v.shape[1]
    H = q.shape[1]
    gt = _gates(G, ct)
    Qc = _th(_qk_heads(q, rstd_q, HV), ct)
    Kc = _th(_qk_heads(k, rstd_k, HV), ct)
    Vc = _th(v.astype(F32), ct)
    bc = _th(beta, ct)[..., None]
    vn, dOc = _th(v_new, ct), _th(do.astype(F32), ct)
    del u  # u enters only through v_new
    att = _scores(Qc, Kc, gt) if scores is None else scores
    eG = gt.eG[..., None]
    dec = gt.dec[..., None]
    Qg, Kd = Qc * eG, Kc * dec

    # output and chunk transition (dvn = scale Att^T dO + Kd dS_end: walk_bwd's)
    datt = scale * jnp.tril(_mm("nhiv,nhjv->nhij", dOc, vn))
    dQg = scale * _mm("nhiv,nhkv->nhik", dOc, h)
    dKd = _mm("nhiv,nhkv->nhik", vn, dS_end)
    dw = -_mm("nhiv,nhkv->nhik", dvn, h)
    du = dvn
    dQ = dQg * eG + _mm("nhij,nhjk->nhik", datt * gt.Gam, Kc)
    dK = dKd * dec + _mm("nhij,nhik->nhjk", datt * gt.Gam, Qc)
    da = datt * att
    dG = jnp.sum(dQg * Qg, -1) - jnp.sum(dKd * Kd, -1) + da.sum(-1) - da.sum(-2)
    dGC = jnp.sum(dKd * Kd, (-1, -2)) + gt.eGC[..., 0] * jnp.sum(dS_end * h, (-1, -2))

    # WY: u = A (beta V), w = A (beta e^G K)
    dA = _mm("nhiv,nhjv->nhij", du, bc * Vc) + _mm("nhik,nhjk->nhij", dw, bc * eG * Kc)
    dbV = _mm("nhji,nhjv->nhiv", A, du)
    dbK = _mm("nhji,nhjk->nhik", A, dw)
    dV = bc * dbV
    dbeta = jnp.sum(dbV * Vc, -1) + eG[..., 0] * jnp.sum(dbK * Kc, -1)
    dK = dK + bc * eG * dbK
    dG = dG + bc[..., 0] * eG[..., 0] * jnp.sum(dbK * Kc, -1)

    # A = (I + L)^-1  ->  dL = -A^T dA A^T, strictly lower; L_ij = beta_i Gam_ij k_i.k_j
    dL = -jnp.tril(_mm("nhji,nhjk,nhlk->nhil", A, dA, A), -1)
    KK = _mm("nhik,nhjk->nhij", Kc, Kc)
    dLG = dL * gt.Gam
    dbeta = dbeta + jnp.sum(dLG * KK, -1)
    dLL = dLG * KK * bc
    dG = dG + dLL.sum(-1) - dLL.sum(-2)
    dKK = dLG * bc
    dK = dK + _mm("nhij,nhjk->nhik", dKK, Kc) + _mm("nhji,nhjk->nhik", dKK, Kc)

    # G = cumsum(g) inside the chunk: dg_t = sum_{i >= t} dG_i; GC's share enters at row 63,
    # which the reverse cumsum carries to every row of the chunk
    dG = dG.at[..., -1].add(dGC)
    dg = jnp.flip(jnp.cumsum(jnp.flip(dG, -1), -1), -1)

    dq = _l2norm_bwd(_group_sum(_ht(dQ, ct), H), q, rstd_q).astype(q.dtype)
    dk = _l2norm_bwd(_group_sum(_ht(dK, ct), H), k, rstd_k).astype(k.dtype)
    return dq, dk, _ht(dV, ct).astype(v.dtype), _ht(dg, ct), _ht(dbeta, ct)


def walk_chunk_bwd(q, k, v, beta, G, A, w, u, h, v_new, do, dfinal, rstd_q, rstd_k,
                   ct: ChunkTable, *, scale: float, deterministic: bool = True):
    """The whole backward after the tapes: walk_bwd (scores recomputed), then chunk_bwd.

    Returns (dq, dk, dv, dg, dbeta) as chunk_bwd and dh0 as walk_bwd returns them.
    """
    dS_end, dh0, dvn = walk_bwd(q, k, w, G, do, dfinal, None, rstd_q, rstd_k, ct, scale=scale)
    grads = chunk_bwd(q, k, v, beta, G, A, w, u, h, v_new, None, dS_end, dvn, do, rstd_q, rstd_k,
                      ct, scale=scale, deterministic=deterministic)
    return (*grads, dh0)


def nan_unless(x, ok):
    """x where the bool scalar ok holds, else NaN everywhere (the op output's bounds check)."""
    return jnp.where(ok, x, jnp.asarray(jnp.nan, x.dtype))
