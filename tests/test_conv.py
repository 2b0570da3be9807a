"""short_conv against a direct per-document convolution, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_rms, uneven_cu_seqlens

import jax_cake_gdn as J
from jax_cake_gdn.reference import short_conv_reference


def _direct_conv_f64(x, w, bounds, activation):
    """Each document on its own: zero-pad W-1 rows in front, slide the window (float64)."""
    W = w.shape[1]
    ys = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        xd = jnp.pad(x[a:b], ((W - 1, 0), (0, 0)))
        y = sum(xd[j:j + (b - a)] * w[:, j] for j in range(W))
        ys.append(y)
    y = jnp.concatenate(ys, 0)
    return y * jax.nn.sigmoid(y) if activation == "silu" else y


@pytest.mark.parametrize("W", (1, 2, 4))
@pytest.mark.parametrize("activation", ("silu", None))
@pytest.mark.parametrize("packing", ("cu_seqlens", "rows", "batch"))
def test_short_conv_matches_direct(rng, W, activation, packing):
    C = 12
    if packing == "cu_seqlens":
        B, T = 1, 157
        cu = uneven_cu_seqlens(rng, T, n_docs=5)
        bounds = cu
    elif packing == "rows":  # per-row bounds [B, N + 1]
        B, T = 3, 41
        cu = np.stack([uneven_cu_seqlens(rng, T, n_docs=4) for _ in range(B)])
        bounds = np.concatenate([(cu[:, :-1] + T * np.arange(B)[:, None]).ravel(), [B * T]])
    else:
        B, T, cu = 3, 41, None
        bounds = np.arange(B + 1) * T
    x = rng.standard_normal((B, T, C)).astype(np.float32)
    w = rng.standard_normal((C, W)).astype(np.float32)
    dy = rng.standard_normal((B, T, C)).astype(np.float32)
    y, pull = jax.vjp(lambda x, w: J.short_conv(x, w, cu_seqlens=None if cu is None else
                                                jnp.asarray(cu), activation=activation), x, w)
    dx, dw = pull(jnp.asarray(dy))
    ref = short_conv_reference(x.reshape(1, B * T, C), w, activation=activation,
                               cu_seqlens=bounds)
    assert rel_rms(y.reshape(ref.shape), ref) <= 1e-6
    with jax.enable_x64(True):
        f = lambda x, w: _direct_conv_f64(x.reshape(B * T, C), w, bounds, activation)
        yr, pr = jax.vjp(f, jnp.asarray(x, jnp.float64), jnp.asarray(w, jnp.float64))
        rdx, rdw = pr(jnp.asarray(dy, jnp.float64).reshape(B * T, C))
        yr, rdx, rdw = np.asarray(yr), np.asarray(rdx), np.asarray(rdw)
    assert rel_rms(y.reshape(B * T, C), yr) <= 1e-6
    assert rel_rms(dx, rdx) <= 1e-6
    assert rel_rms(dw, rdw) <= 1e-6


def test_short_conv_bf16(rng):
    x = jnp.asarray(rng.standard_normal((1, 100, 8)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((8, 4)), jnp.bfloat16)
    cu = np.array([0, 1, 30, 100], np.int32)
    y = J.short_conv(x, w, cu_seqlens=jnp.asarray(cu))
    assert y.dtype == jnp.bfloat16
    assert rel_rms(y, short_conv_reference(x, w, cu_seqlens=cu)) <= 1e-2
