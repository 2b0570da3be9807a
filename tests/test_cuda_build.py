"""The build and FFI path: nanobind capsules -> register_ffi_target(platform="CUDA") -> ffi_call.

CPU host: the extension imports (it is built wherever nvcc exists), lowering for the cuda platform
emits the custom call, and under shard_map the results carry the inputs' varying axes. GPU host:
gate_cumsum against numpy, with JAX_CAKE_GDN_POISON=1 (in a subprocess: the flag is read once per
process).
"""

from __future__ import annotations

import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_mesh, need_ext, need_gpu, run_python
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_cake_gdn.chunks import ChunkTable
from jax_cake_gdn.primitives import cuda

CHUNK = 64


def _lower_cuda(f, *args) -> str:
    """StableHLO text of jit(f) lowered for the cuda platform (works on a CPU-only host)."""
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _tables(rng, num_tokens: int, spare: int = 3):
    """Uneven documents (lengths 1, 63, 64, 65, ... not multiples of 64) cut into 64-token
    chunks, plus `spare` unused chunks (length 0, start T), in shuffled order."""
    cuts = np.sort(rng.choice(np.arange(1, num_tokens), size=6, replace=False))
    cuts = np.concatenate([[0, 1], cuts[cuts > 1], [num_tokens]])  # a length-1 document first
    starts, lens = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        for s in range(a, b, CHUNK):
            starts.append(s)
            lens.append(min(CHUNK, b - s))
    starts += [num_tokens] * spare
    lens += [0] * spare
    perm = rng.permutation(len(starts))
    return np.asarray(starts, np.int32)[perm], np.asarray(lens, np.int32)[perm]


def _ct(start, length):
    """A chunk table of these arrays (gate_cumsum reads only start and length)."""
    return ChunkTable(start, length, *[None] * 9)


def _numpy_gate_cumsum(g, starts, lens):
    out = np.full_like(g, np.nan)
    for s, n in zip(starts, lens):
        out[s:s + n] = np.add.accumulate(g[s:s + n], axis=0, dtype=np.float32)
    return out


# ------------------------------------------------------------------------------------------------
# CPU host
# ------------------------------------------------------------------------------------------------


def test_extension_registrations():
    need_ext()
    import jax_cake_gdn._cuda as ext

    regs = ext.registrations()
    assert "jax_cake_gdn_gate_cumsum" in regs
    assert all(name.startswith("jax_cake_gdn_") for name in regs)
    assert all(type(c).__name__ == "PyCapsule" for c in regs.values())
    assert cuda.target_names() == tuple(sorted(regs))
    assert cuda.require()  # registers every target with XLA; idempotent
    assert cuda.require()


def test_lower_for_cuda_emits_custom_call():
    need_ext()
    g = jnp.zeros((300, 6), jnp.float32)
    starts, lens = _tables(np.random.default_rng(0), 300)
    hlo = _lower_cuda(cuda.gate_cumsum, g, _ct(jnp.asarray(starts), jnp.asarray(lens)))
    assert "stablehlo.custom_call @jax_cake_gdn_gate_cumsum" in hlo
    assert "tensor<300x6xf32>" in hlo


def test_bad_inputs_raise_value_error():
    g = jnp.zeros((128, 4), jnp.float32)
    ok = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="g must be"):
        cuda.gate_cumsum(g[:, 0], _ct(ok, ok))
    with pytest.raises(ValueError, match="float32"):
        cuda.gate_cumsum(g.astype(jnp.bfloat16), _ct(ok, ok))
    with pytest.raises(ValueError, match="chunk_len must be int32"):
        cuda.gate_cumsum(g, _ct(ok, ok.astype(jnp.float32)))
    with pytest.raises(ValueError, match="chunk_len must have 2 entries"):
        cuda.gate_cumsum(g, _ct(ok, jnp.zeros((3,), jnp.int32)))


