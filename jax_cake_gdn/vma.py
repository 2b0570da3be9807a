"""Varying manual axes (vma) under jax.shard_map: read them, and make values carry them.

Inside shard_map with check_vma=True every value's type says over which mesh axes it varies.
Scan carries, ffi_call results and fresh constants must carry the union of their inputs' axes,
else tracing fails (scan) or gradients are silently wrong (ffi_call).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def of(x) -> frozenset:
    """The varying manual axes of x (empty outside shard_map)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax 0.11: ManualAxisType
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def union(*xs) -> frozenset:
    return frozenset().union(*(of(x) for x in xs))


def cast(x, axes: frozenset):
    """x, made to vary over `axes` as well."""
    missing = tuple(sorted(axes - of(x), key=str))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def zeros(shape, dtype, *like):
    """Zeros that vary over the union of `like`'s axes."""
    return cast(jnp.zeros(shape, dtype), union(*like))
