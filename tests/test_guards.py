"""The decay floor (guards.floor_decay): a decay far below it acts as a reset, exact against the
float64 loop, where the chunk's float32 gate cumsum used to lose it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_inputs, rel_rms

import jax_cake_gdn as J
from jax_cake_gdn.guards import DECAY_FLOOR, floor_decay
from jax_cake_gdn.reference import gdn_reference_vjp

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


@pytest.mark.parametrize("strong", (-1e6, -1e8, -np.inf))
def test_strong_decay_is_a_reset(rng, strong):
    T, cu = 200, np.array([0, 90, 200], np.int32)
    q, k, v, g, beta, h0 = make_inputs(rng, T=T, H=2, HV=4, K=16, V=16, num_states=2)
    g = g.at[0, [5, 70, 130, 131, 199], :].set(strong)  # inside chunks, twice in a row, last
    do = jnp.asarray(rng.standard_normal(v.shape), jnp.float32)
    dfinal = jnp.asarray(rng.standard_normal(h0.shape), jnp.float32)

    def f(q, k, v, g, beta, h0):
        return J.gdn(q, k, v, g, beta, cu_seqlens=jnp.asarray(cu), initial_state=h0,
                     output_final_state=True, backend="xla")

    (o, final), pull = jax.vjp(f, q, k, v, g, beta, h0)
    grads = pull((do, dfinal))
    ro, rfinal, rgrads = gdn_reference_vjp(q, k, v, g, beta, do, dfinal, cu_seqlens=cu,
                                           initial_state=h0)
    errs = {"o": rel_rms(o, ro), "final": rel_rms(final, rfinal)}
    errs.update({n: rel_rms(d, rgrads[n]) for n, d in zip(NAMES, grads)})
    assert max(errs.values()) <= 1e-5, errs
    assert np.all(np.asarray(grads[3])[0, [5, 70, 130, 131, 199]] == 0)  # below the floor


def test_floor_keeps_nan_and_milder_decays():
    g = jnp.array([0.0, -1.0, DECAY_FLOOR + 1, DECAY_FLOOR - 1, -np.inf, np.nan], jnp.float32)
    out, pull = jax.vjp(floor_decay, g)
    np.testing.assert_array_equal(out[:4], [0.0, -1.0, DECAY_FLOOR + 1, DECAY_FLOOR])
    assert out[4] == DECAY_FLOOR and np.isnan(out[5])
    np.testing.assert_array_equal(pull(jnp.ones_like(g))[0][:5], [1, 1, 1, 0, 0])
