"""jax_cake_gdn.fla: FLA's signatures, return convention and dtypes over gdn / gdn_step.

test_docstring_example ports the example of FLA's `chunk_gated_delta_rule` docstring line by line
(torch -> jax.numpy, with smaller sizes so the f64 oracle runs on CPU) and checks it."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_inputs, rel_rms, uneven_cu_seqlens

from jax_cake_gdn import gdn
from jax_cake_gdn import fla
from jax_cake_gdn.fla import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from jax_cake_gdn.reference import gdn_reference

F = jax.nn  # torch.nn.functional's role below
SHAPE = dict(B=2, T=70, H=2, HV=4, K=16, V=16)  # one shape for most tests: gdn compiles once


def normalize(x, axis=-1):  # F.normalize(x, p=2, dim=-1)
    xf = x.astype(jnp.float32)
    return (xf / jnp.maximum(jnp.linalg.norm(xf, axis=axis, keepdims=True), 1e-12)).astype(x.dtype)


def test_docstring_example(rng):
    # jitted, as JAX code runs it (the flags are static); torch.randn / torch.rand from numpy
    chunk_gated_delta_rule = jax.jit(fla.chunk_gated_delta_rule,
                                     static_argnames=("output_final_state",))
    randn = lambda *s, dtype: jnp.asarray(rng.standard_normal(s), dtype)
    rand = lambda *s, dtype: jnp.asarray(rng.random(s), dtype)
    bf16 = jnp.bfloat16
    # inputs with equal lengths (FLA: B, T, H, HV, K, V = 4, 2048, 4, 8, 512, 512)
    B, T, H, HV, K, V = 4, 96, 2, 4, 32, 32
    q = randn(B, T, H, K, dtype=bf16)
    k = normalize(randn(B, T, H, K, dtype=bf16))
    v = randn(B, T, HV, V, dtype=bf16)
    beta = F.sigmoid(rand(B, T, HV, dtype=bf16))
    g = F.log_sigmoid(rand(B, T, HV, dtype=bf16))
    h0 = randn(B, HV, K, V, dtype=bf16)
    o, ht = chunk_gated_delta_rule(
        q, k, v, g, beta,
        initial_state=h0,
        output_final_state=True
    )
    o_ref, ht_ref = gdn_reference(q, k, v, g, beta, initial_state=h0)
    assert o.dtype == bf16 and ht.dtype == jnp.float32
    assert rel_rms(o, o_ref) <= 1e-2 and rel_rms(ht, ht_ref) <= 1e-2
    # for variable-length inputs, the batch size `B` is expected to be 1 and `cu_seqlens` is
    # required (rearrange 'b t ... -> 1 (b t) ...')
    q, k, v, beta, g = map(lambda x: x.reshape((1, B * T) + x.shape[2:]), (q, k, v, beta, g))
    # for a batch with 4 sequences, `cu_seqlens` with 5 start/end positions are expected
    cu_seqlens = np.array([0, T, 2 * T, 3 * T, 4 * T], dtype=np.int64)
    o_var, ht_var = chunk_gated_delta_rule(
        q, k, v, g, beta,
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=cu_seqlens
    )
    assert rel_rms(o_var.reshape(o.shape), o_ref) <= 1e-2 and rel_rms(ht_var, ht_ref) <= 1e-2


def test_always_a_pair(rng):
    """FLA's `o, _ = ...` habit: the pair comes back whatever output_final_state says."""
    q, k, v, g, beta, _ = make_inputs(rng, **SHAPE)
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta)
    assert o.shape == (2, 70, 4, 16) and ht is None
    o_ref, _ = gdn_reference(q, k, v, g, beta)
    assert rel_rms(o, o_ref) <= 1e-5
    o, ht = fused_recurrent_gated_delta_rule(q, k, v, g, None, None, beta)
    assert o.shape == (2, 70, 4, 16) and ht is None and rel_rms(o, o_ref) <= 1e-5


