"""Context parallelism on several GPUs: gdn_kcp with the cuda backend over W GPUs (NCCL
collectives from XLA) equals gdn on one GPU. Runs where at least W CUDA GPUs are visible and skips
with the reason otherwise (W = 2 on nvidia-h200-x2; 4 and 8 where such machines exist)."""

import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_inputs, need_gpu, rel_rms, run_python
from kcp_harness import (LAYOUTS, NAMES, docs_for, run_conv_kcp, run_conv_one_device, run_kcp,
                         run_one_device)

TOL = 1e-2  # bf16 inputs (docs/design.md section 4)
T, H, HV, D = 8192, 2, 6, 128


def gpus(W):
    """The first W CUDA GPUs (skip when fewer are visible)."""
    need_gpu()
    devs = jax.devices("cuda")
    if len(devs) < W:
        pytest.skip(f"needs {W} CUDA GPUs, {len(devs)} visible")
    return devs[:W]


def inputs(rng, layout, W):
    cu = docs_for(layout, W, T, rng)
    args = make_inputs(rng, T=T, H=H, HV=HV, K=D, V=D, dtype=jnp.bfloat16, qk_l2norm=True)[:5]
    do = jnp.asarray(rng.standard_normal((1, T, HV, D)), jnp.bfloat16)
    return cu, args, do


@pytest.mark.parametrize("segments", (1, 2))
@pytest.mark.parametrize("exchange", ("a2a", "ring"))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("W", (2, 4, 8))
def test_cp_on_gpus_matches_one_gpu(rng, W, layout, exchange, segments):
    devs = gpus(W)
    cu, args, do = inputs(rng, layout, W)
    ro, rgrads = run_one_device(devs[0], cu, args, do, backend="cuda", qk_l2norm=True)
    out = {}
    for mode, det in (("light", True), ("full", True), ("light", False)):
        out[mode, det] = run_kcp(devs, layout, cu, args, do, backend="cuda", qk_l2norm=True,
                                 exchange=exchange, segments=segments, save_mode=mode,
                                 deterministic=det)
    (o, grads), (o_full, grads_full) = out["light", True], out["full", True]
    # o: both modes emit it from the same walk kernel (full's also stores the tapes), bit for bit
    # on one H200 (test_cuda_fwd "walk_output_tapes.o"); gradients bitwise (deterministic=True:
    # fixed-order GVA group sums)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_full), err_msg="light vs full o")
    for n, a, b in zip(NAMES, grads, grads_full):
        np.testing.assert_array_equal(a, b, err_msg=f"light vs full d{n}")
    for key, (o_k, grads_k) in out.items():
        errs = {"o": rel_rms(o_k, ro),
                **{n: rel_rms(a, b) for n, a, b in zip(NAMES, grads_k, rgrads)}}
        finite = [np.isfinite(np.asarray(x, np.float32)).all() for x in [o_k, *grads_k]]
        print(f"W={W} {layout} {exchange} P={segments} {key}: " +
              " ".join(f"{n} {e:.1e}" for n, e in errs.items()))
        assert all(finite), (key, finite)
        assert all(e <= TOL for e in errs.values()), (key, errs)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("W", (2, 4, 8))
def test_cp_short_conv_on_gpus(rng, W, layout):
    devs = gpus(W)
    C = 3 * 256
    cu = docs_for(layout, W, T, rng)
    x = jnp.asarray(rng.standard_normal((1, T, C)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((C, 4)) * 0.5, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((1, T, C)), jnp.bfloat16)
    ref = run_conv_one_device(devs[0], cu, x, w, dy)
    got = run_conv_kcp(devs, layout, cu, x, w, dy)
    for name, a, b in zip(("y", "dx", "dw"), got, ref):
        assert rel_rms(a, b) <= TOL, (name, rel_rms(a, b))


_POISON_CHECK = textwrap.dedent("""
    import os, sys
    import numpy as np, jax, jax.numpy as jnp
    sys.path.insert(0, os.path.dirname({here!r}))
    from test_multi_gpu import inputs
    from kcp_harness import LAYOUTS, run_kcp
    assert os.environ["JAX_CAKE_GDN_POISON"] == "1"
    W = {W}
    devs = jax.devices("cuda")[:W]
    rng = np.random.default_rng(3)
    for layout in LAYOUTS:
        for exchange, segments in (("a2a", 2), ("ring", 1)):
            cu, args, do = inputs(rng, layout, W)
            o, grads = run_kcp(devs, layout, cu, args, do, backend="cuda", qk_l2norm=True,
                               exchange=exchange, segments=segments)
            for x in [o, *grads]:
                assert np.isfinite(np.asarray(x, np.float32)).all(), (layout, exchange)
    print("OK")
""")


@pytest.mark.parametrize("W", (2, 4, 8))
def test_cp_on_gpus_finite_under_poison(W):
    gpus(W)
    run_python(_POISON_CHECK.format(here=os.path.abspath(__file__), W=W), poison=True,
               timeout=900)
