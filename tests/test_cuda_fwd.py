"""The cuda forward kernels: l2norm_rstd, prep, solve_a, state_walk, replay, walk_output
(cuda/*.cu).

CPU host: `gdn(..., backend="cuda")` lowers for the cuda platform to the forward custom calls with
no while loop of its own (solve_a and the fused walk_output, never prep or state_walk; full mode
under differentiation: walk_output_tapes, whose h tape is bf16); unsupported head dims raise
ValueError naming K or V (backend="cuda") or fall back to xla (backend=None); wrappers reject
bad inputs by name, and sizes past the kernels' int32 limits.
GPU host: each cuda primitive against its xla twin on the same inputs (prep's A within 2e-3; the
cuda state walk's h tape is bf16 and is compared after casting), the replay kernel (w, u made
from A on chip, the light backward's) bitwise equal to state_walk on prep's w, u (w too: prep's
w, u are what the replay makes), the walks' values independent of their CTA order (seg_order),
solve_a's A bitwise equal to prep's, the fused walk_output (w, u made from A on chip) against
the separate cuda state_walk on prep's w, u (the final state bitwise equal), and
`gdn(backend="cuda")` against the float64 reference (relative RMS <= 1e-2), on uneven
documents (1, 63, 64, 65, 1000 tokens, empty documents, unused chunk capacity; and 1, 12288, 65,
1000), GVA (16, 48) and (2, 6), L2 norm on and off, initial state on
and off, bf16 and f32 inputs, K = V = 128 and 64; the same under JAX_CAKE_GDN_POISON=1
(subprocess) with every output finite; NaN in one document's q, k, v reaches no other document.
"""

from __future__ import annotations

import contextlib
import os
import re
import textwrap
import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import need_ext, need_gpu, run_python

from jax_cake_gdn import gdn, primitives
from jax_cake_gdn.chunks import ChunkTable, chunk_table
from jax_cake_gdn.primitives import cuda

# the forward's custom calls by save mode (light: the plain call; full: a VJP's forward): A and
# the fused walk + output in one call (solve_a_walk_output); light keeps none of w, u, h, v_new,
# full stores w, h, v_new from the walk
FWD_TARGETS = {"light": ("gate_cumsum", "l2norm_rstd", "solve_a_walk_output"),
               "full": ("gate_cumsum", "l2norm_rstd", "solve_a_walk_output_tapes")}
FWD_UNWANTED = {"light": {"prep", "replay", "state_walk", "solve_a", "walk_output",
                          "walk_output_tapes", "solve_a_walk_output_tapes"},
                "full": {"prep", "replay", "state_walk", "solve_a", "walk_output",
                         "walk_output_tapes", "solve_a_walk_output"}}
# documents: a length-1 one, an empty one, 63, 64, 65, another empty one, 1000 (T = 1193)
DOC_LENS = (1, 0, 63, 64, 65, 0, 1000)
# a long document (192 chunks, as B23's longest) between short ones and an empty one (T = 13354)
LONG_DOC_LENS = (1, 12288, 0, 65, 1000)
TOL = 1e-2  # relative RMS, bf16 tensor-core products (docs/design.md section 4)
# prep's A (bf16) vs xla's f32 A: the bf16 rounding (~1.1e-3) on top of the inverse's own error
# (bf16 k in K K^T, the inverse near f32 through split bf16 mma: 1.7-2.7e-4 before A went bf16)
A_TOL = 2e-3


def rel(x, ref) -> float:
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def make_inputs(seed, doc_lens=DOC_LENS, H=2, HV=6, K=128, V=128, dtype=jnp.bfloat16,
                qk_l2norm=True, initial_state=True):
    """Fresh random gdn inputs ([1, T, ...]) and cu_seqlens; q/k/v rounded to `dtype`.

    Without the L2 norm, q and k are scaled by 1/sqrt(K) so the recurrence stays bounded.
    """
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(doc_lens)]).astype(np.int32)
    T, N = int(cu[-1]), len(doc_lens)
    s = 1.0 if qk_l2norm else K**-0.5
    q = (rng.standard_normal((1, T, H, K)) * s).astype(np.float32)
    k = (rng.standard_normal((1, T, H, K)) * s).astype(np.float32)
    v = rng.standard_normal((1, T, HV, V)).astype(np.float32)
    g = -rng.uniform(0.01, 0.3, (1, T, HV)).astype(np.float32)
    beta = rng.uniform(0.1, 0.95, (1, T, HV)).astype(np.float32)
    h0 = (0.3 * rng.standard_normal((N, HV, K, V))).astype(np.float32) if initial_state else None
    cast = lambda x: jnp.asarray(x, dtype)
    return dict(q=cast(q), k=cast(k), v=cast(v), g=jnp.asarray(g), beta=jnp.asarray(beta),
                cu_seqlens=jnp.asarray(cu), initial_state=None if h0 is None else jnp.asarray(h0))


