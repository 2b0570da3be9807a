"""Sharded calls of gdn and short_conv: batch and head axes split over devices, no collectives.

The ops work on whole rows and whole heads, so arguments sharded over the batch or the heads need
no communication: every device runs the op on its block. Each op describes the axes of its
arguments and results with factor strings in the notation of Shardy's sharding rules (`Rule`):

  b      batch rows: split freely.
  h      heads (gdn's q/k heads, short_conv's channels): split freely. "(h r)" are gdn's value
         heads, HV = H * r: they split with h, so a GVA group (the r value heads reading one q/k
         head) stays on one device.
  t      tokens: never split here. A sharded token axis is a ValueError that names gdn_kcp, the
         context-parallel op.
  other  kept whole on every device (an argument sharded there is gathered first).

The mechanism depends on the kind of mesh axis (jax.sharding.AxisType):

  Explicit  the shardings are in the argument types: the op runs inside jax.shard_map, split
            over the axes that shard b and h, so the lowered program (the cuda custom calls
            included) holds per-device shapes. An argument sharded differently from the op's
            choice (the first argument that splits a factor sets its axes) is resharded first.
  Auto      the shardings exist only after XLA's sharding propagation, so the op is a
            custom_partitioning call carrying the Shardy rule; the partitioner runs the per-device
            op on each block. Its backward is a second such call that recomputes the forward's
            residuals on each device, since their per-device shapes are unknown while tracing
            (gdn: the gate cumsum, L2 norm, A and any segment transfer run again; the walk's
            outputs are unused there and dropped by XLA). Checkpoint names inside are not seen
            by remat policies outside.
  Manual    (inside the caller's jax.shard_map) the arrays are already per device. Axes the
            caller's shard_map leaves are handled as Explicit ones, by a shard_map nested in
            the caller's, whose backward recomputes the residuals as on Auto axes (jax 0.11.2
            cannot lower a nested shard_map's own residuals).

A mesh mixing Explicit and Auto axes, or Auto axes that a caller's shard_map leaves, splits over
the Explicit axes only: the op runs replicated over the Auto ones (arguments sharded there are
gathered first), inside a jax.shard_map manual over every axis.
"""

from __future__ import annotations

import math
import re
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["Rule", "call"]

SPLIT = ("b", "h")  # the factors a device's block may hold part of
TOKENS = "t"


class Rule(NamedTuple):
    """The factors of one op call. `ins` maps argument name -> factor string (present arguments
    only), `outs` holds one factor string per result, `sizes` the sizes of compound factors'
    minor parts ({"r": HV // H}); `op` and `labels` (factor -> what it counts) word messages."""

    op: str
    ins: dict
    outs: tuple
    sizes: dict = {}
    labels: dict = {}


def _dims(factors: str) -> list[tuple[str, ...]]:
    """"b t (h r) d" -> [("b",), ("t",), ("h", "r"), ("d",)]."""
    return [tuple(d.strip("()").split()) for d in re.findall(r"\([^)]*\)|\S+", factors)]


def _axes(entry) -> tuple[str, ...]:
    """A PartitionSpec entry as a tuple of mesh axis names."""
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _mesh(args: dict):
    """The (abstract) mesh of the arguments' types, else the context's."""
    for x in args.values():
        mesh = getattr(jax.typeof(x).sharding, "mesh", None)
        if mesh is not None and not mesh.empty:
            return mesh
    return jax.sharding.get_abstract_mesh()


def _token_error(rule: Rule, name: str, axes) -> ValueError:
    return ValueError(
        f"{rule.op}: the token axis of {name} is sharded over mesh axes {tuple(axes)}; {rule.op} "
        f"needs every sequence whole on one device (batch and heads may be sharded). For a "
        f"sequence split over devices (context parallelism) call gdn_kcp (and short_conv with "
        f"axis_name) inside jax.shard_map.")


