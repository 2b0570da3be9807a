"""The cuda short conv: conv_fwd / conv_bwd (cuda/conv.cu) behind short_conv(backend="cuda").

CPU host: short_conv and its gradient lower for the cuda platform to the conv custom calls with no
jax.numpy conv left; backend=None picks the kernels when a GPU is ready; the context-parallel form
stays jax.numpy; the wrappers reject bad inputs by name.
GPU host: y, dx, dweight against the xla backend on uneven documents (1, 63, 64, 65, 1000
tokens), W 1..4, SiLU on and off, bf16 and f32, C a multiple of 8 (vector path) or not; a batch
without cu_seqlens; a long sequence (the maximum number of dweight partials); dweight bitwise equal
run to run; every output finite under JAX_CAKE_GDN_POISON=1 (subprocess).
"""

from __future__ import annotations

import functools
import os
import re
import textwrap
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_mesh, need_ext, need_gpu, rel_rms, run_python
from jax.sharding import PartitionSpec as P

import jax_cake_gdn as J
from jax_cake_gdn import primitives
from jax_cake_gdn.primitives import cuda

DOC_LENS = (1, 63, 64, 65, 1000)  # T = 1193
TOL = {jnp.bfloat16: 1e-2, jnp.float32: 1e-5}  # relative RMS against the xla backend


def _lower_cuda(f, *args) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _targets(hlo) -> set:
    return set(re.findall(r"custom_call @jax_cake_gdn_(\w+)", hlo))


def _conv(backend, activation="silu"):
    return lambda x, w, cu: J.short_conv(x, w, cu_seqlens=cu, activation=activation,
                                         backend=backend)


def _value_and_grad(backend, activation="silu"):
    def loss(x, w, cu):
        return jnp.sum(_conv(backend, activation)(x, w, cu).astype(jnp.float32) ** 2)

    return jax.value_and_grad(loss, argnums=(0, 1))


def _abstract(T=300, C=64, W=4, dtype=jnp.bfloat16, wdtype=jnp.float32, N=5):
    sds = jax.ShapeDtypeStruct
    return sds((1, T, C), dtype), sds((C, W), wdtype), sds((N + 1,), jnp.int32)


# ------------------------------------------------------------------------------------------------
# CPU host
# ------------------------------------------------------------------------------------------------

# the jax.numpy conv lowers to a pad (the shifted rows) and, with SiLU, an exponential
_JNP_CONV_OPS = ("stablehlo.pad", "stablehlo.exponential")


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lower_short_conv_for_cuda(dtype, activation):
    need_ext()
    args = _abstract(dtype=dtype)
    # (traced cu_seqlens: nan_unless guards y and the gradients against bad bounds)
    fwd = _lower_cuda(_conv("cuda", activation), *args)
    assert _targets(fwd) == {"conv_fwd", "nan_unless"}, _targets(fwd)
    grad = _lower_cuda(_value_and_grad("cuda", activation), *args)
    assert _targets(grad) == {"conv_fwd", "conv_bwd", "nan_unless"}, _targets(grad)
    for hlo in (fwd, grad):
        assert not any(op in hlo for op in _JNP_CONV_OPS)
    xla = _lower_cuda(_value_and_grad("xla", "silu"), *args)  # the check can fail
    assert not _targets(xla) and all(op in xla for op in _JNP_CONV_OPS)


def test_backend_choice(monkeypatch):
    """None: the kernels when a GPU is ready (the gdn rule); "xla": never. A batch without
    cu_seqlens takes the kernels too."""
    need_ext()
    args = _abstract()
    batch = (jax.ShapeDtypeStruct((3, 50, 16), jnp.float32),
             jax.ShapeDtypeStruct((16, 3), jnp.float32))
    f_batch = lambda x, w: J.short_conv(x, w, backend="cuda")
    assert _targets(_lower_cuda(f_batch, *batch)) == {"conv_fwd"}
    monkeypatch.setattr(primitives, "cuda_ready", lambda: False)
    assert not _targets(_lower_cuda(_conv(None), *args))
    monkeypatch.setattr(primitives, "cuda_ready", lambda: True)  # pretend a GPU is there
    assert _targets(_lower_cuda(_conv(None), *args)) == {"conv_fwd", "nan_unless"}
    assert not _targets(_lower_cuda(_conv("xla"), *args))