def primitive_pairs(inp, qk_l2norm, scale=None):
    """Every forward primitive through both backends on the same inputs (each cuda kernel gets
    the xla results of the stages before it). Returns {name: (cuda, xla)}."""
    q, k, v = inp["q"][0], inp["k"][0], inp["v"][0]
    g, beta, cu = inp["g"][0], inp["beta"][0], inp["cu_seqlens"]
    T, H, K = q.shape
    HV, V = v.shape[1:]
    N = cu.shape[0] - 1
    h0 = inp["initial_state"]
    if h0 is None:
        h0 = jnp.zeros((N, HV, K, V), jnp.float32)
    scale = K**-0.5 if scale is None else scale
    C = primitives._cuda_primitives()
    X = primitives.XLA

    @jax.jit
    def run(q, k, v, g, beta, cu, h0):
        ct = chunk_table(cu, T)
        out = {}
        rq = X.l2norm_rstd(q) if qk_l2norm else None
        rk = X.l2norm_rstd(k) if qk_l2norm else None
        if qk_l2norm:
            out["rstd_q"] = (C.l2norm_rstd(q), rq)
        G = X.gate_cumsum(g, ct)
        A, w, u = X.prep(k, v, beta, G, rk, ct)
        Ac, wc, uc = C.prep(k, v, beta, G, rk, ct)
        out["A"], out["w"], out["u"] = (Ac, A), (wc, w), (uc, u)
        # the cuda kernels take w, u, h and v_new in bf16 (as the cuda kernels return them)
        wb, ub = w.astype(jnp.bfloat16), u.astype(jnp.bfloat16)
        h, vn, fin = X.state_walk(k, w, u, G, h0, rk, ct)
        hc, vnc, finc = C.state_walk(k, wb, ub, G, h0, rk, ct)
        out["h"], out["v_new"], out["final"] = (hc, h), (vnc, vn), (finc, fin)
        # solve_a: prep's A alone (key "A~solve_a": bitwise equal expected)
        out["A~solve_a"] = (C.solve_a(k, beta, G, rk, ct), Ac)
        # the fused walk + output from A: vs xla (on xla's A, rounded as the kernel takes it),
        # and on prep's A vs the separate cuda state walk on prep's w, u (keys "...~sep")
        ow, finw = X.walk_output(q, k, v, beta, A, G, h0, rq, rk, ct, scale=scale,
                                 out_dtype=v.dtype)
        Ab = A.astype(jnp.bfloat16)
        owc, finwc = C.walk_output(q, k, v, beta, Ab, G, h0, rq, rk, ct, scale=scale,
                                   out_dtype=v.dtype)
        owc32, _ = C.walk_output(q, k, v, beta, Ab, G, h0, rq, rk, ct, scale=scale,
                                 out_dtype=jnp.float32)
        out["walk_output.o"], out["walk_output.final"] = (owc, ow), (finwc, finw)
        # the segments' CTAs started in the opposite order: the same values, bit for bit
        ctr = ct._replace(seg_order=ct.seg_order[::-1])
        out["final~rev"] = (C.state_walk(k, wb, ub, G, h0, rk, ctr)[2], finc)
        out["walk_output.o~rev"] = (C.walk_output(q, k, v, beta, Ab, G, h0, rq, rk, ctr,
                                                  scale=scale, out_dtype=v.dtype)[0], owc)
        out["walk_output.o_f32"] = (owc32, ow)
        hp, vnp, finp = C.state_walk(k, wc, uc, G, h0, rk, ct)
        # the replay (w, u made on chip from prep's A) vs the state walk on prep's w, u: keys
        # "replay...~sep", bitwise equal expected (light == full in the backward depends on it)
        wr, ur, hr, vnr = C.replay(k, v, beta, G, Ac, h0, rk, ct)
        assert ur is None
        out["replay.w~sep"], out["replay.h~sep"] = (wr, wc), (hr, hp)
        out["replay.v_new~sep"] = (vnr, vnp)
        owp, finwp = C.walk_output(q, k, v, beta, Ac, G, h0, rq, rk, ct, scale=scale,
                                   out_dtype=v.dtype)
        out["walk_output.final~sep"] = (finwp, finp)
        # the full forward's walk: the replay's tapes and walk_output's o and exit states (keys
        # "walk_output_tapes...": bitwise equal expected; light == full in the backward)
        owt, finwt, wt, ut, ht, vnt = C.walk_output(q, k, v, beta, Ac, G, h0, rq, rk, ct,
                                                    scale=scale, out_dtype=v.dtype, tapes=True)
        assert ut is None
        out["walk_output_tapes.h"], out["walk_output_tapes.v_new"] = (ht, hr), (vnt, vnr)
        out["walk_output_tapes.w"], out["walk_output_tapes.final"] = (wt, wr), (finwt, finwp)
        out["walk_output_tapes.o"] = (owt, owp)
        # solve_a and the walk in one call (with few walk CTAs: solve_a on the other SMs, A handed
        # over by flags): each result bit for bit the two calls' (keys "fused...")
        Af, of, finf = C.solve_a_walk_output(q, k, v, beta, G, h0, rq, rk, ct, scale=scale,
                                             out_dtype=v.dtype)
        out["fused.A"], out["fused.o"], out["fused.final"] = (Af, Ac), (of, owp), (finf, finwp)
        Aft, oft, finft, wft, uft, hft, vnft = C.solve_a_walk_output(
            q, k, v, beta, G, h0, rq, rk, ct, scale=scale, out_dtype=v.dtype, tapes=True)
        assert uft is None
        out["fused_tapes.A"], out["fused_tapes.o"] = (Aft, Ac), (oft, owt)
        out["fused_tapes.final"], out["fused_tapes.w"] = (finft, finwt), (wft, wt)
        out["fused_tapes.h"], out["fused_tapes.v_new"] = (hft, ht), (vnft, vnt)
        return out

    return run(q, k, v, g, beta, cu, h0)


def gdn_cuda(inp, qk_l2norm, save_mode="light"):
    f = jax.jit(lambda q, k, v, g, beta, cu, h0: gdn(
        q, k, v, g, beta, cu_seqlens=cu, qk_l2norm=qk_l2norm, initial_state=h0,
        output_final_state=True, save_mode=save_mode, backend="cuda"))
    return f(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["cu_seqlens"],
             inp["initial_state"])


