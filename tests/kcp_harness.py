"""Runs gdn_kcp and the CP short conv under jax.shard_map over a list of devices (CPU host
devices in test_kcp.py, GPUs in test_multi_gpu.py) and returns results in global token order."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cake_gdn as J

AX = "cp"
NAMES = ("q", "k", "v", "g", "beta")
LAYOUTS = ("contiguous", "zigzag", "doc_zigzag")


def docs_for(layout, W, T, rng):
    """Uneven documents: some cross ranks, some start and end inside one rank (for doc_zigzag each
    length is a multiple of 2W), and an empty one (repeated bound)."""
    unit = 2 * W if layout == "doc_zigzag" else 1
    n = T // unit
    cuts = np.sort(rng.choice(np.arange(1, n), size=4, replace=False)) * unit
    cuts[0] = unit  # a one-unit document first
    return np.concatenate([[0], cuts, [cuts[-1]], [T]]).astype(np.int32)


@functools.lru_cache(maxsize=None)
def mesh(devices):
    return jax.make_mesh((len(devices),), (AX,), devices=list(devices))


def _placement(devices, layout, cu):
    """(mesh, lay, back, cu): `lay` puts a global [1, T, ...] array in layout order, sharded over
    the ranks; `back` returns a rank-sharded result to global token order on the host."""
    devices = tuple(devices)
    W, m = len(devices), mesh(devices)
    tok = NamedSharding(m, P(None, AX))
    cu_j = jnp.asarray(cu)
    lay = lambda x: jax.device_put(J.to_layout(np.asarray(x), cu_j, layout, W), tok)
    back = lambda x: np.asarray(J.from_layout(np.asarray(x), cu_j, layout, W))
    return m, lay, back, cu_j


def run_kcp(devices, layout, cu, args, do, *, backend="xla", **kw):
    """(o, grads) of sum(o * do) through gdn_kcp over `devices`, in global token order."""
    m, lay, back, cu_j = _placement(devices, layout, cu)
    rep = NamedSharding(m, P())

    def local(q, k, v, g, beta, cu, do):
        f = lambda *a: J.gdn_kcp(*a, cu_seqlens=cu, axis_name=AX, layout=layout,
                                 backend=backend, **kw)
        o, pull = jax.vjp(f, q, k, v, g, beta)
        return o, pull(do.astype(o.dtype))

    fn = jax.jit(jax.shard_map(local, mesh=m, in_specs=(P(None, AX),) * 5 + (P(), P(None, AX)),
                               out_specs=(P(None, AX), (P(None, AX),) * 5)))
    o, grads = fn(*[lay(x) for x in args], jax.device_put(cu_j, rep), lay(do))
    return back(o), [back(x) for x in grads]


def run_one_device(device, cu, args, do, *, backend="xla", **kw):
    """(o, grads) of sum(o * do) through gdn on one device."""
    put = lambda x: jax.device_put(x, device)
    f = lambda *a: J.gdn(*a, cu_seqlens=put(jnp.asarray(cu)), backend=backend, **kw)
    o, pull = jax.vjp(f, *[put(x) for x in args])
    return np.asarray(o), [np.asarray(x) for x in pull(put(do).astype(o.dtype))]


def run_conv_kcp(devices, layout, cu, x, w, dy):
    """(y, dx, dw) of the CP short conv over `devices`, in global token order."""
    m, lay, back, cu_j = _placement(devices, layout, cu)
    rep = NamedSharding(m, P())

    def local(x, w, cu, dy):
        y, pull = jax.vjp(lambda x, w: J.short_conv(x, w, cu_seqlens=cu, axis_name=AX,
                                                    layout=layout), x, w)
        return (y, *pull(dy))  # dw of a replicated weight is summed over ranks by JAX

    fn = jax.jit(jax.shard_map(local, mesh=m, in_specs=(P(None, AX), P(), P(), P(None, AX)),
                               out_specs=(P(None, AX), P(None, AX), P())))
    y, dx, dw = fn(lay(x), jax.device_put(w, rep), jax.device_put(cu_j, rep), lay(dy))
    return back(y), back(dx), np.asarray(dw)


def run_conv_one_device(device, cu, x, w, dy):
    put = lambda a: jax.device_put(a, device)
    y, pull = jax.vjp(lambda x, w: J.short_conv(x, w, cu_seqlens=put(jnp.asarray(cu))),
                      put(x), put(w))
    dx, dw = pull(put(dy))
    return np.asarray(y), np.asarray(dx), np.asarray(dw)
