"""Smoke test of an installed jax-cake-gdn wheel (run by scripts/check_wheel.sh in a fresh venv).

Imports the package from site-packages (never from a source tree), checks the installed metadata
and py.typed, runs a jitted `gdn` forward and backward on the CPU with packed documents and
compares o with the float64 reference, and checks whether the CUDA extension is there as
expected. Prints one line starting with "wheel check: OK" (exit 0) or raises.

    python -I scripts/wheel_smoke.py --expect-cuda {yes,no} --wheel NAME
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import sysconfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--expect-cuda", choices=("yes", "no"), required=True,
                    help="whether jax_cake_gdn._cuda must import (yes) or be absent (no)")
    ap.add_argument("--wheel", default="?", help="the wheel's file name, for the report line")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_cake_gdn
    from jax_cake_gdn import gdn
    from jax_cake_gdn.primitives import cuda
    from jax_cake_gdn.reference import gdn_reference

    # 1. imported from this venv's site-packages, with the wheel's metadata
    pkg_dir = os.path.dirname(os.path.abspath(jax_cake_gdn.__file__))
    site = os.path.realpath(sysconfig.get_paths()["purelib"])
    plat = os.path.realpath(sysconfig.get_paths()["platlib"])
    assert os.path.realpath(pkg_dir).startswith((site, plat)), \
        f"jax_cake_gdn imported from {pkg_dir}, not from this venv's site-packages {site}"
    dist = importlib.metadata.distribution("jax-cake-gdn")
    assert dist.version == jax_cake_gdn.__version__, (dist.version, jax_cake_gdn.__version__)
    assert dist.metadata["License-Expression"] == "MIT", dist.metadata["License-Expression"]
    assert os.path.isfile(os.path.join(pkg_dir, "py.typed")), "py.typed missing from the wheel"

    # 2. gdn on the CPU: 3 documents (one shorter than a chunk), GVA, L2 norm, f32 for a tight check
    assert jax.default_backend() == "cpu", jax.default_backend()
    T, H, HV, K, V = 200, 2, 4, 32, 32
    ks = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(ks[0], (1, T, H, K), jnp.float32)
    k = jax.random.normal(ks[1], (1, T, H, K), jnp.float32)
    v = jax.random.normal(ks[2], (1, T, HV, V), jnp.float32)
    g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (1, T, HV)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, T, HV)))
    cu = jnp.array([0, 37, 150, T], jnp.int32)

    @jax.jit
    def loss(q, k, v, g, beta, cu):
        o = gdn(q, k, v, g, beta, cu_seqlens=cu, qk_l2norm=True)
        return jnp.sum(o * o), o

    (val, o), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(
        q, k, v, g, beta, cu)
    o_ref, _ = gdn_reference(q, k, v, g, beta, cu_seqlens=np.asarray(cu), qk_l2norm=True)
    err = float(np.linalg.norm(np.asarray(o, np.float64) - o_ref) / np.linalg.norm(o_ref))
    assert err < 1e-4, f"gdn o vs the float64 reference: relative error {err:.2e}"
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in grads), "non-finite gradient"
    assert np.isfinite(float(val))

    # 3. the CUDA extension: present in a wheel built with nvcc, absent from the pure wheel
    has_ext = cuda.available()
    if args.expect_cuda == "yes":
        assert has_ext, f"expected jax_cake_gdn._cuda in this wheel: {cuda.unavailable_reason()}"
        ext = "cuda extension: imports (the xla backend ran: no GPU here)"
    else:
        assert not has_ext, "this wheel must not carry jax_cake_gdn._cuda"
        ext = "cuda extension: absent (pure Python, as expected)"

    print(f"wheel check: OK {args.wheel}: jax_cake_gdn {jax_cake_gdn.__version__} from {pkg_dir} "
          f"(python {sys.version.split()[0]}, jax {jax.__version__}): gdn fwd+bwd on cpu, "
          f"o {tuple(o.shape)} rel err vs f64 reference {err:.1e}, grads finite; {ext}", flush=True)


if __name__ == "__main__":
    main()