def test_positional_order_and_gate_options(rng):
    T = 150
    cu = uneven_cu_seqlens(rng, T)
    q, k, v, g_raw, b_raw, h0 = make_inputs(rng, T=T, H=1, HV=2, K=16, V=8, qk_l2norm=True,
                                            num_states=len(cu) - 1)
    A_log = jnp.asarray(rng.standard_normal(2), jnp.bfloat16)  # FLA modules may hold bf16
    dt_bias = jnp.asarray(rng.standard_normal(2), jnp.bfloat16)
    # FLA's positional order: q, k, v, g, beta, scale, initial_state, output_final_state,
    # use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
    # cu_seqlens
    o, ht = chunk_gated_delta_rule(q, k, v, g_raw, b_raw, 0.3, h0, True, True, True, True,
                                   False, cu, use_gate_in_kernel=True, A_log=A_log,
                                   dt_bias=dt_bias, chunk_size=64, cu_seqlens_cpu=cu)
    f32 = lambda x: x.astype(jnp.float32)
    o_ref, ht_ref = gdn(q, k, v, g_raw, b_raw, cu_seqlens=cu, scale=0.3, qk_l2norm=True,
                        initial_state=h0, output_final_state=True, backend="xla",
                        use_gate_in_kernel=True, A_log=f32(A_log), dt_bias=f32(dt_bias),
                        use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(ht, ht_ref)


def test_fla_dtypes(rng):
    """bf16 / fp16 g, beta, initial_state become float32; fp16 q, k, v run as bf16 and o comes
    back fp16."""
    q, k, v, g, beta, h0 = make_inputs(rng, **SHAPE, num_states=2)
    half, bf16 = jnp.float16, jnp.bfloat16
    o, ht = chunk_gated_delta_rule(q.astype(half), k.astype(half), v.astype(half),
                                   g.astype(bf16), beta.astype(half), initial_state=h0.astype(bf16),
                                   output_final_state=True)
    assert o.dtype == half and ht.dtype == jnp.float32
    o_b, ht_b = gdn(*(x.astype(half).astype(bf16) for x in (q, k, v)), g.astype(bf16).astype(
        jnp.float32), beta.astype(half).astype(jnp.float32),
        initial_state=h0.astype(bf16).astype(jnp.float32), output_final_state=True)
    np.testing.assert_array_equal(o, o_b.astype(half))
    np.testing.assert_array_equal(ht, ht_b)
    o_ref, _ = gdn_reference(q, k, v, g, beta, initial_state=h0)
    assert rel_rms(o, o_ref) <= 1e-2


@pytest.mark.parametrize("fn", [chunk_gated_delta_rule, fused_recurrent_gated_delta_rule])
def test_state_v_first(rng, fn):
    """FLA's V-first state [.., V, K] in and out: the transpose of the [.., K, V] result."""
    q, k, v, g, beta, h0 = make_inputs(rng, **dict(SHAPE, V=8), num_states=2)
    pos = (g, beta) if fn is chunk_gated_delta_rule else (g, None, None, beta)
    o, ht = fn(q, k, v, *pos, initial_state=h0, output_final_state=True)
    o_t, ht_t = fn(q, k, v, *pos, initial_state=jnp.swapaxes(h0, -1, -2), output_final_state=True,
                   state_v_first=True)
    assert ht_t.shape == (2, 4, 8, 16)
    np.testing.assert_array_equal(o_t, o)
    np.testing.assert_array_equal(ht_t, jnp.swapaxes(ht, -1, -2))
    with pytest.warns(DeprecationWarning, match="state_v_first"):
        _, ht_d = fn(q, k, v, *pos, initial_state=jnp.swapaxes(h0, -1, -2),
                     output_final_state=True, transpose_state_layout=True)
    np.testing.assert_array_equal(ht_d, ht_t)


def test_fused_recurrent_decode_after_chunk_prefill(rng):
    """HF Qwen3-Next's pattern: chunk over the prompt, fused_recurrent for each new token."""
    q, k, v, g, beta, _ = make_inputs(rng, **SHAPE, qk_l2norm=True)
    P_ = 65
    sl = lambda a, b: [x[:, a:b] for x in (q, k, v, g, beta)]
    os_, (o, state) = [], chunk_gated_delta_rule(*sl(0, P_), output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True)
    os_.append(o)
    for t in range(P_, 70):
        qt, kt, vt, gt, bt = sl(t, t + 1)
        o, state = fused_recurrent_gated_delta_rule(qt, kt, vt, g=gt, beta=bt,
                                                    initial_state=state, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
        os_.append(o)
    o_ref, s_ref = gdn_reference(q, k, v, g, beta, qk_l2norm=True)
    assert rel_rms(jnp.concatenate(os_, 1), o_ref) <= 1e-5 and rel_rms(state, s_ref) <= 1e-5
    # with cu_seqlens it runs the chunked op (same recurrence)
    cu = np.array([0, 30, 70], np.int32)
    o1, s1 = fused_recurrent_gated_delta_rule(q[:1], k[:1], v[:1], g[:1], beta=beta[:1],
                                              cu_seqlens=cu, output_final_state=True)
    o1_ref, s1_ref = gdn_reference(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=cu)
    assert rel_rms(o1, o1_ref) <= 1e-5 and rel_rms(s1, s1_ref) <= 1e-5


def test_bad_arguments(rng):
    q, k, v, g, beta, _ = make_inputs(rng, B=1, T=8, H=1, HV=1, K=8, V=8)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=32)
    with pytest.raises(ValueError, match="cp_context"):
        chunk_gated_delta_rule(q, k, v, g, beta, cp_context=object())
    with pytest.raises(ValueError, match="head_first"):
        chunk_gated_delta_rule(q, k, v, g, beta, head_first=True)
    with pytest.raises(TypeError, match="output_final_sate"):
        chunk_gated_delta_rule(q, k, v, g, beta, output_final_sate=True)
    with pytest.raises(ValueError, match="transpose_state_layout"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            chunk_gated_delta_rule(q, k, v, g, beta, state_v_first=True,
                                   transpose_state_layout=True)
    with pytest.raises(ValueError, match="gk"):
        fused_recurrent_gated_delta_rule(q, k, v, g, gk=jnp.zeros((1, 8, 1, 8)), beta=beta)
    with pytest.raises(ValueError, match="A_log"):  # gdn's own checks still name the argument
        chunk_gated_delta_rule(q, k, v, g, beta, use_gate_in_kernel=True)
    with pytest.raises(TypeError, match="q must be bfloat16 or float32"):
        chunk_gated_delta_rule(q.astype(jnp.int32), k, v, g, beta)
