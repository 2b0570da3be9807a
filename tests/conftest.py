"""Shared test setup: 8 host devices for the context-parallel tests, and input makers."""

import math
import os
import subprocess
import sys
import zlib

# Must precede the first jax import anywhere in the test session.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def rel_rms(x, ref):
    """||x - ref|| / ||ref|| in float64."""
    x = np.asarray(np.asarray(x, np.float32), np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def cpu_mesh(shape, names, **kw):
    """A mesh over the first prod(shape) host devices (8 of them, set above), also on a GPU host."""
    return jax.make_mesh(tuple(shape), tuple(names),
                         devices=jax.devices("cpu")[:math.prod(shape)], **kw)


def need_ext():
    """Skip unless the CUDA extension jax_cake_gdn._cuda was built."""
    from jax_cake_gdn.primitives import cuda

    if not cuda.available():
        pytest.skip(f"jax_cake_gdn._cuda not built: {cuda.unavailable_reason()}")


def lowered_cuda_calls(f, *args) -> list:
    """The jax_cake_gdn custom calls (target names without the prefix, in program order) of f
    jitted and lowered for the cuda platform at these argument shapes (any host)."""
    import re

    hlo = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return re.findall(r"custom_call @jax_cake_gdn_(\w+)", hlo)


def need_gpu():
    """Skip unless the extension is built and a CUDA GPU is visible."""
    from jax_cake_gdn.primitives import cuda

    need_ext()
    if not cuda.gpu_available():
        pytest.skip("no CUDA GPU")


def run_python(code: str, *, poison: bool = False, timeout: float = 600):
    """Run `code` in a fresh Python and assert it exits 0 having printed OK. poison=True sets
    JAX_CAKE_GDN_POISON=1 (the kernels read it once per process, hence the fresh process)."""
    env = dict(os.environ, JAX_CAKE_GDN_POISON="1") if poison else None
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=timeout)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-4000:] + r.stderr[-4000:]
    return r


def make_inputs(rng, *, B=1, T=200, H=2, HV=4, K=32, V=32, dtype=jnp.float32, qk_l2norm=False,
                num_states=None):
    """Fresh random GDN inputs: g = log-sigmoid (<= 0), beta in (0, 1). Without the in-op L2 norm,
    q and k are scaled by K^-0.5 so the recurrence stays bounded."""
    s = 1.0 if qk_l2norm else K**-0.5
    q = jnp.asarray(rng.standard_normal((B, T, H, K)) * s, dtype)
    k = jnp.asarray(rng.standard_normal((B, T, H, K)) * s, dtype)
    v = jnp.asarray(rng.standard_normal((B, T, HV, V)), dtype)
    g = jnp.asarray(-np.logaddexp(0.0, -(rng.standard_normal((B, T, HV)) + 2.0)), jnp.float32)
    beta = jnp.asarray(1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, HV)))), jnp.float32)
    h0 = None
    if num_states is not None:
        h0 = jnp.asarray(rng.standard_normal((num_states, HV, K, V)) * 0.1, jnp.float32)
    return q, k, v, g, beta, h0


def uneven_cu_seqlens(rng, T, n_docs=4):
    """Document bounds over T with a length-1 document, lengths not multiples of 64."""
    cuts = np.sort(rng.choice(np.arange(2, T - 1), size=n_docs - 2, replace=False))
    return np.concatenate([[0, 1], cuts, [T]]).astype(np.int32)


@pytest.fixture
def rng(request):
    """A fresh generator per test (seeded from the test id, so a failure reproduces)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
