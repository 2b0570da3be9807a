"""The cuda backward: walk_bwd (cuda/walk_bwd.cu) and chunk_bwd (cuda/chunk_bwd.cu), in the cuda
primitive set.

CPU host: the wrappers lower for the cuda platform to their custom calls (walk_bwd: rstd or
f32[1] placeholders, dS_end and dvn returned as bf16; chunk_bwd: rstd or
f32[1] placeholders, h, dS_end and dvn taken as bf16); the gradient of gdn(backend="cuda") calls
both kernels once and has no while loop; under jax.checkpoint its backward recomputes the forward
only as far as the saved set (light: not the walk); saved_layout on the cuda backend reports the
bf16 h tape of full mode and equals what JAX keeps; bad inputs raise ValueError naming the
argument.
GPU host: cuda walk_bwd against xla walk_bwd on identical inputs (made by the xla forward
primitives) on uneven documents (1, 0, 63, 64, 65, 0, 1000 tokens; 4 unused chunk slots), GVA
(16, 48) and (2, 6), L2 norm on and off, bf16 and f32, K/V 128 and 64
(relative RMS <= 1e-2 on dS_end and dvn, which the kernel returns in bf16, and dh0; dS_end and dvn
of unused chunk slots and dvn's padding rows are exactly 0, as xla gives);
the same under JAX_CAKE_GDN_POISON=1 (subprocess) with every output finite; cuda chunk_bwd
against xla chunk_bwd on the same inputs and configurations (the cuda kernel gets xla's h,
dS_end and dvn rounded to bf16; every gradient within relative RMS 1e-2 of xla on the f32 ones
and of xla on the same bf16-rounded values cast back to f32; every token row finite, also under
poison); and gdn gradients on the cuda backend (both kernels) against the float64 reference
(<= 1e-2), light and full bitwise equal; the dq / dk epilogue (l2norm_bwd: GVA group sum and
L2-norm backward) against a float64 numpy version; deterministic=True gradients bitwise equal over
10 runs, with the device memory they reuse first filled with NaN; walk_chunk_bwd (both kernels in
one call, chunk_bwd waiting for the items the walk publishes: gdn's backward) bitwise equal to the
two calls, with the segments in either order, and finite under poison.
"""

from __future__ import annotations

import os
import re
import textwrap
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import need_ext, need_gpu, run_python

import jax_cake_gdn as J
from jax_cake_gdn import gdn, primitives
from jax_cake_gdn.chunks import ChunkTable, chunk_table
from jax_cake_gdn.primitives import cuda
from jax_cake_gdn.primitives import xla as X

DOC_LENS = (1, 0, 63, 64, 65, 0, 1000)  # T = 1193, 7 segments, NC = 25 (21 used)
TOL = 1e-2  # relative RMS, bf16 tensor-core products (docs/design.md section 4)


def _ct(start, length, seg_first=None, seg_last=None, seg_len=None, seg_order=None):
    """A chunk table of the given arrays (the cuda wrappers read only these fields)."""
    return ChunkTable(start, length, None, None, None, seg_first, seg_last, seg_len, seg_order,
                      None, None)


def rel(x, ref) -> float:
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def make_walk_inputs(seed, H=2, HV=6, K=128, V=128, dtype=jnp.bfloat16, qk_l2norm=True,
                     doc_lens=DOC_LENS):
    """Packed gdn inputs plus random cotangents: q, k [T, H, K], v [T, HV, V], g, beta [T, HV],
    h0 and dfinal [N, HV, K, V], do [T, HV, V] (dtype), cu_seqlens [N + 1]."""
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(doc_lens)]).astype(np.int32)
    T, N = int(cu[-1]), len(doc_lens)
    s = 1.0 if qk_l2norm else K**-0.5
    cast = lambda x: jnp.asarray(np.asarray(x, np.float32), dtype)
    return dict(
        q=cast(rng.standard_normal((T, H, K)) * s), k=cast(rng.standard_normal((T, H, K)) * s),
        v=cast(rng.standard_normal((T, HV, V))),
        g=jnp.asarray(-rng.uniform(0.01, 0.3, (T, HV)), jnp.float32),
        beta=jnp.asarray(rng.uniform(0.1, 0.95, (T, HV)), jnp.float32),
        h0=jnp.asarray(0.3 * rng.standard_normal((N, HV, K, V)), jnp.float32),
        do=cast(rng.standard_normal((T, HV, V))),
        dfinal=jnp.asarray(rng.standard_normal((N, HV, K, V)), jnp.float32),
        cu=jnp.asarray(cu))


def _xla_forward(q, k, v, g, beta, h0, cu, qk_l2norm):
    """The xla forward primitives' intermediates: (ct, rq, rk, G, A, w, u, h, v_new)."""
    ct = chunk_table(cu, q.shape[0])
    rq = X.l2norm_rstd(q) if qk_l2norm else None
    rk = X.l2norm_rstd(k) if qk_l2norm else None
    G = X.gate_cumsum(g, ct)
    A, w, u = X.prep(k, v, beta, G, rk, ct)
    h, vn, _ = X.state_walk(k, w, u, G, h0, rk, ct)
    return ct, rq, rk, G, A, w, u, h, vn


def walk_pairs(inp, qk_l2norm):
    """xla walk_bwd and cuda walk_bwd (the segments in either order) on the same inputs, made by
    the xla forward primitives. Returns a dict of arrays and the chunk lengths."""
    scale = inp["q"].shape[-1] ** -0.5

    @jax.jit
    def run(q, k, v, g, beta, h0, do, dfinal, cu):
        ct, rq, rk, G, A, w, u, h, vn = _xla_forward(q, k, v, g, beta, h0, cu, qk_l2norm)
        bf = jnp.bfloat16  # the cuda kernels take w in bf16
        # the segments' CTAs started in the opposite order: the same values, bit for bit
        ct_rev = ct._replace(seg_order=ct.seg_order[::-1])
        wb = w.astype(bf)
        out = {"xla": X.walk_bwd(q, k, w, G, do, dfinal, None, rq, rk, ct, scale=scale),
               "cuda": cuda.walk_bwd(q, k, wb, G, do, dfinal, None, rq, rk, ct, scale=scale),
               "cuda_rev": cuda.walk_bwd(q, k, wb, G, do, dfinal, None, rq, rk, ct_rev,
                                         scale=scale)}
        return out, ct.length

    return run(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["h0"], inp["do"],
               inp["dfinal"], inp["cu"])


