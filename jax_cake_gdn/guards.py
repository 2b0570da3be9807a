"""Guards on input the ops cannot take as it is: never a silently wrong number, never a late crash.

- Traced document bounds that break the rules: NaN outputs and NaN gradients (`bounds_guard`).
- Decays stronger than DECAY_FLOOR: clamped to it, a reset to 2e-9 of the state (`floor_decay`).
- backend="cuda" compiled for a platform other than CUDA: an error while compiling
  (`cuda_only`), where the FFI calls would fail only at run time.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from .checks import bounds_ok
from .primitives import Primitives

# The lowest log decay the ops use: exp(-20) < 2.1e-9, so a stronger decay already resets the
# state to float32 precision, while a huge term in the chunk's f32 cumulative sum of g would
# swamp its neighbours (unclamped, g = -1e6 cost 1e-2 relative error and g = -inf gave NaN).
DECAY_FLOOR = -20.0


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


def nan_guard(prims: Primitives, ok):
    """(guard_inputs, guard_outputs) for a bool scalar ok (None: both the identity): when ok is
    False every output becomes NaN everywhere and so do the gradients of the guarded inputs."""
    if ok is None:
        return (lambda xs: xs), (lambda outs: outs)
    return ((lambda xs: nan_grads_unless(prims, xs, ok)),
            (lambda outs: jax.tree.map(lambda o: nan_unless(prims, o, ok), outs)))


def bounds_guard(prims: Primitives, cu_seqlens, T, multiple: int = 1):
    """`nan_guard` for traced cu_seqlens that may break the rules (checks.bounds_ok); the
    identity for concrete bounds (checked on the host) and for none."""
    return nan_guard(prims, None if cu_seqlens is None else bounds_ok(cu_seqlens, T, multiple))


@jax.custom_vjp
def floor_decay(g):
    """max(g, DECAY_FLOOR): a decay stronger than the floor acts as a reset, with zero gradient
    there; NaN stays NaN. One elementwise pass over g; the backward keeps the bool mask
    (checkpoint name `gdn_g_floor`, one byte per token and value head)."""
    return jnp.maximum(g, jnp.asarray(DECAY_FLOOR, g.dtype))


def _floor_fwd(g):
    return floor_decay(g), checkpoint_name(g < DECAY_FLOOR, "gdn_g_floor")


def _floor_bwd(below, dg):
    return (jnp.where(below, jnp.zeros_like(dg), dg),)


floor_decay.defvjp(_floor_fwd, _floor_bwd)


# cuda_only's primitive: the identity, lowered for CUDA alone
_cuda_only_p = Primitive("jax_cake_gdn_cuda_only")
_cuda_only_p.def_abstract_eval(lambda x: x)
_cuda_only_p.def_impl(lambda x: jax.jit(_cuda_only_p.bind)(x))  # eager: compile it too
batching.primitive_batchers[_cuda_only_p] = lambda xs, dims: (_cuda_only_p.bind(*xs), dims[0])
mlir.register_lowering(_cuda_only_p, lambda ctx, x: [x], platform="cuda")


def _not_cuda(ctx, x):
    raise ValueError(
        f"backend='cuda' runs CUDA kernels, but this computation is compiled for "
        f"{', '.join(ctx.module_context.platforms)} (no CUDA GPU holds its arrays): use "
        "backend='xla', or backend=None, which picks xla where no GPU is visible. Lowering for a "
        "GPU elsewhere (jax.jit(f).trace(...).lower(lowering_platforms=('cuda',))) works on any "
        "host.")


mlir.register_lowering(_cuda_only_p, _not_cuda)


def cuda_only(bounds):
    """bounds (an int array) unchanged, in a program that compiles for CUDA only: the cuda ops
    pass their document bounds through it, so compiling them for another platform raises a
    ValueError that says what to use instead (the FFI calls would fail only at run time)."""
    return _cuda_only_p.bind(jnp.asarray(bounds))