# ------------------------------------------------------------------------------------------------
# CPU host
# ------------------------------------------------------------------------------------------------


def _lower_cuda(f, *args) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _abstract_inputs(T=300, H=2, HV=6, K=128, V=128, N=5):
    sds = jax.ShapeDtypeStruct
    return (sds((1, T, H, K), jnp.bfloat16), sds((1, T, H, K), jnp.bfloat16),
            sds((1, T, HV, V), jnp.bfloat16), sds((1, T, HV), jnp.float32),
            sds((1, T, HV), jnp.float32), sds((N + 1,), jnp.int32),
            sds((N, HV, K, V), jnp.float32))


def _fwd(backend, qk_l2norm=True, save_mode="light"):
    return lambda q, k, v, g, b, cu, h0: gdn(q, k, v, g, b, cu_seqlens=cu, qk_l2norm=qk_l2norm,
                                             initial_state=h0, output_final_state=True,
                                             save_mode=save_mode, backend=backend)


def _targets(hlo) -> set:
    return set(re.findall(r"custom_call @jax_cake_gdn_(\w+)", hlo))


@pytest.mark.parametrize("save_mode", ["light", "full"])
@pytest.mark.parametrize("qk_l2norm", [True, False])
def test_lower_gdn_forward_for_cuda(qk_l2norm, save_mode):
    """Every forward primitive is a custom call, and the forward has no while loop: the state walk
    is a kernel, not a scan. Both modes make A and run the fused walk in one call; light's
    (solve_a_walk_output) keeps no h tape or v_new, full's (solve_a_walk_output_tapes) also
    returns h, v_new and w."""
    need_ext()
    args = _abstract_inputs()
    f = _fwd("cuda", qk_l2norm, save_mode)
    if save_mode == "full":  # the forward of a VJP (its residuals out); a plain call runs light's
        f = (lambda f: lambda *a: jax.vjp(f, *a))(f)
    hlo = _lower_cuda(f, *args)
    targets = _targets(hlo)
    want = set(FWD_TARGETS[save_mode]) - (set() if qk_l2norm else {"l2norm_rstd"})
    assert want <= targets, (want, targets)
    assert not targets & FWD_UNWANTED[save_mode], targets
    assert "stablehlo.while" not in hlo
    # A bf16 and the hand-off flags out, then o and the exit states; full: the walk's tapes in
    # bf16
    walk = FWD_TARGETS[save_mode][-1]
    wo = [ln for ln in hlo.splitlines() if f"custom_call @jax_cake_gdn_{walk}(" in ln]
    assert len(wo) == 1, wo
    head = (r"-> \(tensor<(\d+)x6x64x64xbf16>, tensor<(\d+)xi32>, tensor<300x6x128xbf16>, "
            r"tensor<5x6x128x128xf32>")
    m = re.search(head + (r", tensor<\d+x6x128x128xbf16>, tensor<300x6x128xbf16>, "
                          r"tensor<300x6x128xbf16>\)" if save_mode == "full" else r"\)"), wo[0])
    assert m and int(m.group(2)) == 1 + int(m.group(1)) * 6, wo[0]
    if save_mode == "full":  # without differentiation full writes no tapes: light's calls
        plain = _targets(_lower_cuda(_fwd("cuda", qk_l2norm, save_mode), *args))
        assert want - {walk} | {FWD_TARGETS["light"][-1]} <= plain, plain
        assert not plain & FWD_UNWANTED["light"], plain
    xla_hlo = _lower_cuda(_fwd("xla", qk_l2norm, save_mode), *args)
    assert "stablehlo.while" in xla_hlo  # the xla walk is a scan: the check can fail


def test_lower_bounds_check_in_place_for_cuda():
    """Traced cu_seqlens are checked on the device: o and the final state go through the in-place
    nan_unless kernel (its result aliases its input), not a select over [T, HV, V]; in the
    backward the same
    kernel poisons the gradients in place (one call per input gradient), not dO."""
    need_ext()
    args = _abstract_inputs()

    def loss(q, k, v, g, b, cu, h0):
        o, fin = _fwd("cuda")(q, k, v, g, b, cu, h0)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(fin)

    select_o = r"stablehlo.select .*tensor<(1x)?300x6x128xbf16>"
    for f, grad in ((_fwd("cuda"), False), (jax.value_and_grad(loss, argnums=(0, 1, 2)), True)):
        hlo = _lower_cuda(f, *args)
        calls = [ln for ln in hlo.splitlines() if "custom_call @jax_cake_gdn_nan_unless" in ln]
        # forward: o and the final state; backward: dq, dk, dv at least (XLA drops the unused
        # ones later)
        assert len(calls) == 2 if not grad else len(calls) >= 5, calls
        assert all("output_operand_aliases" in c for c in calls), calls
        assert not re.search(select_o, hlo)
    xla_hlo = _lower_cuda(_fwd("xla"), *args)  # the xla set's where: the check can fail
    assert re.search(select_o, xla_hlo)


def test_lower_light_gradient_for_cuda():
    """The light VJP: solve_a and walk_output in the forward, the state walk replayed in the
    backward (it needs h) by the replay kernel, which makes w, u itself (no wy pass), and neither
    prep nor a separate state walk anywhere."""
    need_ext()
    args = _abstract_inputs()

    def loss(q, k, v, g, b, cu, h0):
        o, fin = _fwd("cuda")(q, k, v, g, b, cu, h0)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(fin)

    # value_and_grad: with grad alone the forward's o is dead code (d sum(o) / do is 1)
    vg = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 6))
    targets = _targets(_lower_cuda(vg, *args))
    assert {"solve_a", "walk_output", "replay", "walk_chunk_bwd"} <= targets, targets
    assert not targets & {"prep", "state_walk"}, targets