CB_NAMES = ("dq", "dk", "dv", "dg", "dbeta")


def chunk_bwd_pairs(inp, qk_l2norm):
    """xla chunk_bwd and cuda chunk_bwd on the same inputs (the xla forward primitives and the
    xla walk_bwd make A, h, v_new, dS_end, dvn; the cuda kernel takes h, v_new, dS_end and dvn in
    bf16, so it gets them rounded to bf16). Returns {"xla": 5 arrays (f32 h, dS_end, dvn), "xla_r":
    5 arrays (xla on the bf16-rounded h, dS_end, dvn cast back to f32: the cuda kernel's exact
    values),
    "cuda": 5 arrays, "cuda_sum": 5 arrays (deterministic=False: the kernel sums dq, dk over
    each GVA group with atomic adds)}."""
    scale = inp["q"].shape[-1] ** -0.5

    @jax.jit
    def run(q, k, v, g, beta, h0, do, dfinal, cu):
        ct, rq, rk, G, A, w, u, h, vn = _xla_forward(q, k, v, g, beta, h0, cu, qk_l2norm)
        dS, _, dvn = X.walk_bwd(q, k, w, G, do, dfinal, None, rq, rk, ct, scale=scale)
        bf, f32 = jnp.bfloat16, jnp.float32
        hb, dSb, dvnb = h.astype(bf), dS.astype(bf), dvn.astype(bf)
        return {"xla": X.chunk_bwd(q, k, v, beta, G, A, w, u, h, vn, None, dS, dvn, do, rq, rk,
                                   ct, scale=scale),
                "xla_r": X.chunk_bwd(q, k, v, beta, G, A, w, u, hb.astype(f32), vn, None,
                                     dSb.astype(f32), dvnb.astype(f32), do, rq, rk, ct,
                                     scale=scale),
                **{key: cuda.chunk_bwd(q, k, v, beta, G, A.astype(bf), None, None, hb,
                                       vn.astype(bf), None, dSb, dvnb, do, rq, rk, ct,
                                       scale=scale, deterministic=det)
                   for key, det in (("cuda", True), ("cuda_sum", False))}}

    return run(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["h0"], inp["do"],
               inp["dfinal"], inp["cu"])


# ------------------------------------------------------------------------------------------------
# CPU host
# ------------------------------------------------------------------------------------------------


def _lower_cuda(f, *args) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _abstract_walk(T=300, H=2, HV=6, K=128, V=128, S=5, NC=9, dtype=jnp.bfloat16):
    sds = jax.ShapeDtypeStruct
    f32, i32 = jnp.float32, jnp.int32
    return dict(q=sds((T, H, K), dtype), k=sds((T, H, K), dtype), w=sds((T, HV, K), jnp.bfloat16),
                G=sds((T, HV), f32), do=sds((T, HV, V), dtype), dfinal=sds((S, HV, K, V), f32),
                rq=sds((T, H), f32),
                rk=sds((T, H), f32),
                cs=sds((NC,), i32), cl=sds((NC,), i32), sf=sds((S,), i32), sl=sds((S,), i32),
                sn=sds((S,), i32), so=sds((S,), i32))


@pytest.mark.parametrize("l2", [True, False])
def test_lower_walk_bwd_for_cuda(l2):
    need_ext()
    a = _abstract_walk()

    def f(q, k, w, G, do, dfinal, rq, rk, cs, cl, sf, sl, sn, so):
        return cuda.walk_bwd(q, k, w, G, do, dfinal, None, rq if l2 else None,
                             rk if l2 else None, _ct(cs, cl, sf, sl, sn, so), scale=0.125)

    hlo = _lower_cuda(f, *a.values())
    calls = [ln for ln in hlo.splitlines() if "custom_call @jax_cake_gdn_walk_bwd" in ln]
    assert len(calls) == 1, hlo
    call = calls[0]
    # dS_end, dh0, dvn
    assert ("-> (tensor<9x6x128x128xbf16>, tensor<5x6x128x128xf32>, tensor<9x6x64x128xbf16>)"
            in call), call
    assert ("tensor<1xf32>" in call) == (not l2)  # absent rstd: f32[1]
    assert "stablehlo.while" not in hlo


def _abstract_chunk(T=300, H=2, HV=6, K=128, V=128, NC=9, dtype=jnp.bfloat16):
    sds = jax.ShapeDtypeStruct
    f32, i32 = jnp.float32, jnp.int32
    return dict(q=sds((T, H, K), dtype), k=sds((T, H, K), dtype), v=sds((T, HV, V), dtype),
                beta=sds((T, HV), f32), G=sds((T, HV), f32), A=sds((NC, HV, 64, 64), jnp.bfloat16),
                h=sds((NC, HV, K, V), jnp.bfloat16), v_new=sds((T, HV, V), jnp.bfloat16),
                dS_end=sds((NC, HV, K, V), jnp.bfloat16), dvn=sds((NC, HV, 64, V), jnp.bfloat16),
                do=sds((T, HV, V), dtype),
                rq=sds((T, H), f32),
                rk=sds((T, H), f32), cs=sds((NC,), i32), cl=sds((NC,), i32))


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("l2", [True, False])
@pytest.mark.parametrize("dims", [(128, 128), (128, 64), (64, 64)])
def test_lower_chunk_bwd_for_cuda(dims, l2, deterministic):
    need_ext()
    K, V = dims
    a = _abstract_chunk(K=K, V=V)

    def f(q, k, v, beta, G, A, h, v_new, dS_end, dvn, do, rq, rk, cs, cl):
        return cuda.chunk_bwd(q, k, v, beta, G, A, None, None, h, v_new, None, dS_end, dvn, do,
                              rq if l2 else None, rk if l2 else None, _ct(cs, cl), scale=0.125,
                              deterministic=deterministic)

    hlo = _lower_cuda(f, *a.values())
    calls = [ln for ln in hlo.splitlines() if "custom_call @jax_cake_gdn_chunk_bwd" in ln]
    assert len(calls) == 1, hlo
    call = calls[0]
    # operands A, h, v_new, dS_end, dvn (bf16), do
    assert (f"tensor<9x6x64x64xbf16>, tensor<9x6x{K}x{V}xbf16>, tensor<300x6x{V}xbf16>, "
            f"tensor<9x6x{K}x{V}xbf16>, tensor<9x6x64x{V}xbf16>, tensor<300x6x{V}xbf16>") in call, \
        call
    # dQ, dK (f32) per value head, or per q/k head when the kernel sums the groups
    # (deterministic=False); dV in v's dtype, dg, dbeta
    hq = 6 if deterministic else 2
    assert (f"tensor<300x{hq}x{K}xf32>, tensor<300x{hq}x{K}xf32>, tensor<300x6x{V}xbf16>, "
            "tensor<300x6xf32>, tensor<300x6xf32>") in call, call
    assert ("tensor<1xf32>" in call) == (not l2)  # absent: f32[1]
    assert "stablehlo.while" not in hlo
    # the dq / dk epilogue (GVA group sum, L2-norm backward) is the l2norm_bwd kernel, twice
    epi = [ln for ln in hlo.splitlines() if "custom_call @jax_cake_gdn_l2norm_bwd" in ln]
    assert len(epi) == 2, hlo
    assert all(f"-> tensor<300x2x{K}xbf16>" in ln for ln in epi), epi
    assert all(f"(tensor<300x{hq}x{K}xf32>" in ln for ln in epi), epi
    assert "stablehlo.reduce" not in hlo


