"""gdn on one device, xla backend: values and every gradient against the float64 token loop."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_inputs, rel_rms, uneven_cu_seqlens

import jax_cake_gdn as J
from jax_cake_gdn.chunks import CHUNK, chunk_table
from jax_cake_gdn.reference import gdn_reference, gdn_reference_vjp

GRADS = ("q", "k", "v", "g", "beta", "initial_state")


def _grads(q, k, v, g, beta, h0, do, dfinal, **kw):
    def f(q, k, v, g, beta, h0):
        return J.gdn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)

    (o, final), pullback = jax.vjp(f, q, k, v, g, beta, h0)
    return o, final, dict(zip(GRADS, pullback((do.astype(o.dtype), dfinal))))


CASES = [  # (dtype, qk_l2norm, heads (H, HV), packing)
    (d, l2, heads, packing)
    for d, l2, heads, packing in itertools.product(
        ("f32", "bf16"), (False, True), ((2, 4), (3, 3)), ("cu_seqlens", "batch"))
]


@pytest.mark.parametrize("dtype,qk_l2norm,heads,packing", CASES)
def test_matches_reference(rng, dtype, qk_l2norm, heads, packing):
    H, HV = heads
    dt = jnp.float32 if dtype == "f32" else jnp.bfloat16
    tol = 1e-5 if dtype == "f32" else 1e-2
    if packing == "cu_seqlens":
        B, T = 1, 331
        cu = uneven_cu_seqlens(rng, T, n_docs=5)
        N = len(cu) - 1
    else:
        B, T, cu = 3, 97, None
        N = B
    q, k, v, g, beta, h0 = make_inputs(rng, B=B, T=T, H=H, HV=HV, K=32, V=24, dtype=dt,
                                       qk_l2norm=qk_l2norm, num_states=N)
    do = np.asarray(jnp.asarray(rng.standard_normal((B, T, HV, 24)), dt), np.float32)
    dfinal = rng.standard_normal(h0.shape).astype(np.float32)
    kw = dict(cu_seqlens=None if cu is None else jnp.asarray(cu), qk_l2norm=qk_l2norm)
    o, final, grads = _grads(q, k, v, g, beta, h0, jnp.asarray(do), jnp.asarray(dfinal),
                             backend="xla", **kw)
    ro, rfinal, rgrads = gdn_reference_vjp(q, k, v, g, beta, do, dfinal, cu_seqlens=cu,
                                           qk_l2norm=qk_l2norm, initial_state=h0)
    assert o.dtype == dt and o.shape == (B, T, HV, 24)
    assert final.dtype == jnp.float32 and final.shape == h0.shape
    errs = {"o": rel_rms(o, ro), "final": rel_rms(final, rfinal)}
    for name in GRADS:
        assert grads[name].dtype == (h0.dtype if name == "initial_state" else
                                     {"q": q, "k": k, "v": v, "g": g, "beta": beta}[name].dtype)
        errs[name] = rel_rms(grads[name], rgrads[name])
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"relative RMS above {tol}: {bad} (all: {errs})"


def test_no_initial_state_and_defaults(rng):
    q, k, v, g, beta, _ = make_inputs(rng, T=150, H=1, HV=2, K=16, V=16)
    o = J.gdn(q, k, v, g, beta, backend="xla")
    ro, _ = gdn_reference(q, k, v, g, beta)
    assert rel_rms(o, ro) <= 1e-5
    o2 = J.gdn(q, k, v, g, beta, scale=0.3, backend="xla")
    ro2, _ = gdn_reference(q, k, v, g, beta, scale=0.3)
    assert rel_rms(o2, ro2) <= 1e-5


def test_empty_and_tiny_documents(rng):
    """Repeated cu_seqlens entries are empty documents; their final state is their initial one."""
    T = 140
    cu = np.array([0, 1, 1, 64, 129, 140, 140], np.int32)
    q, k, v, g, beta, h0 = make_inputs(rng, T=T, num_states=len(cu) - 1)
    o, final = J.gdn(q, k, v, g, beta, cu_seqlens=jnp.asarray(cu), initial_state=h0,
                     output_final_state=True, backend="xla")
    ro, rfinal = gdn_reference(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0)
    assert rel_rms(o, ro) <= 1e-5 and rel_rms(final, rfinal) <= 1e-5
    np.testing.assert_array_equal(final[1], h0[1])
    np.testing.assert_array_equal(final[5], h0[5])


def _jit_grads(save_mode, q, k, v, g, beta, h0, cu, do, df, ckpt=False):
    def loss(q, k, v, g, beta, h0):
        def call(q, k, v, g, beta, h0):
            return J.gdn(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, qk_l2norm=True,
                         output_final_state=True, save_mode=save_mode, backend="xla")

        o, final = (jax.checkpoint(call) if ckpt else call)(q, k, v, g, beta, h0)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(final * df)

    return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(q, k, v, g, beta, h0)


@pytest.mark.parametrize("dtype", ("f32", "bf16"))
def test_full_and_light_bitwise_equal_and_checkpoint(rng, dtype):
    T = 250
    cu = jnp.asarray(uneven_cu_seqlens(rng, T))
    dt = jnp.float32 if dtype == "f32" else jnp.bfloat16
    q, k, v, g, beta, h0 = make_inputs(rng, T=T, dtype=dt, qk_l2norm=True, num_states=4)
    do = jnp.asarray(rng.standard_normal((1, T, 4, 32)), jnp.float32)
    df = jnp.asarray(rng.standard_normal(h0.shape), jnp.float32)
    light = _jit_grads("light", q, k, v, g, beta, h0, cu, do, df)
    full = _jit_grads("full", q, k, v, g, beta, h0, cu, do, df)
    ckpt = _jit_grads("light", q, k, v, g, beta, h0, cu, do, df, ckpt=True)
    for a, b, c in zip(light, full, ckpt):
        assert np.all(np.isfinite(np.asarray(a, np.float32)))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_jit_does_not_retrace_for_new_cu_seqlens(rng):
    T = 200
    q, k, v, g, beta, _ = make_inputs(rng, T=T)
    traces = []

    @jax.jit
    def step(q, k, v, g, beta, cu):
        traces.append(1)
        return jax.grad(lambda q: jnp.sum(J.gdn(q, k, v, g, beta, cu_seqlens=cu,
                                                  backend="xla")))(q)

    results = []
    for cu in ([0, 1, 70, 200, 200], [0, 100, 101, 150, 200], [0, 200, 200, 200, 200]):
        cu = np.asarray(cu, np.int32)
        results.append((step(q, k, v, g, beta, jnp.asarray(cu)), cu))
    assert len(traces) == 1
    for dq, cu in results:  # and each call used its own boundaries
        _, _, rg = gdn_reference_vjp(q, k, v, g, beta, np.ones((1, T, 4, 32), np.float32),
                                     cu_seqlens=cu)
        assert rel_rms(dq, rg["q"]) <= 1e-5


@pytest.mark.parametrize("save_mode", ("light", "full", None))
@pytest.mark.parametrize("qk_l2norm", (False, True))
def test_saved_layout_equals_residuals_jax_keeps(rng, save_mode, qk_l2norm):
    """None: neither call names save_mode, and both default to full (the tapes are kept)."""
    T = 150
    cu = jnp.asarray(uneven_cu_seqlens(rng, T))
    q, k, v, g, beta, h0 = make_inputs(rng, T=T, dtype=jnp.bfloat16, num_states=4)
    kw = dict(cu_seqlens=cu, qk_l2norm=qk_l2norm, backend="xla")
    if save_mode is not None:
        kw["save_mode"] = save_mode
    _, pullback = jax.vjp(lambda *a: J.gdn(*a, initial_state=h0, **kw), q, k, v, g, beta)
    kept = sorted((tuple(x.shape), str(x.dtype)) for x in jax.tree_util.tree_leaves(pullback))
    layout = J.saved_layout(q, k, v, g, beta, initial_state=h0, **kw)
    assert sorted((s, str(d)) for s, d, _ in layout.values()) == kept
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(pullback))
    assert J.saved_bytes(q, k, v, g, beta, initial_state=h0, **kw) == nbytes
    # abstract arguments give the same answer
    sds = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v, g, beta)]
    assert J.saved_layout(*sds, initial_state=h0, **kw) == layout
    expected = {"A", "G", "q", "k", "v", "beta", "h0", "g_floor"}
    expected |= {"rstd_q", "rstd_k"} if qk_l2norm else set()
    expected |= {"w", "u", "h", "v_new"} if save_mode != "light" else set()
    assert {n for n in layout if not n.startswith(("ct.", "seg."))} == expected


def test_residuals_carry_checkpoint_names(rng):
    q, k, v, g, beta, _ = make_inputs(rng, T=100)
    f = lambda q: jnp.sum(J.gdn(q, k, v, g, beta, save_mode="full", backend="xla"))
    policy = jax.checkpoint_policies.save_only_these_names("gdn_h", "gdn_A")
    jaxpr = str(jax.make_jaxpr(jax.grad(jax.checkpoint(f, policy=policy)))(q))
    for name in ("gdn_A", "gdn_G", "gdn_h", "gdn_v_new", "gdn_w", "gdn_u"):
        assert name in jaxpr
    g1 = jax.grad(jax.checkpoint(f, policy=policy))(q)
    np.testing.assert_allclose(g1, jax.grad(f)(q), rtol=1e-6, atol=1e-7)


def test_chunk_table_covers_every_token_once(rng):
    for _ in range(5):
        T = int(rng.integers(1, 500))
        n = int(rng.integers(1, 8))
        cu = np.sort(np.concatenate([[0, T], rng.integers(0, T + 1, n - 1)])).astype(np.int32)
        ct = chunk_table(jnp.asarray(cu), T)
        start, length = np.asarray(ct.start), np.asarray(ct.length)
        cover = np.zeros(T, int)
        for s, l in zip(start, length):
            cover[s:s + l] += 1
        assert np.all(cover == 1)
        assert np.all(length <= CHUNK)
        tc, tp = np.asarray(ct.token_chunk), np.asarray(ct.token_pos)
        np.testing.assert_array_equal(start[tc] + tp, np.arange(T))
        # the walks' CTA order: every segment once, longest first, ties in table order
        order, seg_len = np.asarray(ct.seg_order), np.diff(cu)
        assert sorted(order.tolist()) == list(range(n))
        keys = [(-seg_len[i], i) for i in order]
        assert keys == sorted(keys), (seg_len, order)