def _split_axes(rule: Rule, specs: dict, shapes: dict, sizes: dict, *, strict: bool) -> dict:
    """{factor: mesh axes} for the split factors, from the arguments' specs (the first argument
    that splits a factor sets its axes). strict (Explicit types): an indivisible split is a
    ValueError; otherwise (Auto) that factor stays whole."""
    chosen, source = {}, {}
    for name, factors in rule.ins.items():
        for i, dim in enumerate(_dims(factors)):
            axes = _axes(specs[name][i])
            if dim[0] == TOKENS and axes:
                raise _token_error(rule, name, axes)
            if dim[0] in SPLIT and axes and dim[0] not in chosen:
                chosen[dim[0]], source[dim[0]] = axes, (name, i)
    for f, axes in list(chosen.items()):
        name, i = source[f]
        dim = _dims(rule.ins[name])[i]
        whole = shapes[name][i] // math.prod(rule.sizes.get(m, 1) for m in dim[1:])
        n = math.prod(sizes[a] for a in axes)
        if whole % n and strict:
            raise ValueError(f"{rule.op}: {name} is sharded over mesh axes {axes} ({n} devices), "
                             f"which must divide its {rule.labels.get(f, f)} ({whole})")
        if whole % n:
            del chosen[f]
    return chosen


def _padded(spec, ndim: int) -> tuple:
    return tuple(spec) + (None,) * (ndim - len(spec))


def _spec(factors: str, chosen: dict) -> P:
    return P(*[(chosen.get(d[0]) or None) for d in _dims(factors)])


# ------------------------------------------------------------------------------------------------
# Explicit axes, and what a caller's shard_map leaves: jax.shard_map
# ------------------------------------------------------------------------------------------------


def _manual(local: Callable, rule: Rule, args: dict, mesh):
    explicit = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
    specs = {n: tuple(tuple(a for a in _axes(e) if a in explicit) or None
                      for e in _padded(jax.typeof(x).sharding.spec, x.ndim))
             for n, x in args.items()}
    shapes = {n: tuple(x.shape) for n, x in args.items()}
    chosen = _split_axes(rule, specs, shapes, dict(mesh.shape), strict=True)
    in_specs = {n: _spec(f, chosen) for n, f in rule.ins.items()}
    args = {n: (x if specs[n] == _padded(in_specs[n], x.ndim) else
                jax.sharding.reshard(x, NamedSharding(mesh, in_specs[n])))
            for n, x in args.items()}
    # manual over every axis not yet manual, replicated over those it does not split: a partly
    # manual body with Auto axes left trips jnp.searchsorted (jax 0.11.2)
    axes = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual}

    def mapped(fn, in_factors, out_factors, sums=False):
        return jax.shard_map(_summed(fn, _lost(chosen, out_factors) if sums else None),
                             mesh=mesh, in_specs=tuple(_spec(f, chosen) for f in in_factors),
                             out_specs=tuple(_spec(f, chosen) for f in out_factors),
                             axis_names=axes)

    if AxisType.Manual not in mesh.axis_types:  # JAX differentiates the shard_map
        return mapped(lambda *xs: local(dict(zip(args, xs))), list(rule.ins.values()),
                      list(rule.outs))(*args.values())
    # nested in the caller's shard_map, whose residuals jax 0.11.2 cannot lower
    return _recomputing(mapped, local, rule, args)


# ------------------------------------------------------------------------------------------------
# Auto axes: custom_partitioning with the Shardy rule
# ------------------------------------------------------------------------------------------------


def _shardy_rule(ins: list[str], outs: list[str], sizes: dict):
    """(rule string, factor sizes, need_replication factors in order of first appearance)."""
    text = ", ".join(ins) + " -> " + ", ".join(outs)
    order = list(dict.fromkeys(f for s in ins + outs for d in _dims(s) for f in d))
    keep = tuple(f for f in order if f not in SPLIT and f != TOKENS)
    return text, {f: s for f, s in sizes.items() if f in order}, keep