@pytest.mark.parametrize("deterministic", [True, False])
def test_lower_walk_chunk_bwd_for_cuda(deterministic):
    """walk_chunk_bwd is one custom call with walk_bwd's and chunk_bwd's results and the
    hand-off scratch int32[1 + NC HV]; bad inputs raise ValueError naming the call."""
    need_ext()
    w, c = _abstract_walk(), _abstract_chunk()
    tab = (w["cs"], w["cl"], w["sf"], w["sl"], w["sn"], w["so"])

    def f(q, k, v, beta, w, G, A, h, v_new, do, dfinal, rq, rk, *tab, scale=0.125):
        return cuda.walk_chunk_bwd(q, k, v, beta, G, A, w, None, h, v_new, do, dfinal, rq, rk,
                                   _ct(*tab), scale=scale, deterministic=deterministic)

    args = (c["q"], c["k"], c["v"], c["beta"], w["w"], c["G"], c["A"], c["h"], c["v_new"],
            c["do"], w["dfinal"], c["rq"], c["rk"]) + tab
    hlo = _lower_cuda(f, *args)
    calls = [ln for ln in hlo.splitlines() if "custom_call @jax_cake_gdn_walk_chunk_bwd" in ln]
    assert len(calls) == 1, hlo
    hq = 6 if deterministic else 2
    assert ("-> (tensor<9x6x128x128xbf16>, tensor<5x6x128x128xf32>, tensor<9x6x64x128xbf16>, "
            f"tensor<300x{hq}x128xf32>, tensor<300x{hq}x128xf32>, tensor<300x6x128xbf16>, "
            f"tensor<300x6xf32>, tensor<300x6xf32>, tensor<{1 + 9 * 6}xi32>)") in calls[0]
    assert len(re.findall(r"custom_call @jax_cake_gdn_l2norm_bwd", hlo)) == 2
    zeros = lambda x: jnp.zeros(x.shape, x.dtype)
    a = [zeros(x) for x in args]
    bad = {5: jnp.zeros((300, 5), jnp.float32),  # G
           4: jnp.zeros((300, 6, 128), jnp.float32),  # w
           10: jnp.zeros((4, 6, 128, 128), jnp.float32)}  # dfinal: 5 segments
    msgs = {5: "G must have shape", 4: "w must be bfloat16", 10: "dfinal must have shape"}
    for i, x in bad.items():
        with pytest.raises(ValueError, match=f"walk_chunk_bwd: {msgs[i]}"):
            f(*a[:i], x, *a[i + 1:], scale=0.1)


def _grad_fn(backend, save_mode="light", deterministic=False):
    def loss(q, k, v, g, beta, h0, cu):
        o, fin = gdn(q, k, v, g, beta, cu_seqlens=cu, qk_l2norm=True, initial_state=h0,
                     output_final_state=True, save_mode=save_mode, backend=backend,
                     deterministic=deterministic)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(fin)

    return jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5))


def _abstract_gdn(T=300, H=2, HV=6, K=128, V=128, N=5):
    sds = jax.ShapeDtypeStruct
    return (sds((1, T, H, K), jnp.bfloat16), sds((1, T, H, K), jnp.bfloat16),
            sds((1, T, HV, V), jnp.bfloat16), sds((1, T, HV), jnp.float32),
            sds((1, T, HV), jnp.float32), sds((N, HV, K, V), jnp.float32),
            sds((N + 1,), jnp.int32))


@pytest.mark.parametrize("save_mode", ["light", "full"])
def test_cuda_gradient_uses_the_backward_kernels(save_mode):
    """The gradient of gdn(backend="cuda") calls walk_chunk_bwd (the walk_bwd and chunk_bwd
    kernels in one call) once and has no while loop left from the walk, where the xla backend's
    gradient has its reverse scan."""
    need_ext()
    args = _abstract_gdn()
    assert primitives._cuda_primitives().walk_chunk_bwd is not X.walk_chunk_bwd
    assert "walk_chunk_bwd" in primitives.CUDA_KERNELS
    hlo = _lower_cuda(_grad_fn("cuda", save_mode), *args)
    assert len(re.findall(r"custom_call @jax_cake_gdn_walk_chunk_bwd\b", hlo)) == 1
    assert not re.findall(r"custom_call @jax_cake_gdn_(walk|chunk)_bwd\b", hlo)
    assert "stablehlo.while" not in hlo
    assert "stablehlo.while" in _lower_cuda(_grad_fn("xla", save_mode), *args)


