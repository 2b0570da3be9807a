"""Intra-GPU segments and the transfer kernels: gdn(segments=P), the segment table, the
transfer / transfer_bwd primitives (cuda against xla), NaN containment across documents.

CPU host (xla backend): gdn with P units equals the float64 reference in o, the final states and
every gradient, on uneven documents with empty ones and initial states; light == full bitwise;
a NaN in one document's inputs reaches no other document's outputs or gradients, for gdn with
units and for gdn_kcp with every layout, exchange and save mode on 4 CPU devices; the segment
table's invariants on random bounds; the lowered cuda step runs gdn's kernels alone at P = 1
and adds exactly transfer and transfer_bwd at P > 1.
GPU host: cuda.transfer and cuda.transfer_bwd against their xla twins (bf16 and f32 inputs,
K = V = 128 and 64, K != V, units that need nothing), every output written under
JAX_CAKE_GDN_POISON=1; gdn(backend="cuda", segments=P) against the float64 reference and against
P = 1, light == full bitwise with deterministic=True, NaN contained.
"""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import lowered_cuda_calls, make_inputs, need_gpu, rel_rms, run_python
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cake_gdn as J
from jax_cake_gdn import primitives
from jax_cake_gdn.reference import gdn_reference_vjp
from jax_cake_gdn.segments import doc_segments

from kcp_harness import AX, NAMES, mesh as _mesh

GRADS = ("q", "k", "v", "g", "beta", "initial_state")
DOCS = (1, 0, 70, 129, 0, 200, 64, 33)  # empty documents, a length-1 one, chunk edges


def _cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _vjp(args, do, dfinal, **kw):
    f = lambda q, k, v, g, beta, h0: J.gdn(q, k, v, g, beta, initial_state=h0,
                                           output_final_state=True, **kw)
    (o, final), pull = jax.vjp(f, *args)
    return o, final, dict(zip(GRADS, pull((do.astype(o.dtype), dfinal))))


@pytest.mark.parametrize("segments,save_mode", [(2, "light"), (5, "light"), (8, "full")])
def test_segments_match_reference(rng, segments, save_mode):
    cu = _cu(DOCS)
    T, N = int(cu[-1]), len(DOCS)
    q, k, v, g, beta, h0 = make_inputs(rng, T=T, H=2, HV=4, K=16, V=8, num_states=N)
    do = rng.standard_normal((1, T, 4, 8)).astype(np.float32)
    dfinal = rng.standard_normal(h0.shape).astype(np.float32)
    o, final, grads = _vjp((q, k, v, g, beta, h0), jnp.asarray(do), jnp.asarray(dfinal),
                           cu_seqlens=jnp.asarray(cu), backend="xla", segments=segments,
                           save_mode=save_mode)
    ro, rfinal, rgrads = gdn_reference_vjp(q, k, v, g, beta, do, dfinal, cu_seqlens=cu,
                                           initial_state=h0)
    errs = {"o": rel_rms(o, ro), "final": rel_rms(final, rfinal)}
    errs.update({n: rel_rms(grads[n], rgrads[n]) for n in GRADS})
    assert all(e <= 1e-5 for e in errs.values()), errs


def test_segments_light_full_bitwise_and_batch_rows(rng):
    """B > 1 rows without cu_seqlens are documents too; both save modes give the same bits."""
    B, T = 3, 150
    q, k, v, g, beta, h0 = make_inputs(rng, B=B, T=T, H=1, HV=2, K=8, V=8, num_states=B)
    do = jnp.asarray(rng.standard_normal((B, T, 2, 8)), jnp.float32)
    dfinal = jnp.asarray(rng.standard_normal(h0.shape), jnp.float32)
    res = [_vjp((q, k, v, g, beta, h0), do, dfinal, backend="xla", segments=4, save_mode=m)
           for m in ("light", "full")]
    for a, b in zip(jax.tree.leaves(res[0]), jax.tree.leaves(res[1])):
        np.testing.assert_array_equal(a, b)
    ref = _vjp((q, k, v, g, beta, h0), do, dfinal, backend="xla", segments=1)
    for a, b in zip(jax.tree.leaves(res[0]), jax.tree.leaves(ref)):
        assert rel_rms(a, b) <= 1e-5