def test_lower_walk_column_tiles_attribute():
    """walk_column_tiles(n) reaches the forward walk's and the light replay's custom calls as their
    column_tiles attribute (0, the kernel's choice, by default); n outside 0..2, and 2 at V = 64,
    are ValueErrors."""
    need_ext()

    def grad_fn():  # a fresh function each time: jit keeps what a function was traced with
        def loss(q, k, v, g, b, cu, h0):
            o, fin = _fwd("cuda")(q, k, v, g, b, cu, h0)
            return jnp.sum(o.astype(jnp.float32)) + jnp.sum(fin)

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 6))

    walk = re.compile(r"custom_call @jax_cake_gdn_(solve_a_walk_output|walk_output|replay)\(")
    for n in (None, 0, 1, 2):
        ctx = contextlib.nullcontext() if n is None else cuda.walk_column_tiles(n)
        with ctx:  # the plain forward, then light's VJP (solve_a apart, the replay)
            hlo = _lower_cuda(_fwd("cuda"), *_abstract_inputs())
            hlo += _lower_cuda(grad_fn(), *_abstract_inputs())
        calls = [ln for ln in hlo.splitlines() if walk.search(ln)]
        names = {walk.search(ln).group(1) for ln in calls}
        assert names == {"solve_a_walk_output", "walk_output", "replay"}, names
        assert all(f"column_tiles = {n or 0} : i32" in ln for ln in calls), (n, calls)
    for bad in (3, -1, True, 1.0):
        with pytest.raises(ValueError, match="n must be 0, 1 or 2"):
            with cuda.walk_column_tiles(bad):
                pass
    with cuda.walk_column_tiles(2), pytest.raises(ValueError, match="need V = 128"):
        _lower_cuda(_fwd("cuda"), *_abstract_inputs(K=64, V=64))
    with cuda.walk_column_tiles(1):  # one tile at V = 64 is the only kind there
        assert "column_tiles = 1 : i32" in _lower_cuda(_fwd("cuda"), *_abstract_inputs(V=64))


def test_supports_and_resolve(monkeypatch):
    assert cuda.supports(128, 128) and cuda.supports(64, 128) and cuda.supports(64, 64)
    assert not cuda.supports(96, 128) and not cuda.supports(128, 256)
    need_ext()
    with pytest.raises(ValueError, match="K = 96"):
        primitives.resolve("cuda", K=96, V=128)
    with pytest.raises(ValueError, match="V = 32"):
        primitives.resolve("cuda", K=128, V=32)
    assert primitives.resolve("cuda", K=128, V=64).name == "cuda"
    monkeypatch.setattr(primitives, "cuda_ready", lambda: True)  # pretend a GPU is there
    assert primitives.resolve(None, K=128, V=128).name == "cuda"
    monkeypatch.setattr(primitives, "_warned_dims", set())
    for K, V in ((96, 128), (128, 48)):
        with pytest.warns(UserWarning, match=f"K = {K}, V = {V} are not supported"):
            assert primitives.resolve(None, K=K, V=V) is primitives.XLA


def test_unsupported_dims_raise_or_fall_back(monkeypatch):
    need_ext()
    args = _abstract_inputs(K=96)
    with pytest.raises(ValueError, match="K = 96"):
        _lower_cuda(_fwd("cuda"), *args)
    args_v = _abstract_inputs(V=80)
    with pytest.raises(ValueError, match="V = 80"):
        _lower_cuda(_fwd("cuda"), *args_v)
    # backend=None with a GPU but unsupported dims: the xla primitives (gate_cumsum has no head
    # dim and stays a kernel)
    monkeypatch.setattr(primitives, "cuda_ready", lambda: True)
    monkeypatch.setattr(primitives, "_warned_dims", set())
    with pytest.warns(UserWarning, match=r"K = 96, V = 128 are not supported.*xla backend"):
        hlo = _lower_cuda(_fwd(None), *args)
    with warnings.catch_warnings():  # once per (K, V)
        warnings.simplefilter("error")
        _lower_cuda(_fwd(None), *args)
    targets = _targets(hlo)
    assert not targets & {"prep", "solve_a", "state_walk", "walk_output"}, targets
    hlo = _lower_cuda(_fwd(None), *_abstract_inputs(K=64, V=64))
    assert set(FWD_TARGETS["light"]) <= _targets(hlo)


def _ct(start, length, seg_first=None, seg_last=None, seg_len=None, seg_order=None):
    """A chunk table of the given arrays (the cuda wrappers read only these fields)."""
    return ChunkTable(start, length, None, None, None, seg_first, seg_last, seg_len, seg_order,
                      None, None)