def test_context_parallel_conv_stays_jax_numpy():
    need_ext()
    mesh = cpu_mesh((2,), ("cp",))

    def local(x, w, cu):
        return J.short_conv(x, w, cu_seqlens=cu, axis_name="cp", backend="cuda")

    f = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "cp"), P(), P()),
                      out_specs=P(None, "cp"))
    put = lambda a, spec: jax.device_put(a, jax.NamedSharding(mesh, spec))
    args = (put(jnp.ones((1, 64, 8)), P(None, "cp")), put(jnp.ones((8, 4)), P()),
            put(jnp.asarray([0, 30, 64], jnp.int32), P()))
    jaxpr = str(jax.jit(f).trace(*args).jaxpr)
    assert "jax_cake_gdn" not in jaxpr and "ffi" not in jaxpr


def test_conv_partials():
    assert [cuda.conv_partials(T) for T in (0, 1, 64, 65, 1193, 10**7)] == [1, 1, 1, 2, 19, 128]


def test_conv_wrappers_reject_bad_inputs():
    T, C = 100, 16
    x = jnp.zeros((T, C), jnp.bfloat16)
    w = jnp.zeros((C, 4), jnp.float32)
    pos = jnp.zeros((T,), jnp.int32)
    cases = [
        (lambda: cuda.conv_fwd(x[None], w, pos), "x must be \\[T, C\\]"),
        (lambda: cuda.conv_fwd(x.astype(jnp.float16), w, pos), "x must be bfloat16 or float32"),
        (lambda: cuda.conv_fwd(x, w[:8], pos), "weight must be \\[C, W\\] with C = 16"),
        (lambda: cuda.conv_fwd(x, w[:, 0], pos), "weight must be \\[C, W\\]"),
        (lambda: cuda.conv_fwd(x, jnp.zeros((C, 5)), pos), "width W must be in 1..4"),
        (lambda: cuda.conv_fwd(x, jnp.zeros((C, 0)), pos), "width W must be in 1..4"),
        (lambda: cuda.conv_fwd(x, w.astype(jnp.float16), pos), "weight must be bfloat16"),
        (lambda: cuda.conv_fwd(x, w, pos[:-1]), "pos must have 100 entries"),
        (lambda: cuda.conv_fwd(x, w, pos[None]), "pos must be int32\\[n\\]"),
        (lambda: cuda.conv_fwd(x, w, pos.astype(jnp.float32)), "pos must be int32"),
        (lambda: cuda.conv_fwd(x, w, pos, activation="relu"), "activation must be 'silu' or None"),
        (lambda: cuda.conv_bwd(x, w, pos, x[:-1]), "dy must have x's shape"),
        (lambda: cuda.conv_bwd(x, jnp.zeros((C, 5)), pos, x), "width W must be in 1..4"),
    ]
    for fn, text in cases:
        with pytest.raises(ValueError, match=text):
            fn()


@pytest.mark.parametrize("activation", ["silu", None])
def test_custom_vjp_wiring(monkeypatch, activation):
    """short_conv(backend="cuda") with conv_fwd / conv_bwd swapped for jax.numpy twins runs on a
    CPU and gives the xla results bitwise: the custom_vjp passes the right residuals, cotangent
    and dtypes (bf16 x, f32 weight; a batch without cu_seqlens)."""
    need_ext()
    from jax_cake_gdn.conv import _conv_packed

    def fake_bwd(x, w, pos, dy, *, activation):
        _, pull = jax.vjp(lambda x, w: _conv_packed(x, w, pos, activation), x, w)
        return pull(dy.astype(x.dtype))

    monkeypatch.setattr(cuda, "conv_fwd", lambda x, w, pos, *, activation: _conv_packed(
        x, w, pos, activation))
    monkeypatch.setattr(cuda, "conv_bwd", fake_bwd)
    import jax_cake_gdn.conv as conv_mod  # (and compile for the CPU: the kernels are twins)
    monkeypatch.setattr(conv_mod, "cuda_only", lambda bounds: bounds)
    monkeypatch.setattr(cuda, "nan_unless", lambda x, ok: jnp.where(ok, x, jnp.nan))
    x, w, dy, cu = make_inputs(1, C=16, W=3)
    batch = lambda a: a[0, :1191].reshape(3, 397, 16)
    for args in ((x, w, dy, cu), (batch(x), w, batch(dy), None)):
        got = conv_vjp("cuda", activation, *args)
        ref = conv_vjp("xla", activation, *args)
        for a, b in zip(got, ref):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# ------------------------------------------------------------------------------------------------
# GPU host
# ------------------------------------------------------------------------------------------------


