"""saved_layout for gdn_kcp: the residuals JAX keeps on each rank, read off the traced backward.

Shapes are static per rank, so every rank keeps the same set. Entries come from JAX's own residual
analysis of `jax.vjp(gdn_kcp)` under an abstract mesh: named ones carry their checkpoint name
(`gdn_*`), others the operation and source line that produced them.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.ad_checkpoint import saved_residuals  # public only as print_saved_residuals
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..checks import check_cu_seqlens
from .gdn_kcp import gdn_kcp
from .layout import check_layout

_AXIS = "kcp"


def _name(desc: str) -> str:
    m = re.search(r"named '([^']+)'", desc)
    if m:
        return m.group(1)
    m = re.search(r"(output of [^ ]+(?: function '[^']+')?) from .*?([\w]+\.py:\d+)", desc)
    return f"{m.group(1)} ({m.group(2)})" if m else desc


def saved_layout_kcp(q, k, v, g, beta, *, cu_seqlens, num_ranks: int, layout="contiguous",
                     exchange="a2a", save_mode="full", segments=None, num_docs=None,
                     scale=None, qk_l2norm=False, backend=None, A_log=None, dt_bias=None,
                     **kw):
    """Per-rank residuals of gdn_kcp: {name: (shape, dtype, bytes)}; q..beta are global shapes.
    kw: the remaining gdn_kcp options (the gate flags); others are ignored."""
    W = int(num_ranks)
    # the checks gdn_kcp makes of concrete bounds (below they are abstract)
    check_cu_seqlens(cu_seqlens, 1, np.shape(q)[1])
    check_layout(layout, cu_seqlens, np.shape(q)[1], W)
    mesh = AbstractMesh((W,), (_AXIS,))
    tok = NamedSharding(mesh, P(None, _AXIS))
    rep = NamedSharding(mesh, P())
    sds = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=tok) for x in (q, k, v, g, beta)]
    cu = jax.ShapeDtypeStruct(np.shape(cu_seqlens), jnp.int32, sharding=rep)
    vecs = {n: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep)
            for n, x in (("A_log", A_log), ("dt_bias", dt_bias)) if x is not None}
    gates = ("use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval")
    unknown = sorted(set(kw) - set(gates))
    if unknown:
        raise TypeError(f"saved_layout got unexpected arguments {unknown}")
    kw.update(layout=layout, exchange=exchange, save_mode=save_mode, segments=segments,
              num_docs=num_docs, scale=scale, qk_l2norm=qk_l2norm, backend=backend)
    found = []

    def body(q, k, v, g, beta, cu, vecs):
        f = lambda *a: gdn_kcp(*a[:5], cu_seqlens=cu, axis_name=_AXIS, **dict(zip(vecs, a[5:])),
                               **kw)
        args = (q, k, v, g, beta, *vecs.values())
        found.extend(saved_residuals(f, *args))
        return f(*args)

    jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=(P(None, _AXIS),) * 5 + (P(), P()),
                                 out_specs=P(None, _AXIS)), *sds, cu, vecs)
    out, seen = {}, {}
    for aval, desc in found:
        name = _name(desc)
        seen[name] = seen.get(name, 0) + 1
        key = name if seen[name] == 1 else f"{name} #{seen[name]}"
        dt = jnp.dtype(aval.dtype)
        out[key] = (tuple(aval.shape), dt, int(np.prod(aval.shape)) * dt.itemsize)
    return out