def test_bad_inputs_raise_value_error():
    T, H, HV, K, V, NC = 100, 2, 6, 128, 128, 4
    bf, f32 = jnp.bfloat16, jnp.float32
    k = jnp.zeros((T, H, K), bf)
    v = jnp.zeros((T, HV, V), bf)
    f = jnp.zeros((T, HV), f32)
    cs = jnp.zeros((NC,), jnp.int32)
    s = jnp.zeros((3,), jnp.int32)
    ct = _ct(cs, cs, s, s, s, s)
    w, u = jnp.zeros((T, HV, K), bf), v
    h0 = jnp.zeros((3, HV, K, V))
    A = jnp.zeros((NC, HV, 64, 64), bf)
    prep = lambda k=k, v=v, b=f, G=f, r=None, ct=ct: cuda.prep(k, v, b, G, r, ct)
    walk = lambda w=w, u=u, h0=h0, ct=ct: cuda.state_walk(k, w, u, f, h0, None, ct)
    solve_a = lambda k=k, b=f, G=f: cuda.solve_a(k, b, G, None, ct)
    replay = lambda v=v, A=A, h0=h0, ct=ct: cuda.replay(k, v, f, f, A, h0, None, ct)
    walk_output = lambda q=k, kk=k, v=v, A=A, h0=h0, rq=None, dt=bf: cuda.walk_output(
        q, kk, v, f, A, f, h0, rq, None, ct, scale=1.0, out_dtype=dt)
    fused = lambda q=k, kk=k, v=v, b=f, h0=h0, dt=bf: cuda.solve_a_walk_output(
        q, kk, v, b, f, h0, None, None, ct, scale=1.0, out_dtype=dt)
    short_order = ct._replace(seg_order=s[:2])
    cases = [
        (lambda: prep(k=k.astype(jnp.float16)), "bfloat16 or float32"),
        (lambda: prep(k=jnp.zeros((T, H, 32), bf)), "K = 32"),
        (lambda: prep(k=jnp.zeros((T, 4, K), bf)), "multiple of H"),
        (lambda: prep(b=f[:, :3]), "beta"),
        (lambda: prep(G=f[:, :3]), "G must"),
        (lambda: prep(r=jnp.zeros((T, H + 1), f32)), "rstd_k"),
        (lambda: prep(ct=_ct(cs, cs[:2])), "chunk_len"),
        (lambda: prep(v=v.astype(f32)), "v must have k's dtype"),
        (lambda: prep(v=jnp.zeros((T, HV, 96), bf)), "V = 96"),
        (lambda: walk(h0=h0[:2]), "h0"),
        (lambda: walk(u=u.astype(f32)), "u must be bfloat16 (as the cuda prep"),
        (lambda: walk(w=w.astype(f32)), "w must be bfloat16 (as the cuda prep"),
        (lambda: walk(ct=short_order), "seg_order must have 3 entries"),
        (lambda: solve_a(b=f[:50]), "beta must be float32 [T, HV]"),
        (lambda: solve_a(b=f[:, :5], G=f[:, :5]), "multiple of H"),
        (lambda: solve_a(G=f[:, :3]), "G must"),
        (lambda: solve_a(k=jnp.zeros((T, H, 32), bf)), "K = 32"),
        (lambda: replay(v=v.astype(f32)), "v must have k's dtype"),
        (lambda: replay(A=A.astype(f32)), "A must be bfloat16 (as the cuda prep / solve_a"),
        (lambda: replay(h0=h0[:2]), "h0 must have shape"),
        (lambda: replay(ct=short_order), "seg_order must have 3 entries"),
        (lambda: walk_output(dt=jnp.float16), "out_dtype"),
        (lambda: walk_output(kk=k.astype(f32)), "k must have q's dtype"),
        (lambda: walk_output(v=v.astype(f32)), "v must have k's dtype"),
        (lambda: walk_output(A=A.astype(f32)), "A must be bfloat16"),
        (lambda: walk_output(A=A[:2]), "A must have shape"),
        (lambda: walk_output(h0=h0[:2]), "h0"),
        (lambda: walk_output(rq=jnp.zeros((T, H + 1), f32)), "rstd_q"),
        (lambda: fused(dt=jnp.float16), "solve_a_walk_output: out_dtype"),
        (lambda: fused(kk=k.astype(f32)), "solve_a_walk_output: k must have q's dtype"),
        (lambda: fused(v=v.astype(f32)), "solve_a_walk_output: v must have k's dtype"),
        (lambda: fused(b=f[:, :5]), "solve_a_walk_output: beta must have shape (100, 6)"),
        (lambda: fused(h0=h0[:2]), "solve_a_walk_output: h0 must have shape"),
    ]
    for call, msg in cases:
        with pytest.raises(ValueError, match=re.escape(msg)):
            call()


def test_wrappers_check_the_limits_the_handlers_rely_on():
    """The handlers trust their arguments (cuda/handler.cuh): the wrappers check, at trace time,
    the positive head counts and the int32 sizes the kernels index with, as well as shapes."""
    sds = jax.ShapeDtypeStruct
    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    one = jnp.zeros((1,), i32)
    ct1 = _ct(one, one, one, one, one, one)

    def raises(msg, f, *args):
        with pytest.raises(ValueError, match=re.escape(msg)):
            jax.eval_shape(f, *args)

    raises("solve_a: HV = 65536 must be below 65536",
           lambda k, b: cuda.solve_a(k, b, b, None, ct1),
           sds((64, 1, 64), bf), sds((64, 65536), f32))
    raises("l2norm_bwd: H = 0 and HV = 6 must be positive",
           lambda dy, x: cuda.l2norm_bwd(dy, x, None), sds((8, 6, 64), f32), sds((8, 0, 64), bf))
    raises("l2norm_rstd: K must be positive", cuda.l2norm_rstd, sds((8, 2, 0), bf))
    raises("gate_cumsum: HV = 1048577 must be at most 2^20",
           lambda g: cuda.gate_cumsum(g, ct1), sds((1, 2**20 + 1), f32))
    raises("gate_cumsum: NC = 2147483648 must be below 2^31",
           lambda cs: cuda.gate_cumsum(jnp.zeros((1, 1)), _ct(cs, cs)), sds((2**31,), i32))
    raises("conv_fwd: C = 2097121 must be at most 65535 * 32",
           lambda x: cuda.conv_fwd(x, jnp.zeros((x.shape[1], 4)), jnp.zeros((1,), i32)),
           sds((1, 65535 * 32 + 1), bf))
    T, H, HV, K = 64, 1, 2, 64
    k, v, th = sds((T, H, K), bf), sds((T, HV, K), bf), sds((T, HV), f32)
    A, h0, none = sds((1, HV, 64, 64), bf), sds((1, HV, K, K), f32), jnp.zeros((0,), i32)
    raises("replay: seg_len must have at least one entry",
           lambda k, v, b, A: cuda.replay(k, v, b, b, A, jnp.zeros((0, HV, K, K)), None,
                                          _ct(one, one, none, none, none, none)), k, v, th, A)
    raises("transfer: b_seg must have at least one entry",
           lambda k, v, b, A, h0: cuda.transfer(k, v, b, b, A, h0, None, ct1, none, none),
           k, v, th, A, h0)
    raises("transfer_bwd: unit_seg must have at least one entry",
           lambda q, w, b, do, df: cuda.transfer_bwd(q, q, w, b, do, df, None, None, ct1, none,
                                                     scale=1.0),
           k, sds((T, HV, K), bf), th, v, h0)
    raises("walk_bwd: S * HV * V / 64 = 2147483648 must be below 2^31",
           lambda q, w, b, do, df, s: cuda.walk_bwd(q, q, w, b, do, df, None, None, None,
                                                    _ct(one, one, s, s, s, s), scale=1.0),
           k, sds((T, HV, K), bf), th, v, sds((2**30, HV, K, K), f32), sds((2**30,), i32))


