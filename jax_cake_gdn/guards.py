"""NaN guards for traced document bounds that break the rules: never a silently wrong number."""

from __future__ import annotations

import functools

import jax

from .checks import bounds_ok
from .primitives import Primitives


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def nan_unless(prims: Primitives, x, ok):
    """x, or NaN everywhere when the bool scalar ok is False (cuda: in place, one launch instead
    of a pass over x). The cotangent passes through: `nan_grads_unless` on the inputs poisons
    the gradients instead."""
    return prims.nan_unless(x, ok)


def _nan_unless_fwd(prims, x, ok):
    return prims.nan_unless(x, ok), None


def _nan_unless_bwd(prims, _, dx):
    return dx, None


nan_unless.defvjp(_nan_unless_fwd, _nan_unless_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def nan_grads_unless(prims: Primitives, xs, ok):
    """xs as they are; their cotangents NaN everywhere when the bool scalar ok is False."""
    return xs


def _nan_grads_unless_fwd(prims, xs, ok):
    return xs, ok


def _nan_grads_unless_bwd(prims, ok, dxs):
    return jax.tree.map(lambda d: prims.nan_unless(d, ok), dxs), None


nan_grads_unless.defvjp(_nan_grads_unless_fwd, _nan_grads_unless_bwd)


def bounds_guard(prims: Primitives, cu_seqlens, T, multiple: int = 1):
    """(guard_inputs, guard_outputs) for traced cu_seqlens that may break the rules
    (checks.bounds_ok): every output becomes NaN everywhere and so do the inputs' gradients.
    Both are the identity when the bounds are concrete (checked on the host)."""
    ok = None if cu_seqlens is None else bounds_ok(cu_seqlens, T, multiple)
    if ok is None:
        return (lambda xs: xs), (lambda outs: outs)
    return ((lambda xs: nan_grads_unless(prims, xs, ok)),
            (lambda outs: jax.tree.map(lambda o: nan_unless(prims, o, ok), outs)))
