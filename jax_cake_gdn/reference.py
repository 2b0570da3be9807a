"""The oracle: Gated DeltaNet as a token-by-token recurrence in float64.

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = scale * S_t^T q_t

Written with `lax.scan` under `jax.enable_x64`, so tests take its values and, through `jax.vjp`,
its gradients. Slow by design; use it on small inputs only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["gdn_reference", "gdn_reference_vjp", "short_conv_reference"]


def _doc_bounds(B, T, cu_seqlens):
    """Packed document boundaries over the flattened B*T token axis."""
    if cu_seqlens is None:
        return np.arange(B + 1, dtype=np.int64) * T
    return np.asarray(cu_seqlens, dtype=np.int64)


def _f64(x):
    return None if x is None else jnp.asarray(np.asarray(x, dtype=np.float32), jnp.float64)


def _l2norm(x):
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _recurrence(q, k, v, g, beta, h0, bounds, scale, qk_l2norm):
    """All arguments float64 and packed: q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV];
    h0 [N, HV, K, V]."""
    T, H, K = q.shape
    HV = v.shape[1]
    N = len(bounds) - 1
    if qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = jnp.repeat(q, HV // H, axis=1)
    k = jnp.repeat(k, HV // H, axis=1)
    doc = np.searchsorted(bounds[1:], np.arange(T), side="right")
    start = np.zeros(T, bool)
    last = np.zeros(T, bool)
    for n in range(N):
        if bounds[n + 1] > bounds[n]:
            start[bounds[n]] = True
            last[bounds[n + 1] - 1] = True

    def step(carry, xs):
        S, finals = carry
        qt, kt, vt, gt, bt, d, st, lt = xs
        S = jnp.where(st, h0[d], S)
        # S <- exp(g) (I - b k k^T) S + b k v^T, per value head
        kS = jnp.einsum("hk,hkv->hv", kt, S)
        S = jnp.exp(gt)[:, None, None] * (S - bt[:, None, None] * kt[:, :, None] * kS[:, None, :])
        S = S + bt[:, None, None] * kt[:, :, None] * vt[:, None, :]
        o = scale * jnp.einsum("hk,hkv->hv", qt, S)
        finals = finals.at[d].set(jnp.where(lt, S, finals[d]))
        return (S, finals), o

    init = (jnp.zeros((HV, K, v.shape[2]), jnp.float64), h0)
    xs = (q, k, v, g, beta, jnp.asarray(doc), jnp.asarray(start), jnp.asarray(last))
    (_, finals), o = jax.lax.scan(step, init, xs)
    return o, finals


def _prepare(q, k, v, g, beta, cu_seqlens, scale, initial_state):
    B, T, H, K = np.shape(q)
    HV, V = np.shape(v)[2:]
    bounds = _doc_bounds(B, T, cu_seqlens)
    N = len(bounds) - 1
    scale = K**-0.5 if scale is None else float(scale)
    pack = lambda x: _f64(x).reshape((B * T,) + tuple(np.shape(x)[2:]))
    h0 = jnp.zeros((N, HV, K, V), jnp.float64) if initial_state is None else _f64(initial_state)
    return (pack(q), pack(k), pack(v), pack(g), pack(beta), h0), bounds, scale, (B, T, HV, V)


def gdn_reference(q, k, v, g, beta, *, cu_seqlens=None, scale=None, qk_l2norm=False,
                  initial_state=None):
    """float64 numpy `(o [B, T, HV, V], final_state [N or B, HV, K, V])` for the same inputs as
    `gdn`."""
    with jax.enable_x64(True):
        args, bounds, scale, (B, T, HV, V) = _prepare(q, k, v, g, beta, cu_seqlens, scale,
                                                       initial_state)
        o, final = _recurrence(*args, bounds, scale, qk_l2norm)
        return np.asarray(o).reshape(B, T, HV, V), np.asarray(final)


def gdn_reference_vjp(q, k, v, g, beta, do, dfinal=None, *, cu_seqlens=None, scale=None,
                      qk_l2norm=False, initial_state=None):
    """float64 values and gradients of `sum(o * do) + sum(final * dfinal)`.

    Returns `(o, final, grads)` with grads a dict over q, k, v, g, beta, initial_state (numpy).
    """
    with jax.enable_x64(True):
        args, bounds, scale, (B, T, HV, V) = _prepare(q, k, v, g, beta, cu_seqlens, scale,
                                                       initial_state)
        fn = lambda *a: _recurrence(*a, bounds, scale, qk_l2norm)
        (o, final), pullback = jax.vjp(fn, *args)
        do = _f64(do).reshape(o.shape)
        dfinal = jnp.zeros_like(final) if dfinal is None else _f64(dfinal)
        grads = pullback((do, dfinal))
        names = ("q", "k", "v", "g", "beta", "initial_state")
        shapes = (np.shape(q), np.shape(k), np.shape(v), np.shape(g), np.shape(beta), final.shape)
        out = {n: np.asarray(d).reshape(s) for n, d, s in zip(names, grads, shapes)}
        return np.asarray(o).reshape(B, T, HV, V), np.asarray(final), out


def short_conv_reference(x, weight, *, cu_seqlens=None, activation="silu"):
    """float64 causal depthwise conv per document: y[t] = act(sum_j w[:, j] x[t - (W-1) + j])."""
    x = np.asarray(np.asarray(x, np.float32), np.float64)
    w = np.asarray(np.asarray(weight, np.float32), np.float64)
    B, T, C = x.shape
    W = w.shape[1]
    bounds = _doc_bounds(B, T, cu_seqlens)
    xp = x.reshape(B * T, C)
    y = np.zeros_like(xp)
    for n in range(len(bounds) - 1):
        a, b = bounds[n], bounds[n + 1]
        for t in range(a, b):
            for j in range(W):
                s = t - (W - 1) + j
                if s >= a:
                    y[t] += w[:, j] * xp[s]
    if activation == "silu":
        y = y / (1.0 + np.exp(-y))
    return y.reshape(B, T, C)