# ------------------------------------------------------------------------------------------------
# GPU host
# ------------------------------------------------------------------------------------------------

# (name, H, HV, K, V, dtype, qk_l2norm, initial_state, document lengths). DOC_LENS has 7
# segments, LONG_DOC_LENS 5: at HV = 48 the forward walk runs one CTA a head, at HV = 6 with
# V = 128 (42 and 30 chains, at most 3/8 of 132 SMs) two CTAs of 64 columns a head
# (walk_column_tiles), and test_gpu_primitives_match_xla holds both bit for bit to the state walk,
# which never splits.
CONFIGS = [
    ("gva16x48-bf16-l2-h0", 16, 48, 128, 128, jnp.bfloat16, True, True, DOC_LENS),
    ("gva16x48-bf16-l2-h0-long", 16, 48, 128, 128, jnp.bfloat16, True, True, LONG_DOC_LENS),
    ("gva2x6-bf16-nol2", 2, 6, 128, 128, jnp.bfloat16, False, False, DOC_LENS),
    # 30 walk CTAs: solve_a_walk_output hands A over chunk by chunk along a 192-chunk document
    ("gva2x6-bf16-l2-h0-long", 2, 6, 128, 128, jnp.bfloat16, True, True, LONG_DOC_LENS),
    ("gva2x6-f32-l2-h0", 2, 6, 128, 128, jnp.float32, True, True, DOC_LENS),
    ("gva2x6-f32-k64v64-nol2-long", 2, 6, 64, 64, jnp.float32, False, False, LONG_DOC_LENS),
    ("gva2x6-bf16-k64v64-l2-h0", 2, 6, 64, 64, jnp.bfloat16, True, True, DOC_LENS),
    ("gva1x4-bf16-k128v64-nol2-h0", 1, 4, 128, 64, jnp.bfloat16, False, True, DOC_LENS),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_gpu_primitives_match_xla(cfg):
    need_gpu()
    name, H, HV, K, V, dtype, l2, h0, docs = cfg
    inp = make_inputs(zlib.crc32(name.encode()), docs, H=H, HV=HV, K=K, V=V, dtype=dtype,
                      qk_l2norm=l2, initial_state=h0)
    pairs = primitive_pairs(inp, l2)
    for key in ("A", "h", "w", "v_new"):  # bf16 on cuda (rounded from f32), f32 on xla
        assert pairs[key][0].dtype == jnp.bfloat16 and pairs[key][1].dtype == jnp.float32, key
    errs = {}
    for key, (c, x) in pairs.items():
        c, x = np.asarray(c, np.float64), np.asarray(x, np.float64)
        assert c.shape == x.shape, (key, c.shape, x.shape)
        assert np.isfinite(c).all(), f"{key}: non-finite values"
        errs[key] = rel(c, x)
    print(f"\n[{name}] cuda vs xla primitive rel RMS: " +
          ", ".join(f"{k}={v:.1e}" for k, v in errs.items()))
    if "rstd_q" in errs:
        assert errs["rstd_q"] < 1e-5
    for key, e in errs.items():
        assert e <= TOL, (key, e)
    assert errs["A"] <= A_TOL, errs["A"]
    for key in ("A~solve_a", "final~rev", "walk_output.o~rev", "replay.w~sep",
                "replay.h~sep", "replay.v_new~sep", "walk_output_tapes.h",
                "walk_output_tapes.v_new", "walk_output_tapes.w", "walk_output_tapes.final",
                "walk_output_tapes.o") + tuple(k for k in pairs if k.startswith("fused")):
        assert np.array_equal(np.asarray(pairs[key][0]), np.asarray(pairs[key][1])), key
    # the fused walk + output from prep's A against the separate cuda state walk on prep's w, u:
    # the fused one makes w, u from A as prep does, so its walk (the final state) is theirs bit
    # for bit. (A and h above include the unused chunk slots: A = I, h = the last exit state, as
    # xla.)
    key = "walk_output.final~sep"
    assert np.array_equal(np.asarray(pairs[key][0]), np.asarray(pairs[key][1])), key


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_gpu_gdn_cuda_matches_reference(cfg):
    need_gpu()
    from jax_cake_gdn.reference import gdn_reference

    name, H, HV, K, V, dtype, l2, h0, docs = cfg
    inp = make_inputs(zlib.crc32(name.encode()) + 1, docs, H=H, HV=HV, K=K, V=V, dtype=dtype,
                      qk_l2norm=l2, initial_state=h0)
    o, fin = gdn_cuda(inp, l2)
    assert o.dtype == inp["v"].dtype and o.shape == inp["v"].shape
    ref_o, ref_f = gdn_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                 cu_seqlens=inp["cu_seqlens"], qk_l2norm=l2,
                                 initial_state=inp["initial_state"])
    eo, ef = rel(o, ref_o), rel(fin, ref_f)
    print(f"\n[{name}] gdn(cuda) vs f64 reference: o {eo:.2e}, final {ef:.2e}")
    assert np.isfinite(np.asarray(o, np.float32)).all() and np.isfinite(np.asarray(fin)).all()
    assert eo <= TOL and ef <= TOL, (eo, ef)
    # documents of one token and empty ones: the final state of an empty document is h0
    if inp["initial_state"] is not None:
        empty = docs.index(0)
        np.testing.assert_array_equal(np.asarray(fin)[empty],
                                      np.asarray(inp["initial_state"])[empty])


