"""Context parallelism on 8 CPU devices: gdn_kcp and the CP short conv equal one device."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_inputs, rel_rms
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cake_gdn as J
from jax_cake_gdn.kcp import plan_kcp

from kcp_harness import AX, LAYOUTS, NAMES, docs_for, mesh as _mesh, run_conv_kcp
from kcp_harness import run_conv_one_device
from kcp_harness import run_kcp as _run_kcp
from kcp_harness import run_one_device as _run_one_device


def mesh(W):
    return _mesh(tuple(jax.devices("cpu")[:W]))  # 8 host devices


def run_kcp(W, layout, cu, args, do, **kw):
    return _run_kcp(jax.devices("cpu")[:W], layout, cu, args, do, backend="xla", **kw)


def run_one_device(cu, args, do):
    return _run_one_device(jax.devices("cpu")[0], cu, args, do, backend="xla")


# every layout and exchange on 8 devices; on 2 and 4 every layout, the exchanges alternating
CASES = ([(8, layout, exchange) for layout in LAYOUTS for exchange in ("a2a", "ring")]
         + [(W, layout, ("a2a", "ring")[(i + W // 4) % 2])
            for W in (2, 4) for i, layout in enumerate(LAYOUTS)]
         + [(1, "contiguous", "a2a")])


@pytest.mark.parametrize("W,layout,exchange", CASES)
def test_kcp_matches_one_device(rng, W, layout, exchange):
    T = 384
    segments = (1, 2, 3)[(W + len(layout)) % 3]
    cu = docs_for(layout, W, T, rng)
    args = make_inputs(rng, T=T, H=2, HV=4, K=16, V=16)[:5]
    do = jnp.asarray(rng.standard_normal((1, T, 4, 16)), jnp.float32)
    o, grads = run_kcp(W, layout, cu, args, do, exchange=exchange, segments=segments)
    ro, rgrads = run_one_device(cu, args, do)
    errs = {"o": rel_rms(o, ro), **{n: rel_rms(a, b) for n, a, b in zip(NAMES, grads, rgrads)}}
    assert all(e <= 1e-5 for e in errs.values()), (segments, errs)


def test_single_document_spanning_every_rank(rng):
    W, T = 8, 512
    cu = np.array([0, T], np.int32)
    args = make_inputs(rng, T=T, H=1, HV=2, K=16, V=16)[:5]
    do = jnp.asarray(rng.standard_normal((1, T, 2, 16)), jnp.float32)
    ro, rgrads = run_one_device(cu, args, do)
    for layout in ("contiguous", "zigzag"):
        o, grads = run_kcp(W, layout, cu, args, do, segments=2)
        assert rel_rms(o, ro) <= 1e-5
        for a, b in zip(grads, rgrads):
            assert rel_rms(a, b) <= 1e-5


@pytest.mark.parametrize("layout", ("contiguous", "zigzag", "doc_zigzag"))
def test_save_modes_bitwise_and_exchanges_agree(rng, layout):
    W, T = 4, 256
    cu = docs_for(layout, W, T, rng)
    args = make_inputs(rng, T=T, H=2, HV=2, K=16, V=16)[:5]
    do = jnp.asarray(rng.standard_normal((1, T, 2, 16)), jnp.float32)
    results = {}
    for exchange in ("a2a", "ring"):
        for mode in ("light", "full"):
            results[exchange, mode] = run_kcp(W, layout, cu, args, do, exchange=exchange,
                                              save_mode=mode, segments=2)
    for exchange in ("a2a", "ring"):
        (o_l, light), (o_f, full) = results[exchange, "light"], results[exchange, "full"]
        np.testing.assert_array_equal(o_l, o_f)  # one walk_output for o in both modes
        for a, b in zip(light, full):
            np.testing.assert_array_equal(a, b)
    _, a2a = results["a2a", "light"]
    _, ring = results["ring", "light"]
    for a, b in zip(a2a, ring):
        assert rel_rms(a, b) <= 1e-6


@pytest.mark.parametrize("W", (2, 8))
@pytest.mark.parametrize("layout", ("contiguous", "zigzag", "doc_zigzag"))
def test_short_conv_kcp_matches_one_device(rng, W, layout):
    T, C = 256, 6
    cu = docs_for(layout, W, T, rng)
    x = jnp.asarray(rng.standard_normal((1, T, C)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((C, 4)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((1, T, C)), jnp.float32)
    y_ref, dx_ref, dw_ref = run_conv_one_device(jax.devices("cpu")[0], cu, x, w, dy)
    y, dx, dw = run_conv_kcp(jax.devices("cpu")[:W], layout, cu, x, w, dy)
    assert rel_rms(y, y_ref) <= 1e-6
    assert rel_rms(dx, dx_ref) <= 1e-6
    assert rel_rms(dw, dw_ref) <= 1e-6


@pytest.mark.parametrize("save_mode,segments,W", [
    ("light", 1, 4), ("light", 2, 4), ("full", 1, 4), ("full", 3, 4), ("light", 1, 1),
    ("full", 2, 1)])
def test_saved_layout_kcp_equals_residuals(rng, save_mode, segments, W):
    T = 256
    cu = docs_for("contiguous", W, T, rng)
    args = make_inputs(rng, T=T, H=2, HV=2, K=16, V=16, dtype=jnp.bfloat16)[:5]
    kw = dict(save_mode=save_mode, segments=segments, exchange="a2a")
    layout = J.saved_layout(*args, cu_seqlens=cu, num_ranks=W, **kw)
    m = mesh(W)
    kept = []

    def local(q, k, v, g, beta, cu):
        f = lambda *a: J.gdn_kcp(*a, cu_seqlens=cu, axis_name=AX, backend="xla", **kw)
        _, pull = jax.vjp(f, q, k, v, g, beta)
        kept.extend((tuple(x.shape), str(x.dtype)) for x in jax.tree_util.tree_leaves(pull))
        return f(q, k, v, g, beta)

    tok = NamedSharding(m, P(None, AX))
    jax.eval_shape(jax.shard_map(local, mesh=m, in_specs=(P(None, AX),) * 5 + (P(),),
                                 out_specs=P(None, AX)),
                   *[jax.device_put(x, tok) for x in args],
                   jax.device_put(jnp.asarray(cu), NamedSharding(m, P())))
    assert sorted((s, str(d)) for s, d, _ in layout.values()) == sorted(kept)
    HV, K = 2, 16
    if W > 1 or segments > 1:  # the transposed merge reads the units' M in either save mode
        assert layout["gdn_M"][0] == (segments, HV, K, K)
        assert layout["gdn_M"][2] == segments * HV * K * K * 4
    else:  # nothing crosses a boundary: gdn's residuals alone
        assert "gdn_M" not in layout
    assert ("gdn_w" in layout) == (save_mode == "full")
    assert J.saved_bytes(*args, cu_seqlens=cu, num_ranks=W, **kw) == sum(
        b for _, _, b in layout.values())


@pytest.mark.parametrize("exchange,collective", [("a2a", "all_to_all"),
                                                  ("ring", "collective_permute")])
def test_lowered_step_has_the_exchange_collective(rng, exchange, collective):
    from jax_cake_gdn.primitives import cuda

    backend = "cuda" if cuda.available() else "xla"
    W, T = 8, 512
    m = mesh(W)
    tok = NamedSharding(m, P(None, AX))
    D = 64  # a head dim the cuda kernels support
    shapes = [((1, T, 2, D), jnp.bfloat16)] * 2 + [((1, T, 4, D), jnp.bfloat16)] + [
        ((1, T, 4), jnp.float32)] * 2
    sds = [jax.ShapeDtypeStruct(s, d, sharding=tok) for s, d in shapes]
    cu = jax.ShapeDtypeStruct((5,), jnp.int32, sharding=NamedSharding(m, P()))

    def local(q, k, v, g, beta, cu):
        f = lambda *a: jnp.sum(J.gdn_kcp(*a, cu_seqlens=cu, axis_name=AX, exchange=exchange,
                                         qk_l2norm=True, backend=backend,
                                         save_mode="light").astype(jnp.float32))
        return jax.grad(f, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)

    step = jax.jit(jax.shard_map(local, mesh=m, in_specs=(P(None, AX),) * 5 + (P(),),
                                 out_specs=(P(None, AX),) * 5))
    hlo = step.trace(*sds, cu).lower(lowering_platforms=("cuda",)).as_text()
    assert f"stablehlo.{collective}" in hlo
    if backend == "cuda":  # light's kernels of the forward, the replay and the backward (grad only:
        # the light forward's walk_output is dead code here, o itself is not needed), the units'
        # summaries and their backward twin; never the old transfer walks through prep and
        # state_walk
        for name in ("gate_cumsum", "l2norm_rstd", "solve_a", "transfer", "replay",
                     "transfer_bwd", "walk_chunk_bwd"):
            assert f"jax_cake_gdn_{name}" in hlo, name
        for name in ("prep", "state_walk"):
            assert f"jax_cake_gdn_{name}(" not in hlo, name
        # no zero-size custom-call operand (they crash XLA's SPMD partitioner on GPUs); a scalar
        # operand's layout attribute is an empty tensor<0xindex>, not an operand
        calls = [ln for ln in hlo.splitlines() if "custom_call @jax_cake_gdn_" in ln]
        assert calls and not [ln for ln in calls if re.search(r"tensor<(\d+x)*0x(?!index)", ln)]


def _call_kcp(W, grad=False, **kw):
    """gdn_kcp's o on W CPU devices (with grad: each rank's gradients of the sum of its o in q,
    k, v, g, beta)."""
    m = mesh(W)
    T = 64 * W
    args = make_inputs(np.random.default_rng(0), T=T, H=1, HV=1, K=8, V=8)[:5]
    cu = kw.pop("cu", np.array([0, T], np.int32))
    tok = NamedSharding(m, P(None, AX))
    traced = kw.pop("traced", False)

    def local(*a):
        o = lambda *x: J.gdn_kcp(*x, cu_seqlens=a[5] if traced else cu, axis_name=AX,
                                 backend="xla", **kw)
        if not grad:
            return o(*a[:5])
        return jax.grad(lambda *x: jnp.sum(o(*x).astype(jnp.float32)),
                        argnums=tuple(range(5)))(*a[:5])

    f = jax.jit(jax.shard_map(local, mesh=m, in_specs=(P(None, AX),) * 5 + (P(),),
                              out_specs=(P(None, AX),) * 5 if grad else P(None, AX)))
    return f(*[jax.device_put(x, tok) for x in args], jax.device_put(jnp.asarray(cu),
                                                                     NamedSharding(m, P())))


@pytest.mark.parametrize("kw,text", [
    (dict(layout="stripes"), "layout must be one of"),
    (dict(exchange="tree"), "exchange must be one of"),
    (dict(layout="doc_zigzag", cu=np.array([0, 100, 256], np.int32)), "document 0"),
    (dict(cu=np.array([0, 100, 200], np.int32)), "must equal the token count"),
    (dict(segments=0), "segments must be a positive int"),
])
def test_kcp_bad_input(kw, text):
    with pytest.raises(ValueError, match=text):
        _call_kcp(4, **kw)


def test_traced_bad_doc_zigzag_bounds_give_nan():
    o = _call_kcp(4, layout="doc_zigzag", cu=np.array([0, 100, 256], np.int32), traced=True)
    assert np.all(np.isnan(np.asarray(o)))
    o = _call_kcp(4, layout="doc_zigzag", cu=np.array([0, 96, 256], np.int32), traced=True)
    assert np.all(np.isfinite(np.asarray(o)))
    # and the gradients: NaN everywhere for bad bounds, finite for good ones
    for cu, bad in (([0, 100, 256], True), ([0, 96, 256], False)):
        grads = _call_kcp(4, grad=True, layout="doc_zigzag", cu=np.array(cu, np.int32),
                          traced=True)
        for d in grads:
            d = np.asarray(d, np.float32)
            assert np.all(np.isnan(d)) if bad else np.all(np.isfinite(d)), (cu, d.shape)


def test_layout_token_count_not_divisible():
    x = jnp.zeros((1, 30, 2))
    with pytest.raises(ValueError, match="multiple of 8"):
        J.to_layout(x, jnp.array([0, 30], jnp.int32), "zigzag", 4)


def test_gdn_kcp_outside_shard_map(rng):
    args = make_inputs(rng, T=64, H=1, HV=1, K=8, V=8)[:5]
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        J.gdn_kcp(*args, cu_seqlens=jnp.array([0, 64], jnp.int32), axis_name=AX)


def test_plan():
    # B23 on one rank: 4 documents x 48 value heads = 192 chains fill 132 SMs: no units
    assert plan_kcp(32768, 48, num_ranks=1, num_docs=4).P == 1
    # one rank: no units (measured: the transfer walk costs about a main walk per chunk)
    assert plan_kcp(65536, 48, num_ranks=1, num_docs=1).P == 1
    # one document x 48 heads across ranks leaves SMs idle and pays the transfer anyway: units
    assert plan_kcp(131072, 48, num_ranks=2, num_docs=1).P > 1
    assert plan_kcp(4 * 64, 48, num_ranks=2).P == 1  # 4 chunks: no room for two units
    # doc_zigzag holds two fragments of every document on every rank
    assert plan_kcp(32768, 48, layout="doc_zigzag", num_ranks=2, num_docs=4).P == 1
    assert plan_kcp(32768, 48, layout="doc_zigzag", num_ranks=2, num_docs=1).P > 1
    assert plan_kcp(256, 2, num_ranks=1, segments=5).P == 5
    with pytest.raises(ValueError, match="layout must be one of"):
        plan_kcp(256, 2, layout="bogus")
    with pytest.raises(ValueError, match="num_ranks must be a positive int"):
        plan_kcp(256, 2, num_ranks=0)


@pytest.mark.parametrize("segments", (2, 3))
def test_kcp_cuda_segments_on_one_gpu(rng, segments):
    """gdn_kcp at W = 1 with P segments on the cuda backend equals gdn on the cuda backend."""
    from jax_cake_gdn.primitives import cuda

    if not (cuda.available() and cuda.gpu_available()):
        pytest.skip("no CUDA GPU")
    T, H, HV, K = 1536, 2, 6, 128
    cu = np.array([0, 1, 700, 701, 1536], np.int32)
    args = make_inputs(rng, T=T, H=H, HV=HV, K=K, V=K, dtype=jnp.bfloat16, qk_l2norm=True)[:5]
    do = jnp.asarray(rng.standard_normal((1, T, HV, K)), jnp.float32)
    m = jax.make_mesh((1,), (AX,), devices=jax.devices("cuda")[:1])
    tok, rep = NamedSharding(m, P(None, AX)), NamedSharding(m, P())

    def local(q, k, v, g, beta, cu, do):
        f = lambda *a: J.gdn_kcp(*a, cu_seqlens=cu, axis_name=AX, segments=segments,
                                 qk_l2norm=True, backend="cuda")
        o, pull = jax.vjp(f, q, k, v, g, beta)
        return o, pull(do.astype(o.dtype))

    fn = jax.jit(jax.shard_map(local, mesh=m, in_specs=(P(None, AX),) * 5 + (P(), P(None, AX)),
                               out_specs=(P(None, AX), (P(None, AX),) * 5)))
    o, grads = fn(*[jax.device_put(x, tok) for x in args], jax.device_put(jnp.asarray(cu), rep),
                  jax.device_put(do, tok))
    f1 = lambda *a: J.gdn(*a, cu_seqlens=jnp.asarray(cu), qk_l2norm=True, backend="cuda")
    ro, pull = jax.vjp(f1, *[jax.device_put(x, jax.devices("cuda")[0]) for x in args])
    rgrads = pull(jax.device_put(do, jax.devices("cuda")[0]).astype(ro.dtype))
    assert rel_rms(o, ro) <= 1e-2
    for a, b in zip(grads, rgrads):
        assert np.all(np.isfinite(np.asarray(a, np.float32)))
        assert rel_rms(a, b) <= 1e-2


@pytest.mark.parametrize("save_mode", ("light", "full"))
def test_lowered_kcp_on_one_rank_runs_gdns_kernels(save_mode):
    """At W = 1 with the planned P (1: nothing crosses a unit edge), gdn_kcp lowers to exactly
    gdn's kernels, forward and forward + backward: no transfer, no twin."""
    from conftest import lowered_cuda_calls, need_ext

    need_ext()
    T, D = 1024, 64
    m = mesh(1)
    shapes = [((1, T, 2, D), jnp.bfloat16)] * 2 + [((1, T, 4, D), jnp.bfloat16)] + [
        ((1, T, 4), jnp.float32)] * 2
    sds = [jax.ShapeDtypeStruct(s, d) for s, d in shapes] + [
        jax.ShapeDtypeStruct((4,), jnp.int32)]
    on_mesh = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(m, P(None, AX)))
               for x in sds[:5]] + [
        jax.ShapeDtypeStruct((4,), jnp.int32, sharding=NamedSharding(m, P()))]
    kw = dict(qk_l2norm=True, backend="cuda", save_mode=save_mode)

    def kcp(q, k, v, g, beta, cu):
        return J.gdn_kcp(q, k, v, g, beta, cu_seqlens=cu, axis_name=AX, **kw)

    def gdn(q, k, v, g, beta, cu):
        return J.gdn(q, k, v, g, beta, cu_seqlens=cu, **kw)

    def with_grad(f):
        def step(*a):
            o, pull = jax.vjp(lambda *x: f(*x, a[5]), *a[:5])
            return o, pull(o)
        return step

    tok = P(None, AX)
    for f, ref, outs in ((kcp, gdn, tok), (with_grad(kcp), with_grad(gdn), (tok, (tok,) * 5))):
        sharded = jax.shard_map(f, mesh=m, in_specs=(tok,) * 5 + (P(),), out_specs=outs)
        got = sorted(lowered_cuda_calls(sharded, *on_mesh))
        want = sorted(lowered_cuda_calls(ref, *sds))
        assert "transfer" not in got and "transfer_bwd" not in got, got
        assert got == want, (got, want)