def make_inputs(seed, doc_lens=DOC_LENS, C=256, W=4, dtype=jnp.bfloat16, wdtype=jnp.float32):
    """Fresh random x [1, T, C], weight [C, W], dy [1, T, C] and cu_seqlens."""
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(doc_lens)]).astype(np.int32)
    T = int(cu[-1])
    x = jnp.asarray(rng.standard_normal((1, T, C)), dtype)
    w = jnp.asarray(rng.standard_normal((C, W)) * W**-0.5, wdtype)
    dy = jnp.asarray(rng.standard_normal((1, T, C)), dtype)
    return x, w, dy, jnp.asarray(cu)


@functools.partial(jax.jit, static_argnums=(0, 1))
def conv_vjp(backend, activation, x, w, dy, cu):
    """(y, dx, dweight) of short_conv for cotangent dy."""
    y, pull = jax.vjp(lambda x, w: _conv(backend, activation)(x, w, cu), x, w)
    return (y, *pull(dy))


# (x dtype, weight dtype, C): the vector path (C % 8 == 0), the scalar one, mixed dtypes
DTYPES = [(jnp.bfloat16, jnp.float32, 256), (jnp.bfloat16, jnp.bfloat16, 12),
          (jnp.float32, jnp.float32, 264), (jnp.float32, jnp.bfloat16, 20)]


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("W", [1, 2, 3, 4])
@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: f"{jnp.dtype(d[0]).name}-"
                         f"w{jnp.dtype(d[1]).name}-C{d[2]}")
def test_gpu_conv_matches_xla(dt, W, activation):
    need_gpu()
    dtype, wdtype, C = dt
    name = f"{jnp.dtype(dtype).name}-{jnp.dtype(wdtype).name}-{C}-{W}-{activation}"
    x, w, dy, cu = make_inputs(zlib.crc32(name.encode()), C=C, W=W, dtype=dtype, wdtype=wdtype)
    got = conv_vjp("cuda", activation, x, w, dy, cu)
    ref = conv_vjp("xla", activation, x, w, dy, cu)
    tol = max(TOL[dtype], TOL[wdtype])
    errs = {}
    for key, a, b in zip(("y", "dx", "dweight"), got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, (key, a.shape, a.dtype, b.dtype)
        assert np.isfinite(np.asarray(a, np.float32)).all(), key
        errs[key] = rel_rms(a, b)
    print(f"\n[{name}] cuda vs xla rel RMS: " + ", ".join(f"{k}={v:.1e}" for k, v in errs.items()))
    assert all(e <= tol for e in errs.values()), errs


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_conv_batch_and_long(dtype):
    """B = 3 without cu_seqlens; one long sequence, where dweight has the most partials and each
    covers more than 64 tokens."""
    need_gpu()
    rng = np.random.default_rng(5)
    for B, T, C in ((3, 77, 40), (1, 70001, 64)):
        x = jnp.asarray(rng.standard_normal((B, T, C)), dtype)
        w = jnp.asarray(rng.standard_normal((C, 4)) * 0.5, jnp.float32)
        dy = jnp.asarray(rng.standard_normal((B, T, C)), dtype)
        got, ref = (conv_vjp(b, "silu", x, w, dy, None) for b in ("cuda", "xla"))
        errs = [rel_rms(a, r) for a, r in zip(got, ref)]
        print(f"\n[B={B} T={T} {jnp.dtype(dtype).name}] y, dx, dweight: {errs}")
        assert all(e <= TOL[dtype] for e in errs), errs


def test_gpu_conv_dweight_deterministic():
    need_gpu()
    x, w, dy, cu = make_inputs(9, doc_lens=(1, 5000, 63, 64, 65, 1000))
    first = conv_vjp("cuda", "silu", x, w, dy, cu)
    for _ in range(3):
        again = conv_vjp("cuda", "silu", x, w, dy, cu)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


_POISON_CHECK = textwrap.dedent("""
    import os, sys
    import numpy as np, jax.numpy as jnp
    sys.path.insert(0, os.path.dirname({here!r}))
    from test_conv_cuda import DTYPES, conv_vjp, make_inputs
    assert os.environ["JAX_CAKE_GDN_POISON"] == "1"
    for dtype, wdtype, C in DTYPES:
        for W in (1, 2, 3, 4):
            for act in ("silu", None):
                x, w, dy, cu = make_inputs(W, C=C, W=W, dtype=dtype, wdtype=wdtype)
                for key, a in zip(("y", "dx", "dweight"), conv_vjp("cuda", act, x, w, dy, cu)):
                    assert np.isfinite(np.asarray(a, np.float32)).all(), (C, W, act, key)
    print("OK")
""")


def test_gpu_conv_finite_under_poison():
    need_gpu()
    run_python(_POISON_CHECK.format(here=os.path.abspath(__file__)), poison=True)
