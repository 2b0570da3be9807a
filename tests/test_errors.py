"""Bad input of docs/design.md section 4 that applies to one device: a clear error naming the
argument (concrete values) or NaN everywhere (traced bounds)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_mesh, make_inputs

import jax_cake_gdn as J


@pytest.fixture
def args(rng):
    q, k, v, g, beta, _ = make_inputs(rng, T=64, H=2, HV=4, K=16, V=16)
    return dict(q=q, k=k, v=v, g=g, beta=beta)


def call(a, **kw):
    return J.gdn(a["q"], a["k"], a["v"], a["g"], a["beta"], backend="xla", **kw)


CASES = [
    # (what to change, kwargs, error type, text the message must contain)
    (dict(q=lambda a: a["q"][0]), {}, ValueError, "q must have rank 4"),
    (dict(v=lambda a: a["v"][..., 0]), {}, ValueError, "v must have rank 4"),
    (dict(g=lambda a: a["g"][0]), {}, ValueError, "g must have rank 3"),
    (dict(k=lambda a: a["k"][:, :, :1]), {}, ValueError, "k must have the shape of q"),
    (dict(beta=lambda a: a["beta"][:, :, :3]), {}, ValueError, "beta must have shape"),
    (dict(v=lambda a: jnp.concatenate([a["v"], a["v"][:, :, :1]], 2),
          g=lambda a: jnp.concatenate([a["g"], a["g"][:, :, :1]], 2),
          beta=lambda a: jnp.concatenate([a["beta"], a["beta"][:, :, :1]], 2)),
     {}, ValueError, "multiple of q/k heads"),
    (dict(q=lambda a: a["q"].astype(jnp.float16)), {}, TypeError, "q must be bfloat16 or float32"),
    (dict(v=lambda a: a["v"].astype(jnp.bfloat16)), {}, TypeError, "q, k, v must share a dtype"),
    (dict(g=lambda a: a["g"].astype(jnp.bfloat16)), {}, TypeError, "g must be float32"),
    (dict(beta=lambda a: a["beta"].astype(jnp.bfloat16)), {}, TypeError, "beta must be float32"),
    (dict(q=lambda a: np.asarray(a["q"]).tolist()), {}, TypeError, "q must be an array"),
    ({}, dict(cu_seqlens=np.array([1, 30, 64], np.int32)), ValueError, "must start at 0"),
    ({}, dict(cu_seqlens=np.array([0, 40, 30, 64], np.int32)), ValueError, "non-decreasing"),
    ({}, dict(cu_seqlens=np.array([0, 30, 63], np.int32)), ValueError, "must equal the token"),
    ({}, dict(cu_seqlens=np.array([0, 30, 64], np.float32)), TypeError,
     "cu_seqlens must be an integer"),
    ({}, dict(cu_seqlens=np.array([[[0, 64]]], np.int32)), ValueError,
     r"cu_seqlens must be \[N \+ 1\] \(B == 1\) or per-row \[B, N \+ 1\]"),
    ({}, dict(cu_seqlens=np.array([[0, 64], [0, 64]], np.int32)), ValueError,
     "a row per batch row B = 1"),
    ({}, dict(cu_seqlens=np.array([[0, 30, 63]], np.int32)), ValueError,
     r"cu_seqlens\[0\]\[-1\] must equal the token count"),
    ({}, dict(cu_seqlens=np.array([[0, 30, 64]], np.int32),
              initial_state=jnp.zeros((2, 4, 16, 16))),
     ValueError, r"initial_state must have shape \[B, N, HV, K, V\] = \(1, 2, 4, 16, 16\)"),
    ({}, dict(initial_state=jnp.zeros((2, 4, 16, 16))), ValueError,
     "initial_state must have shape"),
    ({}, dict(initial_state=jnp.zeros((1, 4, 16, 16), jnp.bfloat16)), TypeError,
     "initial_state must be float32"),
    ({}, dict(save_mode="heavy"), ValueError, "save_mode"),
    ({}, dict(scale=-1.0), ValueError, "scale must be positive"),
    ({}, dict(scale=np.float32(np.nan)), ValueError, "scale must be positive and finite"),
    ({}, dict(scale=True), TypeError, "scale must be a real number"),
    ({}, dict(scale=np.ones(2)), TypeError, "scale must be a real number"),
]


@pytest.mark.parametrize("change,kw,exc,text", CASES)
def test_bad_input(args, change, kw, exc, text):
    a = {n: (change[n](args) if n in change else x) for n, x in args.items()}
    with pytest.raises(exc, match=text):
        call(a, **kw)


def test_numpy_scale_is_a_number(args):
    np.testing.assert_array_equal(call(args, scale=np.float32(0.5)), call(args, scale=0.5))


def test_traced_scale_says_it_is_static(args):
    with pytest.raises(TypeError, match="scale must be a concrete number.*multiply o"):
        jax.jit(lambda s: call(args, scale=s))(0.5)


def test_shape_dtype_structs_say_eval_shape(args):
    sds = {n: jax.ShapeDtypeStruct(x.shape, x.dtype) for n, x in args.items()}
    with pytest.raises(TypeError, match=r"q is a jax.ShapeDtypeStruct.*jax.eval_shape\(gdn"):
        call(sds)
    assert jax.eval_shape(lambda a: call(a), sds).shape == args["v"].shape


def test_cuda_backend_off_a_gpu_says_so(args):
    """backend='cuda' compiled for the host: a ValueError while compiling, not a missing FFI
    handler at run time; lowering for cuda still works here."""
    from conftest import need_ext

    from jax_cake_gdn.primitives import cuda

    need_ext()
    if cuda.gpu_available():
        pytest.skip("a CUDA GPU is visible")
    a = {n: jnp.zeros(x.shape[:3] + (64,) * (x.ndim - 3), x.dtype) for n, x in args.items()}
    with pytest.raises(ValueError, match="backend='cuda' runs CUDA kernels.*compiled for cpu"):
        J.gdn(a["q"], a["k"], a["v"], a["g"], a["beta"], backend="cuda")
    with pytest.raises(ValueError, match="compiled for cpu"):
        J.short_conv(jnp.ones((1, 8, 4)), jnp.ones((4, 2)), backend="cuda")
    f = jax.jit(lambda *x: J.gdn(*x, backend="cuda"))
    text = f.trace(a["q"], a["k"], a["v"], a["g"], a["beta"]).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "jax_cake_gdn_solve_a_walk_output" in text


def test_layout_helpers_check_num_ranks_and_doc_lengths(args):
    with pytest.raises(ValueError, match="num_ranks must be a positive int, got 0"):
        J.to_layout(args["q"], jnp.array([0, 64], jnp.int32), "contiguous", 0)
    with pytest.raises(ValueError, match="doc_zigzag.*multiple of 2W = 4: document 0"):
        J.saved_layout(*args.values(), cu_seqlens=np.array([0, 5, 64], np.int32), num_ranks=2,
                       layout="doc_zigzag")


def test_cu_seqlens_needs_packed_batch(rng):
    q, k, v, g, beta, _ = make_inputs(rng, B=2, T=32, H=1, HV=1, K=8, V=8)
    with pytest.raises(ValueError, match="B == 1"):
        J.gdn(q, k, v, g, beta, cu_seqlens=jnp.array([0, 32], jnp.int32), backend="xla")


def test_unknown_backend(args):
    with pytest.raises(ValueError, match="backend"):
        J.gdn(args["q"], args["k"], args["v"], args["g"], args["beta"], backend="tpu")


def test_traced_cu_seqlens_is_accepted_under_jit(args):
    f = jax.jit(lambda cu: call(args, cu_seqlens=cu))
    o = f(jnp.array([0, 10, 64], jnp.int32))
    assert o.shape == args["v"].shape and np.all(np.isfinite(np.asarray(o, np.float32)))
    for bad in ([1, 10, 64], [0, 40, 30], [0, 10, 63]):  # not checkable while traced: NaN, loudly
        assert np.all(np.isnan(np.asarray(f(jnp.array(bad, jnp.int32)), np.float32)))


def test_traced_bad_bounds_give_nan_gradients(args):
    """The cotangent is poisoned too: malformed traced bounds put NaN into the gradients (the
    tokens the malformed table still covers), not zeros."""
    def loss(q, v, cu):
        o = J.gdn(q, args["k"], v, args["g"], args["beta"], cu_seqlens=cu, backend="xla")
        return jnp.sum(o.astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    for d in grad(args["q"], args["v"], jnp.array([0, 10, 64], jnp.int32)):
        assert np.all(np.isfinite(np.asarray(d, np.float32)))
    for d in grad(args["q"], args["v"], jnp.array([0, 40, 30], jnp.int32)):
        assert np.isnan(np.asarray(d, np.float32)[:, :30]).all()


def test_traced_bad_per_row_bounds_give_nan(rng):
    q, k, v, g, beta, _ = make_inputs(rng, B=2, T=32, H=1, HV=1, K=8, V=8)
    f = jax.jit(lambda cu: J.gdn(q, k, v, g, beta, cu_seqlens=cu, backend="xla"))
    assert np.isfinite(np.asarray(f(jnp.array([[0, 5, 32], [0, 32, 32]], jnp.int32)))).all()
    assert np.isnan(np.asarray(f(jnp.array([[0, 5, 32], [0, 33, 32]], jnp.int32)))).all()


@pytest.mark.parametrize("bounds", ([0, 11, 10], [[0, 3, 10], [1, 4, 10]]))
def test_short_conv_traced_bad_bounds_give_nan(bounds):
    """As gdn: NaN in y and in the gradients, never a finite wrong number."""
    cu = jnp.asarray(bounds, jnp.int32)
    x, w = jnp.ones((cu.shape[0] if cu.ndim == 2 else 1, 10, 4)), jnp.ones((4, 3))
    f = jax.jit(lambda x, w, cu: jnp.sum(J.short_conv(x, w, cu_seqlens=cu, backend="xla")))
    good = jnp.zeros_like(cu).at[..., -1].set(10)
    assert np.isfinite(f(x, w, good))
    assert np.isnan(f(x, w, cu))
    for d in jax.jit(jax.grad(f, argnums=(0, 1)))(x, w, cu):
        assert np.isnan(np.asarray(d)).all()


def test_short_conv_cp_traced_bad_bounds_give_nan():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = cpu_mesh((2,), ("cp",))
    f = jax.jit(jax.shard_map(
        lambda x, w, cu: J.short_conv(x, w, cu_seqlens=cu, axis_name="cp"), mesh=mesh,
        in_specs=(P(None, "cp"), P(), P()), out_specs=P(None, "cp")))
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
    x, w = put(jnp.ones((1, 16, 4)), P(None, "cp")), put(jnp.ones((4, 3)), P())
    assert np.isfinite(np.asarray(f(x, w, put(jnp.array([0, 7, 16], jnp.int32), P())))).all()
    assert np.isnan(np.asarray(f(x, w, put(jnp.array([0, 17, 16], jnp.int32), P())))).all()


@pytest.mark.parametrize("x_shape,w_shape,kw,exc,text", [
    ((1, 10), (4, 3), {}, ValueError, "x must be"),
    ((1, 10, 4), (4,), {}, ValueError, "weight must be"),
    ((1, 10, 4), (5, 3), {}, ValueError, "weight must be"),
    ((1, 10, 4), (4, 5), {}, ValueError, "width W"),
    ((1, 10, 4), (4, 3), dict(activation="relu"), ValueError, "activation"),
    ((1, 10, 4), (4, 3), dict(cu_seqlens=np.array([0, 9], np.int32)), ValueError, "must equal"),
])
def test_short_conv_bad_input(x_shape, w_shape, kw, exc, text):
    with pytest.raises(exc, match=text):
        J.short_conv(jnp.ones(x_shape), jnp.ones(w_shape), **kw)


@pytest.mark.parametrize("backend", ["xla", None])
def test_short_conv_dtypes_same_rule_on_every_backend(backend):
    x, w = jnp.ones((1, 10, 4)), jnp.ones((4, 3))
    with pytest.raises(TypeError, match="x must be bfloat16 or float32, got float16"):
        J.short_conv(x.astype(jnp.float16), w, backend=backend)
    with pytest.raises(TypeError, match="weight must be bfloat16 or float32, got float16"):
        J.short_conv(x, w.astype(jnp.float16), backend=backend)
