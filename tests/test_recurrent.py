"""gdn_step: the recurrence token by token against the f64 oracle, continuing gdn's final state
(prefill with the chunked op, decode with the step equals one pass), the gate options, jit, and
bad input. Prints the decode step's time per token on this host (no timing assertion)."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_inputs, rel_rms, uneven_cu_seqlens

from jax_cake_gdn import gdn, gdn_step
from jax_cake_gdn.reference import gdn_reference


@pytest.mark.parametrize("H,HV,qk_l2norm,T", [(2, 2, False, 1), (2, 4, True, 5), (1, 3, True, 2)])
def test_step_matches_reference(rng, H, HV, qk_l2norm, T):
    q, k, v, g, beta, S0 = make_inputs(rng, B=3, T=T, H=H, HV=HV, K=16, V=24,
                                       qk_l2norm=qk_l2norm, num_states=3)
    o, S = jax.jit(gdn_step, static_argnames="qk_l2norm")(q, k, v, g, beta, S0,
                                                            qk_l2norm=qk_l2norm)
    o_ref, S_ref = gdn_reference(q, k, v, g, beta, initial_state=S0, qk_l2norm=qk_l2norm)
    assert o.shape == (3, T, HV, 24) and S.dtype == jnp.float32
    assert rel_rms(o, o_ref) <= 1e-5 and rel_rms(S, S_ref) <= 1e-5
    o0, _ = gdn_step(q, k, v, g, beta, qk_l2norm=qk_l2norm)  # state None = zeros
    o_ref0, _ = gdn_reference(q, k, v, g, beta, qk_l2norm=qk_l2norm)
    assert rel_rms(o0, o_ref0) <= 1e-5


def test_prefill_then_decode_equals_gdn(rng, H=2, HV=4):
    """Uneven documents through the chunked gdn (output_final_state), then each continues with
    gdn_step (one row per document, 6 new tokens): equals the oracle over the whole documents."""
    T, n_new = 160, 6
    cu = uneven_cu_seqlens(rng, T, n_docs=4)
    N = len(cu) - 1
    q, k, v, g, beta, _ = make_inputs(rng, B=1, T=T + N * n_new, H=H, HV=HV, K=16, V=16,
                                      qk_l2norm=True, dtype=jnp.bfloat16)
    prompt = lambda x: x[:, :T]
    new = lambda x: x[0, T:].reshape((N, n_new) + x.shape[2:])  # document n's next tokens
    args = (q, k, v, g, beta)
    o_p, S = gdn(*map(prompt, args), cu_seqlens=jnp.asarray(cu), qk_l2norm=True,
                 output_final_state=True, backend="xla")
    o_d, S_end = gdn_step(*map(new, args), S, qk_l2norm=True)
    # the oracle on the documents extended by their new tokens
    docs = [np.concatenate([np.asarray(x[0, cu[n]:cu[n + 1]], np.float32),
                            np.asarray(new(x)[n], np.float32)]) for x in args
            for n in range(N)]
    packed = [np.concatenate(docs[i * N:(i + 1) * N])[None] for i in range(5)]
    cu_ext = np.concatenate([[0], np.cumsum(np.diff(cu) + n_new)])
    o_ref, S_ref = gdn_reference(*packed, cu_seqlens=cu_ext, qk_l2norm=True)
    ours = np.concatenate([np.concatenate([np.asarray(o_p[0, cu[n]:cu[n + 1]], np.float32),
                                           np.asarray(o_d[n], np.float32)]) for n in range(N)])
    assert rel_rms(ours, o_ref[0]) <= 1e-2  # bf16 q, k, v
    assert rel_rms(S_end, S_ref) <= 1e-2


def test_gate_options_match_gdn(rng):
    q, k, v, g_raw, b_raw, S0 = make_inputs(rng, B=2, T=9, H=1, HV=2, K=8, V=8, num_states=2)
    opts = dict(use_gate_in_kernel=True, A_log=jnp.asarray(rng.standard_normal(2), jnp.float32),
                dt_bias=jnp.asarray(rng.standard_normal(2), jnp.float32),
                use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, scale=0.7)
    o, S = gdn_step(q, k, v, g_raw, b_raw, S0, **opts)
    o_c, S_c = gdn(q, k, v, g_raw, b_raw, initial_state=S0, output_final_state=True,
                   backend="xla", **opts)
    assert rel_rms(o, o_c) <= 1e-5 and rel_rms(S, S_c) <= 1e-5


def test_decode_time_per_token(rng):
    """One jitted decode step at Qwen3-Next's linear-attention heads (16, 32), K = V = 128,
    batch 1: prints the median time per token; asserts only that it runs and stays finite."""
    q, k, v, g, beta, S = make_inputs(rng, B=1, T=1, H=16, HV=32, K=128, V=128,
                                      dtype=jnp.bfloat16, qk_l2norm=True, num_states=1)
    step = jax.jit(lambda S, q, k, v, g, b: gdn_step(q, k, v, g, b, S, qk_l2norm=True)[::-1])
    S, o = step(S, q, k, v, g, beta)
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        S, o = jax.block_until_ready(step(S, q, k, v, g, beta))
        times.append(time.perf_counter() - t0)
    assert np.isfinite(np.asarray(S)).all()
    print(f"\ngdn_step decode on {jax.devices()[0].platform}: heads (16, 32), K = V = 128, "
          f"batch 1: {np.median(times) * 1e3:.2f} ms per token (median of 20)")


def test_bad_inputs(rng):
    q, k, v, g, beta, S = make_inputs(rng, B=2, T=1, H=2, HV=4, K=8, V=8, num_states=2)
    with pytest.raises(ValueError, match="^state must have shape"):
        gdn_step(q, k, v, g, beta, S[:1])
    with pytest.raises(TypeError, match="^state must be float32"):
        gdn_step(q, k, v, g, beta, S.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="HV"):
        gdn_step(q, k, v[:, :, :3], g[..., :3], beta[..., :3])
    with pytest.raises(TypeError, match="g must be float32"):
        gdn_step(q, k, v, g.astype(jnp.bfloat16), beta)
