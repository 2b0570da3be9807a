"""Bitwise check of the op across two builds (GPU host).

    python scripts/bitwise_builds.py dump OUT.npz [--base]    # gdn's results with this build
    python scripts/bitwise_builds.py compare A.npz B.npz

Run `dump` with the build before a kernel change that claims to keep every bit (the same roundings
and product order) and with the build after it, then `compare`: every array must be bitwise equal.
`--base` dumps with the baseline copy that `python -m benchmarks.baseline REV --dest DIR` built
($JCG_BASELINE=DIR), so one checkout holds both builds. Inputs are fixed (seeded): ragged documents
(padding rows, partial chunks), GVA, L2 norm on and off, bf16 and f32, K, V = 128 and 64; per config
the light forward's o and final states, and deterministic fwd+bwd gradients in both save modes.
"""
from __future__ import annotations

import os
import sys

import numpy as np

CONFIGS = [  # name, H, HV, K, V, dtype, l2norm
    ("bf16_k128_v128_gva_l2", 4, 12, 128, 128, "bfloat16", True),
    ("bf16_k128_v64", 2, 2, 128, 64, "bfloat16", False),
    ("bf16_k64_v128_l2", 2, 4, 64, 128, "bfloat16", True),
    ("f32_k128_v128_l2", 2, 4, 128, 128, "float32", True),
    ("f32_k64_v64", 2, 2, 64, 64, "float32", False),
]
DOCS = [700, 64, 1, 129, 2000, 63]


def dump(path, base=False):
    import jax
    import jax.numpy as jnp

    if base:  # the baseline copy (benchmarks/baseline.py), from the repository root
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from benchmarks.baseline import load

        lib, rev = load()
        gdn = lib.gdn
        print(f"baseline {rev}", flush=True)
    else:
        from jax_cake_gdn import gdn

    out = {}
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(DOCS)]), jnp.int32)
    T, N = int(cu[-1]), len(DOCS)
    for i, (name, H, HV, K, V, dtype, l2) in enumerate(CONFIGS):
        rng = np.random.default_rng(1234 + i)
        s = 1.0 if l2 else K**-0.5
        q, k = (jnp.asarray(rng.standard_normal((1, T, H, K)) * s, dtype) for _ in range(2))
        v = jnp.asarray(rng.standard_normal((1, T, HV, V)), dtype)
        g = jnp.asarray(-rng.uniform(0.01, 0.3, (1, T, HV)), jnp.float32)
        beta = jnp.asarray(rng.uniform(0.1, 0.95, (1, T, HV)), jnp.float32)
        h0 = jnp.asarray(0.1 * rng.standard_normal((N, HV, K, V)), jnp.float32)
        do = jnp.asarray(rng.standard_normal((1, T, HV, V)), dtype)
        dfin = jnp.asarray(rng.standard_normal((N, HV, K, V)), jnp.float32)

        def op(q, k, v, g, beta, h0, mode):
            return gdn(q, k, v, g, beta, cu_seqlens=cu, qk_l2norm=l2, initial_state=h0,
                       output_final_state=True, save_mode=mode, deterministic=True,
                       backend="cuda")

        o, fin = jax.jit(lambda *a: op(*a, "light"))(q, k, v, g, beta, h0)
        res = {"o": o, "final": fin}
        for mode in ("light", "full"):
            def loss(*a, mode=mode):
                o, fin = op(*a, mode)
                return (jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
                        + jnp.sum(fin * dfin))

            grads = jax.jit(jax.grad(loss, argnums=tuple(range(6))))(q, k, v, g, beta, h0)
            for n, x in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads):
                res[f"{mode}.{n}"] = x
        for key, x in res.items():
            x = np.asarray(x)  # raw bits: unsigned ints of the element's width
            out[f"{name}.{key}"] = x.view(f"u{x.dtype.itemsize}")
        print(f"[{i + 1}/{len(CONFIGS)}] {name}: {len(res)} arrays", flush=True)
    np.savez(path, **out)
    print(f"wrote {len(out)} arrays to {path}")


def compare(a_path, b_path):
    a, b = np.load(a_path), np.load(b_path)
    bad = 0
    for key in sorted(set(a.files) | set(b.files)):
        if key not in a.files or key not in b.files:
            print(f"{key}: missing in one file")
            bad += 1
            continue
        x, y = a[key], b[key]
        same = x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y)
        if not same:
            nd = int(np.sum(x != y)) if x.shape == y.shape and x.dtype == y.dtype else -1
            print(f"{key}: DIFFERS ({nd} elements)")
            bad += 1
    print("bitwise equal" if bad == 0 else f"{bad} arrays differ")
    return bad == 0


if __name__ == "__main__":
    if len(sys.argv) in (3, 4) and sys.argv[1] == "dump" and sys.argv[3:] in ([], ["--base"]):
        dump(sys.argv[2], base=sys.argv[3:] == ["--base"])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(0 if compare(sys.argv[2], sys.argv[3]) else 1)
    else:
        sys.exit(__doc__)