_POISON_CHECK = textwrap.dedent("""
    import os, sys
    import numpy as np, jax, jax.numpy as jnp
    sys.path.insert(0, os.path.dirname({here!r}))
    from test_cuda_fwd import make_inputs, primitive_pairs, gdn_cuda, CONFIGS
    assert os.environ["JAX_CAKE_GDN_POISON"] == "1"
    for name, H, HV, K, V, dtype, l2, h0, docs in CONFIGS:
        inp = make_inputs(7, docs, H=H, HV=HV, K=K, V=V, dtype=dtype, qk_l2norm=l2,
                          initial_state=h0)
        for key, (c, x) in primitive_pairs(inp, l2).items():
            assert np.isfinite(np.asarray(c, np.float32)).all(), (name, key)
        for mode in ("light", "full"):
            o, fin = gdn_cuda(inp, l2, save_mode=mode)
            assert np.isfinite(np.asarray(o, np.float32)).all(), (name, mode, "o")
            assert np.isfinite(np.asarray(fin)).all(), (name, mode, "final")
    # poison is live: an uncovered token of a hand-made table stays NaN
    from jax_cake_gdn.primitives import cuda
    T = 200
    k = jnp.ones((T, 1, 64), jnp.bfloat16)
    f = jnp.zeros((T, 2), jnp.float32)
    # tokens 64..127 and 192.. are in no chunk of the table (which has an unused slot too: A = I
    # there, no token rows); k.k = 1 and beta = 0.5 keep A bounded
    from test_cuda_fwd import _ct
    ct = _ct(jnp.asarray([0, 128, T], jnp.int32), jnp.asarray([64, 64, 0], jnp.int32))
    A, w, u = jax.jit(cuda.prep)(k * 0.125, jnp.ones((T, 2, 64), jnp.bfloat16), f + 0.5, f, None,
                                 ct)
    A, w, u = np.asarray(A), np.asarray(w), np.asarray(u)
    assert np.isfinite(A).all() and np.array_equal(A[2], np.broadcast_to(np.eye(64), (2, 64, 64)))
    for x in (w, u):
        assert np.isnan(x[64:128]).all() and np.isnan(x[192:]).all()
        assert np.isfinite(x[:64]).all() and np.isfinite(x[128:192]).all()
    print("OK")
""")