@pytest.mark.parametrize("save_mode", ["light", "full"])
def test_checkpoint_recomputes_only_what_the_backward_keeps(save_mode):
    """Under jax.checkpoint the backward recomputes the forward only up to the saved set: light
    runs gate_cumsum, l2norm_rstd and solve_a again but not the walk (walk_output, which makes
    no residual, runs once, for o), which keeps light's ckpt near its fwd+bwd (README); full
    needs its walk (solve_a_walk_output_tapes: A, the h tape, w, v_new) again."""
    need_ext()

    def loss(q, k, v, g, beta, h0, cu):
        def layer(q, k, v, g, beta, h0):
            return gdn(q, k, v, g, beta, cu_seqlens=cu, qk_l2norm=True, initial_state=h0,
                       output_final_state=True, save_mode=save_mode, backend="cuda")
        o, fin = jax.checkpoint(layer)(q, k, v, g, beta, h0)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(fin)

    hlo = _lower_cuda(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5)), *_abstract_gdn())

    def calls(name):
        return len(re.findall(rf"custom_call @jax_cake_gdn_{name}\b", hlo))

    assert calls("gate_cumsum") == 2 and calls("l2norm_rstd") == 4, hlo
    if save_mode == "light":
        assert (calls("solve_a"), calls("walk_output"), calls("replay")) == (2, 1, 1)
    else:
        assert calls("solve_a_walk_output_tapes") == 2
        assert calls("solve_a") == calls("walk_output_tapes") == 0
        assert calls("walk_output") == calls("replay") == 0
    assert calls("state_walk") == calls("prep") == 0


@pytest.mark.parametrize("deterministic", [True, False])
def test_gdn_deterministic_picks_the_group_sum(deterministic):
    """gdn(deterministic=...) reaches the walk_chunk_bwd custom call: True gives per-value-head
    f32 dq, dk (fixed-order group sum in l2norm_bwd), False the kernel's own atomic sum into [T,
    H, K]."""
    need_ext()
    T, H, HV, K = 300, 2, 6, 128
    hlo = _lower_cuda(_grad_fn("cuda", "light", deterministic), *_abstract_gdn(T, H, HV, K))
    calls = [ln for ln in hlo.splitlines() if "custom_call @jax_cake_gdn_walk_chunk_bwd" in ln]
    assert len(calls) == 1, hlo
    hq = HV if deterministic else H
    assert f"xbf16>, tensor<{T}x{hq}x{K}xf32>, tensor<{T}x{hq}x{K}xf32>, " in calls[0], calls[0]


@pytest.mark.parametrize("save_mode", ["light", "full"])
def test_saved_layout_on_cuda_keeps_bf16_intermediates(save_mode):
    """saved_layout(backend="cuda") equals the residuals JAX keeps for gdn(backend="cuda") (traced
    abstractly, no GPU needed); A (both modes) and, in full mode, w, the h tape and v_new are
    kept in bf16 there (f32 on xla), so saved_bytes drops by half of each, and u is not kept
    (xla keeps it in f32: the cuda backward does not read it)."""
    need_ext()
    q, k, v, g, beta, h0, _ = _abstract_gdn()
    cu = jnp.asarray([0, 1, 64, 64, 200, 300], jnp.int32)  # 5 documents, T = 300
    kw = dict(cu_seqlens=cu, qk_l2norm=True, save_mode=save_mode)

    def pullback(q, k, v, g, beta, h0):
        return jax.vjp(lambda *a: gdn(*a, initial_state=h0, backend="cuda", **kw),
                       q, k, v, g, beta)[1]

    kept = jax.tree_util.tree_leaves(jax.eval_shape(pullback, q, k, v, g, beta, h0))
    layout = J.saved_layout(q, k, v, g, beta, initial_state=h0, backend="cuda", **kw)
    assert (sorted((s, str(d)) for s, d, _ in layout.values())
            == sorted((tuple(x.shape), str(x.dtype)) for x in kept))
    xla_layout = J.saved_layout(q, k, v, g, beta, initial_state=h0, backend="xla", **kw)
    nb = lambda be: J.saved_bytes(q, k, v, g, beta, initial_state=h0, backend=be, **kw)
    tapes = ("h", "w", "v_new")
    halved = ("A",) + (tapes if save_mode == "full" else ())  # bf16 on cuda, f32 on xla
    saved = 0
    for name in halved:
        shape, dt, nbytes = layout[name]
        assert dt == jnp.bfloat16, name
        assert xla_layout[name] == (shape, np.dtype(np.float32), 2 * nbytes), name
        saved += nbytes
    assert "u" not in layout and "scores" not in layout
    xla_only = ("u",) if save_mode == "full" else ()
    saved += sum(xla_layout[n][2] for n in xla_only)
    assert nb("cuda") == nb("xla") - saved
    if save_mode == "light":
        assert not set(tapes + ("u",)) & set(xla_layout)
    # everything else is kept in the same dtypes on both backends
    assert {n: x for n, x in layout.items() if n not in halved} == {
        n: x for n, x in xla_layout.items() if n not in halved + xla_only}


