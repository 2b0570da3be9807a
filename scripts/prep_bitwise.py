"""Bitwise check of the cuda prep kernel across two builds (GPU host).

    python scripts/prep_bitwise.py dump OUT.npz      # A, w, u of the cuda prep (and wy) here
    python scripts/prep_bitwise.py compare A.npz B.npz

Run `dump` on the build before a prep change and on the build after it, then `compare`: every
array must be bitwise equal (prep's kernel changes keep the bf16 roundings and mma order). Inputs
are fixed (seeded), ragged documents so padding rows and partial chunks occur; every K, V, dtype
and the rstd / no-rstd paths the kernel is instantiated for.
"""
from __future__ import annotations

import sys

import numpy as np

CONFIGS = [  # name, H, HV, K, V, dtype, l2norm
    ("bf16_k128_v128_gva_l2", 4, 12, 128, 128, "bfloat16", True),
    ("bf16_k128_v64", 2, 2, 128, 64, "bfloat16", False),
    ("bf16_k64_v128_l2", 2, 4, 64, 128, "bfloat16", True),
    ("bf16_k64_v64", 2, 2, 64, 64, "bfloat16", False),
    ("f32_k128_v128_l2", 2, 4, 128, 128, "float32", True),
    ("f32_k64_v64", 2, 2, 64, 64, "float32", False),
]
DOCS = [700, 64, 1, 129, 2000, 63]


def dump(path):
    import jax
    import jax.numpy as jnp

    from jax_cake_gdn.chunks import chunk_table
    from jax_cake_gdn.primitives import cuda as C
    out = {}
    for i, (name, H, HV, K, V, dtype, l2) in enumerate(CONFIGS):
        rng = np.random.default_rng(1234 + i)
        cu = np.concatenate([[0], np.cumsum(DOCS)]).astype(np.int32)
        T = int(cu[-1])
        s = 1.0 if l2 else K**-0.5
        k = jnp.asarray(rng.standard_normal((T, H, K)) * s, dtype)
        v = jnp.asarray(rng.standard_normal((T, HV, V)), dtype)
        g = jnp.asarray(-rng.uniform(0.01, 0.3, (T, HV)), jnp.float32)
        beta = jnp.asarray(rng.uniform(0.1, 0.95, (T, HV)), jnp.float32)

        @jax.jit
        def run(k, v, g, beta, cu):
            ct = chunk_table(cu, T)
            rk = C.l2norm_rstd(k) if l2 else None
            G = C.gate_cumsum(g, ct.start, ct.length)
            A, w, u = C.prep(k, v, beta, G, rk, ct.start, ct.length)
            wy, uy = C.wy(k, v, beta, G, A, rk, ct.start, ct.length)
            return A, w, u, wy, uy

        for key, x in zip(("A", "w", "u", "wy.w", "wy.u"), run(k, v, g, beta, jnp.asarray(cu))):
            x = np.asarray(x)  # raw bits (A and w are bf16, u f32): unsigned ints of their width
            out[f"{name}.{key}"] = x.view(f"u{x.dtype.itemsize}")
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
    if len(sys.argv) == 3 and sys.argv[1] == "dump":
        dump(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(0 if compare(sys.argv[2], sys.argv[3]) else 1)
    else:
        sys.exit(__doc__)