def test_gpu_nan_unless_in_place():
    """The cuda bounds check: x bit for bit when ok, every element NaN when not (16-byte words
    and the tail bytes), the caller's x untouched; and gdn with traced cu_seqlens: good bounds
    give the concrete-bounds o bit for bit, bad ones an all-NaN o and NaN gradients."""
    need_gpu()
    rng = np.random.default_rng(5)
    f = jax.jit(cuda.nan_unless)
    for shape, dt in (((3, 37), jnp.bfloat16), ((5, 7), jnp.float32),
                      ((1000, 6, 128), jnp.bfloat16)):
        x = jnp.asarray(rng.standard_normal(shape).astype(np.float32), dt)
        x_host = np.asarray(x, np.float32)
        assert np.array_equal(np.asarray(f(x, jnp.bool_(True)), np.float32), x_host)
        assert np.isnan(np.asarray(f(x, jnp.bool_(False)), np.float32)).all(), (shape, dt)
        assert np.array_equal(np.asarray(x, np.float32), x_host)

    inp = make_inputs(7, H=2, HV=6, dtype=jnp.bfloat16, qk_l2norm=True, initial_state=False)
    names = ("q", "k", "v", "g", "beta")
    cu = np.asarray(inp["cu_seqlens"])
    o_ref = gdn(*(inp[n] for n in names), cu_seqlens=cu, qk_l2norm=True, backend="cuda")
    fwd = jax.jit(lambda q, k, v, g, b, cu: gdn(q, k, v, g, b, cu_seqlens=cu, qk_l2norm=True,
                                                backend="cuda"))
    o = fwd(*(inp[n] for n in names), jnp.asarray(cu))
    assert np.array_equal(np.asarray(o, np.float32), np.asarray(o_ref, np.float32))
    bad = cu.copy()
    bad[-1] -= 1  # last != T
    assert np.isnan(np.asarray(fwd(*(inp[n] for n in names), jnp.asarray(bad)), np.float32)).all()

    def loss(q, v, cu):
        o = gdn(q, inp["k"], v, inp["g"], inp["beta"], cu_seqlens=cu, qk_l2norm=True,
                backend="cuda")
        return jnp.sum(o.astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    for d in grad(inp["q"], inp["v"], jnp.asarray(cu)):
        assert np.isfinite(np.asarray(d, np.float32)).all()
    for d in grad(inp["q"], inp["v"], jnp.asarray(bad)):
        assert np.isnan(np.asarray(d, np.float32)).any()


@pytest.mark.parametrize("save_mode", ["light", "full"])
def test_gpu_nan_in_one_document_stays_there(save_mode):
    """NaN in one document's q, k, v leaves every other document's o and final state bit for bit
    as without it, also where the document before it ends inside a chunk (the light walk's TMA
    loads read on past a chunk's end; those rows are zeroed, as cp.async zero-fills them)."""
    need_gpu()
    inp = make_inputs(11, DOC_LENS, H=2, HV=6, dtype=jnp.bfloat16, qk_l2norm=True)
    cu = np.asarray(inp["cu_seqlens"])
    bad = 3  # 64 tokens right after the 63-token document (its chunk ends one row early)
    lo, hi = int(cu[bad]), int(cu[bad + 1])
    o_ref, f_ref = gdn_cuda(inp, True, save_mode)
    dirty = dict(inp)
    for n in ("q", "k", "v"):
        dirty[n] = inp[n].at[:, lo:hi].set(jnp.nan)
    o, fin = gdn_cuda(dirty, True, save_mode)
    o, o_ref = np.asarray(o, np.float32), np.asarray(o_ref, np.float32)
    assert np.isnan(o[:, lo:hi]).all()  # the poisoned document itself
    keep = np.r_[0:lo, hi:o.shape[1]]
    assert np.isfinite(o[:, keep]).all()
    assert np.array_equal(o[:, keep], o_ref[:, keep])
    others = [d for d in range(len(DOC_LENS)) if d != bad]
    assert np.array_equal(np.asarray(fin)[others], np.asarray(f_ref)[others])


def test_gpu_forward_finite_under_poison():
    need_gpu()
    run_python(_POISON_CHECK.format(here=os.path.abspath(__file__)), poison=True, timeout=900)


def test_gpu_gradients_through_cuda_forward():
    """The backward (xla primitives today) accepts the cuda forward's residuals; gradients agree
    with the f64 reference."""
    need_gpu()
    from jax_cake_gdn.reference import gdn_reference_vjp

    inp = make_inputs(11, H=2, HV=6, dtype=jnp.bfloat16, qk_l2norm=True, initial_state=True)
    rng = np.random.default_rng(12)
    do = jnp.asarray(rng.standard_normal(inp["v"].shape).astype(np.float32), jnp.bfloat16)
    dfin = jnp.asarray(rng.standard_normal(inp["initial_state"].shape).astype(np.float32))
    _, _, ref = gdn_reference_vjp(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], do, dfin,
                                  cu_seqlens=inp["cu_seqlens"], qk_l2norm=True,
                                  initial_state=inp["initial_state"])
    names = ("q", "k", "v", "g", "beta", "initial_state")
    for mode in ("light", "full"):
        def loss(q, k, v, g, beta, h0):
            o, fin = gdn(q, k, v, g, beta, cu_seqlens=inp["cu_seqlens"], qk_l2norm=True,
                         initial_state=h0, output_final_state=True, save_mode=mode,
                         backend="cuda")
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)) + jnp.sum(fin * dfin)

        grads = jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*(inp[n] for n in names))
        errs = {n: rel(d, ref[n]) for n, d in zip(names, grads)}
        print(f"\n[grad {mode}] rel RMS vs f64 reference: " +
              ", ".join(f"{k}={v:.1e}" for k, v in errs.items()))
        for n, d in zip(names, grads):
            assert np.isfinite(np.asarray(d, np.float32)).all(), n
        for n, e in errs.items():
            assert e <= TOL, (mode, n, e)


@pytest.mark.parametrize("save_mode", ["light", "full"])
def test_gpu_walk_column_tiles_bitwise(save_mode):
    """The forward walk in one CTA a head and in two of 64 value columns (walk_column_tiles) gives
    o, the final states and every gradient bit for bit alike (deterministic=True; light's
    backward replays the walk in the same tiles), on a shape whose chains the kernel would split
    and on one it would not."""
    need_gpu()
    for name in ("gva2x6-bf16-l2-h0-long", "gva16x48-bf16-l2-h0", "gva2x6-f32-l2-h0"):
        _, H, HV, K, V, dtype, l2, h0, docs = next(c for c in CONFIGS if c[0] == name)
        inp = make_inputs(zlib.crc32(name.encode()) + 3, docs, H=H, HV=HV, K=K, V=V,
                          dtype=dtype, qk_l2norm=l2, initial_state=h0)
        args = [inp[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens", "initial_state")]
        do = jnp.asarray(np.random.default_rng(1).standard_normal(inp["v"].shape), dtype)
        got = []
        for n in (1, 2):
            def run(q, k, v, g, b, cu, s0):
                f = lambda *x: gdn(*x[:5], cu_seqlens=cu, qk_l2norm=l2, initial_state=x[5],
                                   output_final_state=True, save_mode=save_mode,
                                   deterministic=True, backend="cuda")
                (o, fin), pull = jax.vjp(f, q, k, v, g, b, s0)
                return o, fin, pull((do, jnp.ones_like(fin)))

            with cuda.walk_column_tiles(n):
                got.append(jax.tree.leaves(jax.device_get(jax.jit(run)(*args))))
        assert len(got[0]) == len(got[1]) == 8
        for i, (a, b) in enumerate(zip(*got)):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            assert np.isfinite(a).all(), (name, i)
            assert np.array_equal(a, b), (name, save_mode, i)