def _partitioned(rule: Rule):
    """The per-device call maker of `_recomputing` for Auto axes: custom_partitioning of fn
    (flat arrays in, flat tuple out), split over the axes that XLA's propagation gave b and h."""

    def partitioned(fn, in_factors: list[str], out_factors: list[str], sums: bool = False):
        names = [f"arg {i}" for i in range(len(in_factors))]
        sub = rule._replace(ins=dict(zip(names, in_factors)), outs=tuple(out_factors))
        op = custom_partitioning(jax.jit(fn))  # (jit: the traced body must hold no constants)

        def partition(mesh, arg_shapes, result_shape):
            chosen = {}  # without NamedShardings there are no axes to name: whole per device
            if all(isinstance(a.sharding, NamedSharding) for a in arg_shapes):
                specs = {n: _padded(a.sharding.spec, len(a.shape))
                         for n, a in zip(names, arg_shapes)}
                shapes = {n: tuple(a.shape) for n, a in zip(names, arg_shapes)}
                chosen = _split_axes(sub, specs, shapes, dict(mesh.shape), strict=False)
            named = lambda f: NamedSharding(mesh, _spec(f, chosen))
            return (mesh, _summed(fn, _lost(chosen, out_factors) if sums else None),
                    tuple(named(f) for f in out_factors), tuple(named(f) for f in in_factors))

        text, sizes, keep = _shardy_rule(in_factors, out_factors, rule.sizes)
        op.def_partition(partition, sharding_rule=text, need_replication_factors=keep, **sizes)
        return op

    return partitioned


# ------------------------------------------------------------------------------------------------
# Shared: per-device sums, and a backward that recomputes the forward per device
# ------------------------------------------------------------------------------------------------


def _lost(chosen: dict, out_factors: list[str]) -> list[tuple[str, ...]]:
    """Per result, the mesh axes of the split factors it lacks."""
    return [tuple(a for f, axes in chosen.items() if f not in {x for d in _dims(o) for x in d}
                  for a in axes) for o in out_factors]


def _summed(fn: Callable, lost) -> Callable:
    """fn, its results summed over their lost axes (gradients of arguments replicated there)."""
    if not lost or not any(lost):
        return fn
    return lambda *xs: tuple(jax.lax.psum(y, axes) if axes else y for y, axes in zip(fn(*xs), lost))


def _recomputing(per_device: Callable, local: Callable, rule: Rule, args: dict):
    """local on each device's block through `per_device(fn, in_factors, out_factors, sums)`
    (a call maker), differentiated by a custom_vjp whose backward is a second such call that
    recomputes local's residuals on each device: only the inputs cross from forward to
    backward."""
    names = list(args)
    in_factors = [rule.ins[n] for n in names]
    diff = [n for n in names if jnp.issubdtype(args[n].dtype, jnp.inexact)]
    flat = lambda xs: tuple(local(dict(zip(names, xs))))
    fwd_op = per_device(lambda *xs: flat(xs), in_factors, list(rule.outs))

    def bwd_fn(*xs_cts):
        fixed = dict(zip(names, xs_cts[:len(names)]))
        _, pull = jax.vjp(lambda *d: flat([dict(fixed, **dict(zip(diff, d)))[n] for n in names]),
                          *[fixed[n] for n in diff])
        return tuple(pull(tuple(xs_cts[len(names):])))

    bwd_op = per_device(bwd_fn, in_factors + list(rule.outs), [rule.ins[n] for n in diff],
                        sums=True)

    @jax.custom_vjp
    def op(*xs):
        return fwd_op(*xs)

    def op_fwd(*xs):
        return fwd_op(*xs), xs

    def op_bwd(xs, cts):
        grads = dict(zip(diff, bwd_op(*xs, *cts)))
        return tuple(grads.get(n) for n in names)

    op.defvjp(op_fwd, op_bwd)
    return op(*args.values())


# ------------------------------------------------------------------------------------------------


def call(local: Callable, rule: Rule, args: dict) -> tuple:
    """local(args) -> tuple of results, run per device on blocks split over b and h.

    `local` is the op on one device's arrays (any shapes the factors allow); `args` holds the
    present arguments by name (the keys of rule.ins). Costs nothing beyond local's own work
    where the arguments are sharded as the op splits them (module docstring)."""
    mesh = _mesh(args)
    # an Explicit axis counts even of size 1: the arrays' types carry it, and the local op
    # mixing them with unsharded arrays would be a sharding type error
    kinds = {t for s, t in zip(mesh.axis_sizes, mesh.axis_types)
             if s > 1 or t == AxisType.Explicit}
    if kinds <= {AxisType.Manual}:
        return local(args)
    if kinds == {AxisType.Auto} and AxisType.Manual not in mesh.axis_types:
        return _recomputing(_partitioned(rule), local, rule, args)
    return _manual(local, rule, args, mesh)