@pytest.mark.parametrize("varying", ["g", "tables", "both"])
def test_shard_map_results_carry_vma(varying):
    need_ext()
    mesh = cpu_mesh((4, 2), ("a", "b"))
    g_spec = P("a") if varying in ("g", "both") else P()
    t_spec = P("b") if varying in ("tables", "both") else P()
    expect = {"g": {"a"}, "tables": {"b"}, "both": {"a", "b"}}[varying]
    seen = {}

    def body(g, cs, cl):
        out = cuda.gate_cumsum(g, _ct(cs, cl))
        seen["out"] = jax.typeof(out)
        return out

    f = jax.shard_map(body, mesh=mesh, in_specs=(g_spec, t_spec, t_spec), out_specs=P("a", "b"))
    g_rows = 256 * (4 if g_spec == P("a") else 1)
    nc = 4 * (2 if t_spec == P("b") else 1)
    sds = lambda shape, dt, spec: jax.ShapeDtypeStruct(shape, dt,
                                                       sharding=NamedSharding(mesh, spec))
    hlo = _lower_cuda(f, sds((g_rows, 6), jnp.float32, g_spec),
                      sds((nc,), jnp.int32, t_spec), sds((nc,), jnp.int32, t_spec))
    assert "@jax_cake_gdn_gate_cumsum" in hlo
    assert seen["out"].shape == (256, 6)
    assert set(seen["out"].mat.varying) == expect


def test_missing_extension_warns_once():
    """Without the extension: available() is False with a reason, and require() warns once."""
    code = textwrap.dedent("""
        import sys, warnings
        sys.modules["jax_cake_gdn._cuda"] = None  # what a pure-Python install looks like
        from jax_cake_gdn.primitives import cuda
        assert not cuda.available()
        assert "not built" in cuda.unavailable_reason(), cuda.unavailable_reason()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert cuda.require() is False
            assert cuda.require() is False
        assert len(w) == 1 and "cuda backend is unavailable" in str(w[0].message), w
        print("OK")
    """)
    run_python(code, timeout=300)


# ------------------------------------------------------------------------------------------------
# GPU host
# ------------------------------------------------------------------------------------------------

_GPU_CHECK = textwrap.dedent("""
    import os, sys
    import numpy as np, jax, jax.numpy as jnp
    sys.path.insert(0, os.path.dirname({here!r}))
    from test_cuda_build import _ct, _tables, _numpy_gate_cumsum
    from jax_cake_gdn.primitives import cuda
    assert os.environ["JAX_CAKE_GDN_POISON"] == "1"
    f = jax.jit(lambda g, cs, cl: cuda.gate_cumsum(g, _ct(cs, cl)))
    for seed, (T, HV) in enumerate([(1000, 6), (4097, 48), (130, 200)]):
        rng = np.random.default_rng(seed)
        g = -rng.uniform(0.0, 1.0, size=(T, HV)).astype(np.float32)
        starts, lens = _tables(rng, T)
        ref = _numpy_gate_cumsum(g, starts, lens)
        out = np.asarray(f(jnp.asarray(g), jnp.asarray(starts), jnp.asarray(lens)))
        assert np.isfinite(out).all(), (T, HV, np.argwhere(~np.isfinite(out))[:5])
        np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
        again = np.asarray(f(jnp.asarray(g), jnp.asarray(starts), jnp.asarray(lens)))
        assert np.array_equal(out, again), "not deterministic"
    # poison is live: a token no chunk covers stays NaN
    g = jnp.ones((200, 4), jnp.float32)
    out = np.asarray(f(g, jnp.asarray([0, 128], jnp.int32), jnp.asarray([64, 64], jnp.int32)))
    assert np.isnan(out[64:128]).all() and np.isfinite(out[:64]).all()
    assert np.array_equal(out[:64, 0], np.arange(1, 65, dtype=np.float32))
    print("OK")
""")


def test_gpu_gate_cumsum_matches_numpy_with_poison():
    need_gpu()
    run_python(_GPU_CHECK.format(here=os.path.abspath(__file__)), poison=True)