@pytest.mark.parametrize("seed", range(4))
def test_segment_table_invariants(seed):
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 90, size=int(rng.integers(1, 7)))
    lens[rng.integers(0, len(lens))] += 1  # at least one token
    cu = _cu(lens)
    T, N = int(cu[-1]), len(lens)
    for Pn in (1, 2, 3, 7):
        t = jax.tree.map(np.asarray, doc_segments(jnp.asarray(cu), T, Pn))
        seg_len = t.ct.seg_len
        bounds = np.concatenate([[0], np.cumsum(seg_len)])
        assert bounds[-1] == T and np.all(seg_len >= 0)
        unit_starts = {u * T // Pn for u in range(Pn)}
        for s in range(len(seg_len)):
            lo, hi = bounds[s], bounds[s + 1]
            if hi == lo:
                continue
            d = t.seg_doc[s]
            assert cu[d] <= lo and hi <= cu[d + 1], (s, lo, hi, d)  # inside its document
            assert t.starts_doc[s] == (lo == cu[d])
            assert not any(lo < x < hi for x in unit_starts)  # never across a unit start
            assert t.takes_carry[s] == (not t.starts_doc[s])  # else it starts a unit mid-document
            assert t.ends_doc[s] == (hi == cu[d + 1])
            assert t.passes[s] == (not t.ends_doc[s])
        for d in range(N):  # each document's first and last segment
            f, l = t.doc_first_seg[d], t.doc_last_seg[d]
            assert bounds[f] == cu[d] and bounds[l + 1] == cu[d + 1] and t.seg_doc[f] == d


def _nan_doc_inputs(rng, T, cu, bad_doc, HV=2, K=8):
    q, k, v, g, beta, _ = make_inputs(rng, T=T, H=1, HV=HV, K=K, V=K)
    lo, hi = int(cu[bad_doc]), int(cu[bad_doc + 1])
    v = v.at[0, lo + (hi - lo) // 2].set(jnp.nan)
    return (q, k, v, g, beta), (lo, hi)


def _finite_outside(x, lo, hi):
    x = np.asarray(x, np.float32)
    return np.all(np.isfinite(x[:, :lo])) and np.all(np.isfinite(x[:, hi:]))


def test_gdn_segments_contain_nan(rng):
    cu = _cu((100, 230, 90, 60))
    T = int(cu[-1])
    args, (lo, hi) = _nan_doc_inputs(rng, T, cu, 1)
    f = lambda *a: J.gdn(*a, cu_seqlens=jnp.asarray(cu), backend="xla", segments=5)
    o, pull = jax.vjp(f, *args)
    grads = pull(jnp.ones_like(o))
    assert _finite_outside(o, lo, hi) and not np.all(np.isfinite(np.asarray(o)[:, lo:hi]))
    for name, d in zip(NAMES, grads):
        assert _finite_outside(d, lo, hi), name


@pytest.mark.parametrize("layout,exchange,save_mode", [
    (layout, exchange, "light") for layout in ("contiguous", "zigzag", "doc_zigzag")
    for exchange in ("a2a", "ring")] + [("zigzag", "a2a", "full")])
def test_kcp_contains_nan(rng, layout, exchange, save_mode):
    """A NaN in one document's v: every other document's o and gradients stay finite."""
    W = 4
    unit = 2 * W if layout == "doc_zigzag" else 1
    cu = _cu(np.array([12, 40, 20, 24]) * unit)  # documents cross ranks and units
    T = int(cu[-1])
    args, (lo, hi) = _nan_doc_inputs(rng, T, cu, 1)
    m = _mesh(tuple(jax.devices("cpu")[:W]))
    tok = NamedSharding(m, P(None, AX))
    cu_j = jnp.asarray(cu)

    def local(q, k, v, g, beta, cu):
        f = lambda *a: J.gdn_kcp(*a, cu_seqlens=cu, axis_name=AX, layout=layout, segments=2,
                                 exchange=exchange, save_mode=save_mode, backend="xla")
        o, pull = jax.vjp(f, q, k, v, g, beta)
        return o, pull(jnp.ones_like(o))

    fn = jax.jit(jax.shard_map(local, mesh=m, in_specs=(P(None, AX),) * 5 + (P(),),
                               out_specs=(P(None, AX), (P(None, AX),) * 5)))
    lay = lambda x: jax.device_put(J.to_layout(np.asarray(x), cu_j, layout, W), tok)
    back = lambda x: np.asarray(J.from_layout(np.asarray(x), cu_j, layout, W))
    o, grads = fn(*[lay(x) for x in args], jax.device_put(cu_j, NamedSharding(m, P())))
    assert _finite_outside(back(o), lo, hi)
    for name, d in zip(NAMES, grads):
        assert _finite_outside(back(d), lo, hi), (name, layout, exchange)


def _lowered_calls(segments, save_mode="light"):
    T = 1024
    sds = ([jax.ShapeDtypeStruct((1, T, 2, 64), jnp.bfloat16)] * 2
           + [jax.ShapeDtypeStruct((1, T, 4, 64), jnp.bfloat16)]
           + [jax.ShapeDtypeStruct((1, T, 4), jnp.float32)] * 2)
    cu = jax.ShapeDtypeStruct((3,), jnp.int32)

    def step(q, k, v, g, beta, cu):
        o, pull = jax.vjp(lambda *a: J.gdn(*a, cu_seqlens=cu, qk_l2norm=True, backend="cuda",
                                           segments=segments, save_mode=save_mode),
                          q, k, v, g, beta)
        return o, pull(o)

    return lowered_cuda_calls(step, *sds, cu)


def test_lowered_segments_add_only_the_transfer_kernels():
    from conftest import need_ext

    need_ext()
    for mode in ("light", "full"):
        plain, seg = _lowered_calls(1, mode), _lowered_calls(4, mode)
        assert "transfer" not in plain and "transfer_bwd" not in plain
        if mode == "full":  # plain makes A in the walk's call, segments before the transfer
            i = plain.index("solve_a_walk_output_tapes")
            plain = plain[:i] + ["solve_a", "walk_output_tapes"] + plain[i + 1:]
        assert sorted(seg) == sorted(plain + ["transfer", "transfer_bwd"]), (plain, seg)


def test_lowered_full_forward_without_grad_writes_no_tapes():
    """Called without differentiation, save_mode="full" runs light's forward (no tapes)."""
    from conftest import need_ext

    need_ext()
    T = 1024
    sds = ([jax.ShapeDtypeStruct((1, T, 2, 64), jnp.bfloat16)] * 2
           + [jax.ShapeDtypeStruct((1, T, 4, 64), jnp.bfloat16)]
           + [jax.ShapeDtypeStruct((1, T, 4), jnp.float32)] * 2)
    for segments in (1, 4):
        f = lambda *a: J.gdn(*a, backend="cuda", save_mode="full", segments=segments)
        calls = lowered_cuda_calls(f, *sds)
        # the plain call runs light's forward: A and the walk in one call where nothing crosses
        walk = "solve_a_walk_output" if segments == 1 else "walk_output"
        assert walk in calls and not [c for c in calls if c.endswith("_tapes")], calls


# ---------------------------------------------------------------------------------- GPU


def _gpu_transfer_check(dtype, K, V, seed):
    from jax_cake_gdn.chunks import chunk_table  # noqa: F401 (imported for the subprocess too)

    rng = np.random.default_rng(seed)
    lens = (1, 700, 65, 0, 1400, 64)
    cu = _cu(lens)
    T = int(cu[-1])
    tabs = doc_segments(jnp.asarray(cu), T, 5)
    ct = tabs.ct
    S, U = ct.num_segments, tabs.num_units
    H, HV = 2, 6
    s = 1.0
    q = jnp.asarray(rng.standard_normal((T, H, K)) * s, dtype)
    k = jnp.asarray(rng.standard_normal((T, H, K)) * s, dtype)
    v = jnp.asarray(rng.standard_normal((T, HV, V)), dtype)
    g = jnp.asarray(-rng.uniform(0.01, 0.3, (T, HV)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.95, (T, HV)), jnp.float32)
    h0 = jnp.asarray(0.3 * rng.standard_normal((S, HV, K, V)), jnp.float32)
    do = jnp.asarray(rng.standard_normal((T, HV, V)), dtype)
    dfin = jnp.asarray(rng.standard_normal((S, HV, K, V)), jnp.float32)
    # every unit asks for something, and some for nothing (-1)
    m_seg = jnp.asarray(rng.integers(-1, S, U), jnp.int32)
    b_seg = jnp.asarray(rng.integers(-1, S, U), jnp.int32)
    C, X = primitives._cuda_primitives(), primitives.XLA

    @jax.jit
    def run(q, k, v, g, beta, h0, do, dfin):
        rq, rk = X.l2norm_rstd(q), X.l2norm_rstd(k)
        G = X.gate_cumsum(g, ct)
        A = C.solve_a(k, beta, G, rk, ct)
        Mc, Bc = C.transfer(k, v, beta, G, A, h0, rk, ct, m_seg, b_seg)
        Mx, Bx = X.transfer(k, v, beta, G, A.astype(jnp.float32), h0, rk, ct, m_seg, b_seg)
        w = C.replay(k, v, beta, G, A, h0, rk, ct)[0]
        gc = C.transfer_bwd(q, k, w, G, do, dfin, rq, rk, ct, b_seg, scale=K**-0.5)
        gx = X.transfer_bwd(q, k, w.astype(jnp.float32), G, do, dfin, rq, rk, ct, b_seg,
                            scale=K**-0.5)
        return (Mc, Mx), (Bc, Bx), (gc, gx)

    out = run(q, k, v, g, beta, h0, do, dfin)
    for name, (c, x), sel in zip(("M", "B", "dB"), out, (m_seg, b_seg, b_seg)):
        c, x = np.asarray(c), np.asarray(x)
        assert np.all(np.isfinite(c)), name
        none = np.asarray(sel) < 0
        assert np.all(c[none] == 0), name  # units that need nothing get zeros
        if (~none).any():
            assert rel_rms(c[~none], x[~none]) <= 1e-2, (name, rel_rms(c[~none], x[~none]))


@pytest.mark.parametrize("dtype,K,V", [(jnp.bfloat16, 128, 128), (jnp.bfloat16, 64, 64),
                                       (jnp.float32, 128, 128), (jnp.bfloat16, 64, 128),
                                       (jnp.bfloat16, 128, 64)])
def test_gpu_transfer_kernels_match_xla(dtype, K, V):
    need_gpu()
    _gpu_transfer_check(dtype, K, V, seed=K + V)


def test_gpu_transfer_kernels_write_everything_under_poison():
    need_gpu()
    run_python(textwrap.dedent("""
        import sys; sys.path.insert(0, "tests")
        import jax.numpy as jnp
        from test_segments import _gpu_transfer_check
        _gpu_transfer_check(jnp.bfloat16, 128, 128, seed=3)
        print("OK")
    """), poison=True)


def _gpu_gdn(lens, segments, *, save_mode="light", deterministic=True, nan_doc=None, seed=0):
    rng = np.random.default_rng(seed)
    cu = _cu(lens)
    T, N = int(cu[-1]), len(lens)
    H, HV, K = 4, 12, 128
    q = jnp.asarray(rng.standard_normal((1, T, H, K)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, T, H, K)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((1, T, HV, K)), jnp.bfloat16)
    if nan_doc is not None:
        v = v.at[0, int(cu[nan_doc]) + 3].set(jnp.nan)
    g = jnp.asarray(-rng.uniform(0.01, 0.3, (1, T, HV)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.95, (1, T, HV)), jnp.float32)
    h0 = jnp.asarray(0.3 * rng.standard_normal((N, HV, K, K)), jnp.float32)
    do = jnp.asarray(rng.standard_normal((1, T, HV, K)), jnp.bfloat16)
    dfinal = jnp.asarray(rng.standard_normal(h0.shape), jnp.float32)
    f = jax.jit(lambda *a: _vjp(a[:6], a[6], a[7], cu_seqlens=jnp.asarray(cu), qk_l2norm=True,
                                backend="cuda", segments=segments, save_mode=save_mode,
                                deterministic=deterministic))
    out = f(q, k, v, g, beta, h0, do, dfinal)
    return out, (q, k, v, g, beta, h0, do, dfinal, cu)


GPU_DOCS = ((1, 3000, 65, 0, 1000), (4096,))  # the f64 reference runs on the host


@pytest.mark.parametrize("lens", GPU_DOCS)
@pytest.mark.parametrize("segments", (2, 4, 7))
def test_gpu_gdn_segments(lens, segments):
    need_gpu()
    (o, final, grads), (q, k, v, g, beta, h0, do, dfinal, cu) = _gpu_gdn(lens, segments)
    with jax.default_device(jax.devices("cpu")[0]):
        ro, rfinal, rgrads = gdn_reference_vjp(*(np.asarray(x, np.float32) for x in
                                                 (q, k, v, g, beta, do, dfinal)),
                                               cu_seqlens=cu, qk_l2norm=True,
                                               initial_state=np.asarray(h0))
    errs = {"o": rel_rms(o, ro), "final": rel_rms(final, rfinal)}
    errs.update({n: rel_rms(grads[n], rgrads[n]) for n in GRADS})
    assert all(e <= 1e-2 for e in errs.values()), errs
    (o1, final1, grads1), _ = _gpu_gdn(lens, 1)
    assert rel_rms(o, o1) <= 1e-2 and rel_rms(final, final1) <= 1e-2
    # light == full, bit for bit, with deterministic=True
    (of, finalf, gradsf), _ = _gpu_gdn(lens, segments, save_mode="full")
    for a, b in zip(jax.tree.leaves((o, final, grads)), jax.tree.leaves((of, finalf, gradsf))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_gpu_gdn_segments_contain_nan():
    need_gpu()
    lens = (3000, 5000, 2000)
    (o, final, grads), (*_, cu) = _gpu_gdn(lens, 6, nan_doc=1)
    lo, hi = int(cu[1]), int(cu[2])
    assert _finite_outside(o, lo, hi)
    fin = np.asarray(final)
    assert np.all(np.isfinite(fin[[0, 2]]))
    for n in ("q", "k", "v", "g", "beta"):
        assert _finite_outside(grads[n], lo, hi), n


def test_gpu_gdn_segments_finite_under_poison():
    need_gpu()
    run_python(textwrap.dedent("""
        import sys; sys.path.insert(0, "tests")
        import jax, numpy as np
        from test_segments import _gpu_gdn
        out, _ = _gpu_gdn((1, 4000, 65, 0, 2000), 5, save_mode="full")
        for x in jax.tree.leaves(out):
            assert np.all(np.isfinite(np.asarray(x, np.float32)))
        print("OK")
    """), poison=True)