def test_bad_inputs_raise_value_error():
    T, H, HV, K, V, NC, S = 100, 2, 6, 128, 128, 4, 3
    q = jnp.zeros((T, H, K), jnp.bfloat16)
    w = jnp.zeros((T, HV, K), jnp.bfloat16)
    G = jnp.zeros((T, HV), jnp.float32)
    do = jnp.zeros((T, HV, V), jnp.bfloat16)
    df = jnp.zeros((S, HV, K, V), jnp.float32)
    cs = jnp.zeros((NC,), jnp.int32)
    s = jnp.zeros((S,), jnp.int32)

    def call(**kw):
        a = dict(q=q, k=q, w=w, G=G, do=do, dfinal=df, rstd_q=None, rstd_k=None,
                 chunk_start=cs, chunk_len=cs, seg_first=s, seg_last=s, seg_len=s, seg_order=s)
        a.update(kw)
        a = list(a.values())
        return cuda.walk_bwd(*a[:6], None, *a[6:8], _ct(*a[8:]), scale=0.1)

    cases = [
        (dict(q=q.astype(jnp.float16)), "q must be bfloat16 or float32"),
        (dict(k=q[:, :1]), "k must have q's shape"),
        (dict(k=q.astype(jnp.float32)), "k must have q's dtype"),
        (dict(q=jnp.zeros((T, H, 96), jnp.bfloat16), k=jnp.zeros((T, H, 96), jnp.bfloat16)),
         "K = 96"),
        (dict(do=jnp.zeros((T, HV, 80), jnp.bfloat16)), "V = 80"),
        (dict(do=do[:, :5]), "multiple of H"),
        (dict(do=do[:50]), "do must be"),
        (dict(w=w[..., :64]), "w must have shape"),
        (dict(w=w.astype(jnp.float32)), "w must be bfloat16 (as the cuda prep / replay return it)"),
        (dict(G=G[:, :2]), "G must have shape"),
        (dict(dfinal=df[:2]), "dfinal must have shape"),
        (dict(rstd_q=jnp.zeros((T, H + 1), jnp.float32)), "rstd_q"),
        (dict(rstd_k=jnp.zeros((T, H), jnp.bfloat16)), "rstd_k must be float32"),
        (dict(chunk_len=cs[:2]), "chunk_len"),
        (dict(seg_last=s[:2]), "seg_last"),
        (dict(seg_first=s.astype(jnp.int16)), "seg_first must be int32"),
        (dict(seg_order=s[:2]), "seg_order must have 3 entries"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=re.escape(msg)):
            call(**kw)


def test_chunk_bwd_bad_inputs_raise_value_error():
    T, H, HV, K, V, NC = 100, 2, 6, 128, 128, 4
    f32 = jnp.float32
    q = jnp.zeros((T, H, K), jnp.bfloat16)
    v = jnp.zeros((T, HV, V), jnp.bfloat16)
    th = jnp.zeros((T, HV), f32)
    st = jnp.zeros((NC, HV, K, V), jnp.bfloat16)
    cs = jnp.zeros((NC,), jnp.int32)

    def call(**kw):
        a = dict(q=q, k=q, v=v, beta=th, G=th, A=jnp.zeros((NC, HV, 64, 64), jnp.bfloat16), h=st,
                 v_new=v, dS_end=st, dvn=jnp.zeros((NC, HV, 64, V), jnp.bfloat16), do=v,
                 rstd_q=None, rstd_k=None,
                 chunk_start=cs, chunk_len=cs)
        a.update(kw)
        a = list(a.values())
        return cuda.chunk_bwd(*a[:6], None, None, *a[6:8], None, *a[8:13], _ct(*a[13:]),
                              scale=0.1)

    cases = [
        (dict(v=v.astype(f32)), "v must have q's dtype"),
        (dict(k=q[:, :1]), "k must have q's shape"),
        (dict(q=jnp.zeros((T, H, 96), jnp.bfloat16), k=jnp.zeros((T, H, 96), jnp.bfloat16)),
         "K = 96"),
        (dict(v=jnp.zeros((T, HV, 80), jnp.bfloat16)), "V = 80"),
        (dict(v=v[:, :5]), "multiple of H"),
        (dict(do=v[:50]), "do must have v's shape"),
        (dict(beta=th[:, :2]), "beta must have shape"),
        (dict(A=jnp.zeros((NC, HV, 64, 32), jnp.bfloat16)), "A must have shape"),
        (dict(A=jnp.zeros((NC, HV, 64, 64), f32)),
         "A must be bfloat16 (as the cuda prep / solve_a return it)"),
        (dict(h=st[:2]), "h must have shape"),
        (dict(dS_end=st.astype(f32)), "dS_end must be bfloat16"),
        (dict(h=st.astype(f32)), "h must be bfloat16"),
        (dict(dS_end=st[:, :, :64]), "dS_end must have shape"),
        (dict(dvn=st[:, :, :32]), "dvn must have shape"),
        (dict(dvn=jnp.zeros((NC, HV, 64, V), f32)),
         "dvn must be bfloat16 (as the cuda walk_bwd returns it)"),
        (dict(v_new=jnp.zeros((T, HV, 64), jnp.bfloat16)), "v_new must have shape"),
        (dict(v_new=v.astype(f32)), "v_new must be bfloat16 (as the cuda state_walk returns it)"),
        (dict(rstd_k=jnp.zeros((T, H + 1), f32)), "rstd_k"),
        (dict(chunk_len=cs[:2]), "chunk_len"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=re.escape(msg)):
            call(**kw)


def test_l2norm_bwd_bad_inputs_raise_value_error():
    need_ext()
    T, H, HV, K = 10, 2, 6, 128
    x = jnp.zeros((T, H, K), jnp.bfloat16)
    dy = jnp.zeros((T, HV, K), jnp.float32)
    r = jnp.ones((T, H), jnp.float32)
    cases = [
        (dict(x=x[0]), "l2norm_bwd: x must have rank 3"),
        (dict(x=x.astype(jnp.float16)), "l2norm_bwd: x must be bfloat16 or float32"),
        (dict(x=jnp.zeros((T, H, 96), jnp.bfloat16), dy=jnp.zeros((T, HV, 96), jnp.float32)),
         "l2norm_bwd: K = 96 is not supported"),
        (dict(dy=dy[:, :, :64]), "l2norm_bwd: dy must be float32 [T, HV, K] with T = 10, K = 128"),
        (dict(dy=dy[:, :5]), "l2norm_bwd: HV = 5 must be a multiple of H = 2"),
        (dict(dy=dy.astype(jnp.bfloat16)), "l2norm_bwd: dy must be float32"),
        (dict(rstd=r[:, :1]), "l2norm_bwd: rstd must have shape (10, 2)"),
    ]
    for kw, msg in cases:
        a = dict(dy=dy, x=x, rstd=r) | kw
        with pytest.raises(ValueError, match=re.escape(msg)):
            cuda.l2norm_bwd(a["dy"], a["x"], a["rstd"])


# ------------------------------------------------------------------------------------------------
# GPU host
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("l2", [True, False])
@pytest.mark.parametrize("heads_k", [(16, 48, 128), (2, 6, 64), (4, 4, 128)])
def test_gpu_l2norm_bwd_matches_xla(heads_k, l2, dtype):
    """The dq / dk epilogue kernel against xla's group sum + L2-norm backward in float64, on fresh
    random inputs; every element written (poisoned run in the gradient checks below)."""
    need_gpu()
    H, HV, K = heads_k
    T = 777
    rng = np.random.default_rng(zlib.crc32(f"{H}{HV}{K}{l2}{dtype}".encode()))
    x = jnp.asarray(rng.standard_normal((T, H, K)).astype(np.float32), dtype)
    dy = jnp.asarray(rng.standard_normal((T, HV, K)).astype(np.float32))
    r = cuda.l2norm_rstd(x) if l2 else None
    got = np.asarray(jax.jit(cuda.l2norm_bwd)(dy, x, r), np.float64)
    x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    d = dy64.reshape(T, H, HV // H, K).sum(2)
    if l2:
        r64 = np.asarray(r, np.float64)[..., None]
        y = x64 * r64
        d = r64 * (d - np.sum(d * y, -1, keepdims=True) * y)
    e = rel(got, d)
    print(f"\n[l2norm_bwd H={H} HV={HV} K={K} l2={l2} {np.dtype(dtype).name}] rel RMS {e:.1e}")
    assert e <= (4e-3 if dtype == jnp.bfloat16 else 1e-6), e

# (name, H, HV, K, V, dtype, qk_l2norm)
CONFIGS = [
    ("gva16x48-bf16-l2", 16, 48, 128, 128, jnp.bfloat16, True),
    ("gva2x6-bf16-nol2", 2, 6, 128, 128, jnp.bfloat16, False),
    ("gva2x6-f32-l2-k64v64", 2, 6, 64, 64, jnp.float32, True),
    ("gva1x4-bf16-k128v64-nol2", 1, 4, 128, 64, jnp.bfloat16, False),
    ("gva2x6-f32-k64v128-l2", 2, 6, 64, 128, jnp.float32, True),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_gpu_walk_bwd_matches_xla(cfg):
    need_gpu()
    name, H, HV, K, V, dtype, l2 = cfg
    inp = make_walk_inputs(zlib.crc32(name.encode()), H=H, HV=HV, K=K, V=V, dtype=dtype,
                           qk_l2norm=l2)
    out, length = walk_pairs(inp, l2)
    used = np.asarray(length) > 0
    assert (~used).sum() == 4 and not used[-4:].any()
    dS_x, dh0_x, dvn_x = (np.asarray(a) for a in out["xla"])
    pad = np.arange(64)[None, :] >= np.asarray(length)[:, None]  # [NC, 64] rows past a chunk
    errs = {}
    for key in ("cuda",):
        assert out[key][0].dtype == jnp.bfloat16 and dS_x.dtype == np.float32, key
        assert out[key][2].dtype == jnp.bfloat16 and dvn_x.dtype == np.float32, key
        # compared after casting the bf16 dS_end, dvn to f32 (their rounding is far below TOL)
        dS, dh0 = np.asarray(out[key][0], np.float32), np.asarray(out[key][1])
        dvn = np.asarray(out[key][2], np.float32)
        assert dS.shape == dS_x.shape and dh0.shape == dh0_x.shape, key
        assert dvn.shape == dvn_x.shape, key
        assert np.isfinite(dS).all() and np.isfinite(dh0).all() and np.isfinite(dvn).all(), key
        errs[key] = (rel(dS[used], dS_x[used]), rel(dh0, dh0_x), rel(dvn[used], dvn_x[used]))
        # unused chunk slots: the xla reverse scan carries its zero start there
        assert (dS[~used] == 0).all() and (dvn[~used] == 0).all(), key
        np.testing.assert_allclose(dS_x[~used], 0.0, atol=1e-6)
        # dvn's rows past a chunk's tokens: zero (no token there)
        assert (dvn.transpose(0, 2, 1, 3)[pad] == 0).all(), key
        np.testing.assert_allclose(dvn_x.transpose(0, 2, 1, 3)[pad], 0.0, atol=1e-6)
        # empty documents (1 and 5): dh0 = dfinal, exactly
        df = np.asarray(inp["dfinal"])
        np.testing.assert_array_equal(dh0[[1, 5]], df[[1, 5]])
    print(f"\n[{name}] cuda walk_bwd vs xla rel RMS (dS_end used chunks, dh0, dvn used chunks): "
          + ", ".join(f"{k}={a:.1e}/{b:.1e}/{c:.1e}" for k, (a, b, c) in errs.items()))
    for key, e in errs.items():
        assert max(e) <= TOL, (key, e)
    for a, b in zip(out["cuda"], out["cuda_rev"]):  # CTA order changes no value
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_gpu_chunk_bwd_matches_xla(cfg):
    need_gpu()
    name, H, HV, K, V, dtype, l2 = cfg
    inp = make_walk_inputs(zlib.crc32(name.encode()) + 1, H=H, HV=HV, K=K, V=V, dtype=dtype,
                           qk_l2norm=l2)
    out = chunk_bwd_pairs(inp, l2)
    errs, errs_r, errs_x = {}, {}, {}
    for n, a, b, br in zip(CB_NAMES, out["cuda"], out["xla"], out["xla_r"]):
        assert a.shape == b.shape and a.dtype == b.dtype, (n, a.shape, b.shape, a.dtype, b.dtype)
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        br = np.asarray(br, np.float32)
        assert np.isfinite(a).all(), n  # every token row belongs to a chunk and is written
        errs[n] = rel(a, b)  # cuda (bf16 h, dS_end, dvn) vs xla on the f32 ones
        errs_r[n] = rel(a, br)  # cuda vs xla on the same bf16-rounded h, dS_end, dvn
        errs_x[n] = rel(br, b)  # what the rounding of h, dS_end, dvn alone changes in xla
    print(f"\n[{name}] cuda chunk_bwd vs xla rel RMS: " +
          ", ".join(f"{n}={e:.1e}" for n, e in errs.items()))
    print(f"[{name}] cuda chunk_bwd vs xla on bf16-rounded h, dS_end, dvn: " +
          ", ".join(f"{n}={e:.1e}" for n, e in errs_r.items()))
    print(f"[{name}] xla on bf16-rounded h, dS_end, dvn vs xla: " +
          ", ".join(f"{n}={e:.1e}" for n, e in errs_x.items()))
    for n in CB_NAMES:
        assert errs[n] <= TOL, (n, errs[n])
        assert errs_r[n] <= TOL, (n, errs_r[n])
    # deterministic=False: dq, dk summed over the group by atomic adds (another f32 order, then
    # the same rounding to q's dtype); dv, dg, dbeta come from the same code: bitwise equal
    sums = {}
    for n, a, b in zip(CB_NAMES, out["cuda_sum"], out["cuda"]):
        assert a.shape == b.shape and a.dtype == b.dtype, (n, a.shape, b.shape)
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if n in ("dq", "dk"):
            assert np.isfinite(a).all(), n
            sums[n] = rel(a, b)
            ulp = 2.0 ** -7 if dtype == jnp.bfloat16 else 2.0 ** -20  # a few roundings
            assert np.all(np.abs(a - b) <= ulp * np.abs(b) + 1e-6 * np.abs(b).max()), n
        else:
            np.testing.assert_array_equal(a, b, err_msg=n)
    print(f"[{name}] cuda chunk_bwd group sum by atomics vs fixed order rel RMS: " +
          ", ".join(f"{n}={e:.1e}" for n, e in sums.items()))


def walk_chunk_pairs(inp, qk_l2norm):
    """cuda walk_bwd then cuda chunk_bwd ("two") against cuda walk_chunk_bwd ("one"; "one_rev":
    the walk's segments started in the opposite order, so the items are published in another
    order), deterministic and not, on inputs made by the xla forward primitives. Each
    entry: (dq, dk, dv, dg, dbeta, dh0)."""
    scale = inp["q"].shape[-1] ** -0.5

    @jax.jit
    def run(q, k, v, g, beta, h0, do, dfinal, cu):
        ct, rq, rk, G, A, w, u, h, vn = _xla_forward(q, k, v, g, beta, h0, cu, qk_l2norm)
        bf = jnp.bfloat16
        A, w, h, vn = A.astype(bf), w.astype(bf), h.astype(bf), vn.astype(bf)
        ct_rev = ct._replace(seg_order=ct.seg_order[::-1])
        out = {}
        for det in (True, False):
            dS, dh0, dvn = cuda.walk_bwd(q, k, w, G, do, dfinal, None, rq, rk, ct, scale=scale)
            out["two", det] = cuda.chunk_bwd(q, k, v, beta, G, A, w, None, h, vn, None, dS, dvn,
                                             do, rq, rk, ct, scale=scale,
                                             deterministic=det) + (dh0,)
            for key, t in (("one", ct), ("one_rev", ct_rev)):
                out[key, det] = cuda.walk_chunk_bwd(q, k, v, beta, G, A, w, None, h, vn, do,
                                                    dfinal, rq, rk, t, scale=scale,
                                                    deterministic=det)
        return out

    return run(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["h0"], inp["do"],
               inp["dfinal"], inp["cu"])


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_gpu_walk_chunk_bwd_equals_the_two_calls(cfg):
    """walk_chunk_bwd (chunk_bwd's CTAs waiting for the items the walk publishes) gives walk_bwd
    + chunk_bwd's results bit for bit, whatever order the items come in; deterministic=False: the
    same up to the order of dq's and dk's atomic adds."""
    need_gpu()
    name, H, HV, K, V, dtype, l2 = cfg
    inp = make_walk_inputs(zlib.crc32(name.encode()) + 2, H=H, HV=HV, K=K, V=V, dtype=dtype,
                           qk_l2norm=l2)
    out = walk_chunk_pairs(inp, l2)
    names = CB_NAMES + ("dh0",)
    for key in ("one", "one_rev"):
        for n, a, b in zip(names, out[key, True], out["two", True]):
            assert a.shape == b.shape and a.dtype == b.dtype, (key, n)
            assert np.isfinite(np.asarray(a, np.float32)).all(), (key, n)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{key} {n}")
        errs = {}
        for n, a, b in zip(names, out[key, False], out["two", True]):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            if n in ("dq", "dk"):
                errs[n] = rel(a, b)
                ulp = 2.0 ** -7 if dtype == jnp.bfloat16 else 2.0 ** -20
                assert np.all(np.abs(a - b) <= ulp * np.abs(b) + 1e-6 * np.abs(b).max()), n
            else:
                np.testing.assert_array_equal(a, b, err_msg=f"{key} deterministic=False {n}")
        print(f"\n[{name}] walk_chunk_bwd ({key}) == walk_bwd + chunk_bwd bitwise; atomic sums "
              "vs fixed order: " + ", ".join(f"{n}={e:.1e}" for n, e in errs.items()))


_POISON_CHECK = textwrap.dedent("""
    import os, sys
    import numpy as np, jax, jax.numpy as jnp
    sys.path.insert(0, os.path.dirname({here!r}))
    from test_cuda_bwd import (make_walk_inputs, walk_pairs, chunk_bwd_pairs, walk_chunk_pairs,
                               CONFIGS, _ct)
    from jax_cake_gdn.primitives import cuda
    assert os.environ["JAX_CAKE_GDN_POISON"] == "1"
    for name, H, HV, K, V, dtype, l2 in CONFIGS:
        inp = make_walk_inputs(3, H=H, HV=HV, K=K, V=V, dtype=dtype, qk_l2norm=l2)
        out, _ = walk_pairs(inp, l2)
        for key in ("cuda", "cuda_rev"):
            for a in out[key]:  # dS_end (bf16), dh0, dvn (bf16)
                assert np.isfinite(np.asarray(a, np.float32)).all(), (name, key)
        # chunk_bwd: every token row of dq, dk, dv, dg, dbeta written (unused chunks write none);
        # cuda_sum's dq, dk start from zeros the kernel adds into, so for them this checks only
        # that nothing non-finite is added (their rows are the per-head path's, checked in "cuda")
        pairs = chunk_bwd_pairs(inp, l2)
        for key in ("cuda", "cuda_sum"):
            for i, a in enumerate(pairs[key]):
                assert np.isfinite(np.asarray(a, np.float32)).all(), (name, key, i)
        for key, a in walk_chunk_pairs(inp, l2).items():  # the same in one call
            for i, x in enumerate(a):
                assert np.isfinite(np.asarray(x, np.float32)).all(), (name, key, i)
    # poison is live: chunk 1 has tokens but no segment claims it, chunk 2 is not after the last
    # used chunk: both stay NaN (dS_end and dvn); chunk 0 and dh0 are written
    T, HV, K, V = 192, 2, 64, 64
    q = jnp.ones((T, 1, K), jnp.bfloat16)
    i32 = lambda *x: jnp.asarray(x, jnp.int32)
    dS, dh0, dvn = jax.jit(cuda.walk_bwd, static_argnames="scale")(
        q, q, jnp.zeros((T, HV, K), jnp.bfloat16), jnp.zeros((T, HV)),
        jnp.ones((T, HV, V), jnp.bfloat16),
        jnp.ones((1, HV, K, V)), None, None, None,
        _ct(i32(0, 64, 128), i32(64, 64, 0), i32(0), i32(0), i32(64), i32(0)), scale=0.1)
    assert dS.dtype == dvn.dtype == jnp.bfloat16  # poison (0xFF bytes) is a NaN in bf16 too
    dS, dh0, dvn = np.asarray(dS, np.float32), np.asarray(dh0), np.asarray(dvn, np.float32)
    assert np.isfinite(dS[0]).all() and np.isfinite(dh0).all() and np.isfinite(dvn[0]).all()
    assert np.isnan(dS[1]).all() and np.isnan(dS[2]).all()
    assert np.isnan(dvn[1]).all() and np.isnan(dvn[2]).all()
    print("OK")
""")


def test_gpu_walk_bwd_finite_under_poison():
    need_gpu()
    run_python(_POISON_CHECK.format(here=os.path.abspath(__file__)), poison=True)


_GRAD_CHECK = textwrap.dedent("""
    import os, sys
    import numpy as np, jax, jax.numpy as jnp
    sys.path.insert(0, os.path.dirname({here!r}))
    from test_cuda_bwd import make_walk_inputs, rel, TOL
    from jax_cake_gdn import gdn, primitives
    from jax_cake_gdn.primitives import xla
    from jax_cake_gdn.reference import gdn_reference_vjp
    assert primitives._cuda_primitives().walk_bwd is not xla.walk_bwd
    for H, HV, K, V, l2 in ((2, 6, 128, 128, True), (1, 4, 128, 64, False)):
        i = make_walk_inputs(21 + K, H=H, HV=HV, K=K, V=V, qk_l2norm=l2)
        add = lambda x: x[None]
        q, k, v, g, beta, do = (add(i[n]) for n in ("q", "k", "v", "g", "beta", "do"))
        h0, dfin, cu = i["h0"], i["dfinal"], i["cu"]
        _, _, ref = gdn_reference_vjp(q, k, v, g, beta, do, dfin, cu_seqlens=cu, qk_l2norm=l2,
                                      initial_state=h0)
        names = ("q", "k", "v", "g", "beta", "initial_state")
        got = {{}}
        for mode, det in (("light", True), ("full", True), ("light", False), ("full", False)):
            def loss(q, k, v, g, beta, h0):
                o, fin = gdn(q, k, v, g, beta, cu_seqlens=cu, qk_l2norm=l2, initial_state=h0,
                             output_final_state=True, save_mode=mode, backend="cuda",
                             deterministic=det)
                return (jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
                        + jnp.sum(fin * dfin))
            f = jax.jit(jax.grad(loss, argnums=tuple(range(6))))
            text = f.lower(q, k, v, g, beta, h0).as_text()
            assert "jax_cake_gdn_walk_chunk_bwd" in text
            grads = f(q, k, v, g, beta, h0)
            errs = {{n: rel(np.asarray(d, np.float32), ref[n]) for n, d in zip(names, grads)}}
            print(f"[grad K={{K}} l2={{l2}} {{mode}} deterministic={{det}}] rel RMS vs f64: " +
                  ", ".join(f"{{a}}={{b:.1e}}" for a, b in errs.items()))
            for n, d in zip(names, grads):
                assert np.isfinite(np.asarray(d, np.float32)).all(), (mode, n)
            for n, e in errs.items():
                assert e <= TOL, (K, l2, mode, n, e)
            got[mode, det] = grads
        for n, a, b in zip(names, got["light", True], got["full", True]):
            e = rel(np.asarray(a, np.float32), np.asarray(b, np.float32))
            print(f"  light vs full {{n}}: {{e:.1e}}")
            assert np.array_equal(np.asarray(a), np.asarray(b)), ("light != full", n, e)
        # deterministic=False changes only the order of dq's and dk's group sums
        for mode in ("light", "full"):
            for n, a, b in zip(names, got[mode, False], got[mode, True]):
                a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
                if n in ("q", "k"):
                    print(f"  {{mode}} atomic vs fixed-order group sum d{{n}}: {{rel(a, b):.1e}}")
                    assert rel(a, b) <= 2e-3, (mode, n, rel(a, b))
                else:
                    assert np.array_equal(a, b), (mode, n)
    print("OK")
""")


def test_gpu_gradients_with_cuda_walk_bwd():
    """gdn(backend="cuda") gradients (walk_bwd and chunk_bwd kernels) against the f64 reference;
    light and full bitwise equal."""
    need_gpu()
    r = run_python(_GRAD_CHECK.format(here=os.path.abspath(__file__)))
    print(r.stdout[-3000:])


@pytest.mark.parametrize("save_mode", ["light", "full"])
def test_gpu_deterministic_gradients_bitwise_over_runs(save_mode):
    """deterministic=True: 10 runs of the jitted gradient are bitwise equal, also when the memory
    they reuse was first filled with NaN (outputs are freed between runs, so buffers recur)."""
    need_gpu()
    inp = make_walk_inputs(31, H=16, HV=48, doc_lens=(1, 3000, 65, 0, 2000, 1111))
    args = [inp[n][None] for n in ("q", "k", "v", "g", "beta")] + [inp["h0"], inp["cu"]]
    f = jax.jit(_grad_fn("cuda", save_mode, deterministic=True))
    first = [np.asarray(x) for x in f(*args)]
    nbytes = sum(x.nbytes for x in first)
    for run in range(10):
        if run % 2:
            junk = jnp.full((nbytes // 4 * 3,), jnp.nan, jnp.float32).block_until_ready()
            del junk
        out = f(*args)
        for name, a, b in zip(("q", "k", "v", "g", "beta", "h0"), out, first):
            np.testing.assert_array_equal(np.asarray(a), b, err_msg=f"run {run}: d{name}")
        del out
    assert all(np.isfinite(x.astype(np.float32)).all() for x in first)
