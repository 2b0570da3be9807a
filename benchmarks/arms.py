"""Arms: the things the runner times, behind one framework-agnostic interface.

An `Arm` is a name, its framework (`benchmarks.frameworks`: JAX or TORCH, which gives the arm its
`sync`, `flush` and `device_times`), and a `setup(workload, op, inputs)` that returns a
zero-argument callable doing one call of `op`. `setup` may compile and run the op; it raises
`ArmUnavailable` (or any exception) when the arm cannot run here, and the runner skips the arm
with the reason. `to_numpy(result)` (optional) gives the outputs as float32 numpy arrays for the
cross-arm check, in a fixed order:

    fwd                 [o]
    fwd+bwd, ckpt       [o, d<inputs...>]   inputs: q, k, v, g, beta (layer: x, conv_w, g, beta)

fwd+bwd is the forward and the VJP with the given cotangent dO (bf16 like o), with no loss
around it (a loss such as sum(o * dO) and its backward would be harness time, and far more of
it in torch eager than in XLA). `inputs` are the host numpy arrays of `Workload.make_inputs`
(bf16 values held as float32).

The callable `setup` returns may carry `peak_bytes` (int): the device memory one call needs. JAX
arms take it from XLA's compiled memory analysis (arguments + outputs + temporaries - aliased);
torch arms from `torch.cuda.max_memory_allocated()` over one call, less what was allocated
before the arm's setup (so its own inputs count, other arms' tensors do not).

Specs on the command line are `name[:opt[:opt...]]`: `xla`, `cuda` (options light | full, det,
P<n>, tiles<n>), `base` (the cuda backend of a baseline revision loaded beside this library,
benchmarks/baseline.py; options as cuda), `kcp:W[:...]` (see `kcp_arm`), `flashqla`, `fla`.
Adding an arm: write a factory `options -> Arm` and add it to `FACTORIES`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Callable, Dict, List, Optional

from benchmarks import frameworks


class ArmUnavailable(RuntimeError):
    """The arm cannot run on this machine (the message says why)."""


@dataclasses.dataclass
class Arm:
    name: str
    setup: Callable[[Any, str, Dict[str, Any]], Callable[[], Any]]
    framework: frameworks.Framework
    to_numpy: Optional[Callable[[Any], List[Any]]] = None
    options: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        # the runner syncs, flushes and profiles an arm only through these, its framework's own
        self.sync = self.framework.sync
        self.flush = self.framework.flush
        self.device_times = self.framework.device_times


# ------------------------------------------------------------------------------------------------
# JAX arms: jax_cake_gdn.gdn with backend "xla" or "cuda"
# ------------------------------------------------------------------------------------------------

_JAX_INPUT_CACHE: Dict[int, Dict[str, Any]] = {}


def _jax_inputs(wl, inputs):
    """Device copies of the host inputs, shared by every JAX arm (one copy per inputs dict)."""
    import jax.numpy as jnp

    key = id(inputs)
    if key not in _JAX_INPUT_CACHE:
        _JAX_INPUT_CACHE.clear()
        act = jnp.bfloat16 if wl.dtype == "bf16" else jnp.float32
        dev = {}
        for n, a in inputs.items():
            if n == "cu_seqlens":
                dev[n] = jnp.asarray(a, jnp.int32)
            elif n in ("g", "beta"):
                dev[n] = jnp.asarray(a, jnp.float32)
            else:
                dev[n] = jnp.asarray(a).astype(act)
        _JAX_INPUT_CACHE[key] = dev
    return _JAX_INPUT_CACHE[key]


def build_jax_op(wl, op, *, backend, save_mode="light", deterministic=False, segments=None,
                 lib=None):
    """A jitted function `f(args, do, cu_seqlens)` for `op` and the names of `args`.

    fwd returns o; fwd+bwd returns (o, grads): the VJP of the layer with cotangent do (o is an
    output, so the forward runs as in training); ckpt is the same around `jax.checkpoint(layer)`
    (2 x fwd + bwd).
    segments: passed to gdn only when given (ArmUnavailable if this gdn takes no `segments`).
    lib: the library module (default jax_cake_gdn; the `base` arm passes its jcg_base copy).
    """
    import jax

    if lib is None:
        import jax_cake_gdn as lib
    jcg = lib

    HK = wl.H * wl.K
    kw = dict(qk_l2norm=wl.qk_l2norm, save_mode=save_mode, deterministic=deterministic,
              backend=backend)
    if segments is not None:
        if "segments" not in inspect.signature(jcg.gdn).parameters:
            raise ArmUnavailable(f"{jcg.__name__}.gdn takes no `segments` (option P{segments})")
        kw["segments"] = segments

    if wl.layer:
        names = ("x", "conv_w", "g", "beta")

        def layer(x, w, g, beta, cu):
            y = jcg.short_conv(x, w, cu_seqlens=cu, activation="silu", backend=backend)
            B, T = y.shape[:2]
            q = y[..., :HK].reshape(B, T, wl.H, wl.K)
            k = y[..., HK:2 * HK].reshape(B, T, wl.H, wl.K)
            v = y[..., 2 * HK:].reshape(B, T, wl.HV, wl.V)
            return jcg.gdn(q, k, v, g, beta, cu_seqlens=cu, **kw)
    else:
        names = ("q", "k", "v", "g", "beta")

        def layer(q, k, v, g, beta, cu):
            return jcg.gdn(q, k, v, g, beta, cu_seqlens=cu, **kw)

    if op == "fwd":
        fn = jax.jit(lambda args, do, cu: layer(*args, cu))
    elif op in ("fwd+bwd", "ckpt"):
        body = jax.checkpoint(layer) if op == "ckpt" else layer

        def fwd_vjp(args, do, cu):
            o, pull = jax.vjp(lambda *a: body(*a, cu), *args)
            return o, pull(do.astype(o.dtype))

        fn = jax.jit(fwd_vjp)
    else:
        raise ValueError(f"unknown op {op!r}")
    return fn, names


def _walk_tiles(lib, n):
    """primitives.cuda.walk_column_tiles(n) of `lib` (None: jax_cake_gdn), or nothing for n None
    (ArmUnavailable where `lib` has no such switch)."""
    if n is None:
        return contextlib.nullcontext()
    if lib is None:
        import jax_cake_gdn as lib
    cuda = getattr(getattr(lib, "primitives", None), "cuda", None)
    switch = getattr(cuda, "walk_column_tiles", None)
    if switch is None:
        raise ArmUnavailable(f"{lib.__name__} has no walk_column_tiles (option tiles{n})")
    return switch(n)


def _jax_to_numpy(res):
    import jax
    import numpy as np

    return [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(res)]


def _compiled_peak_bytes(fn, *args) -> Optional[int]:
    """Device bytes one call of jitted `fn` needs, from XLA's memory analysis (None if unknown)."""
    try:
        m = fn.lower(*args).compile().memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes -
                   m.alias_size_in_bytes)
    except Exception:  # noqa: BLE001 - the analysis is optional on some platforms
        return None


def _jax_call(fn, *args):
    """The zero-argument call of jitted `fn(*args)`, compiled and run once (ArmUnavailable if
    not)."""

    def call():
        return fn(*args)

    try:
        frameworks.jax_sync(call())  # compile now; backend="cuda" raises here where it cannot run
    except Exception as e:  # noqa: BLE001 - any failure to build means "skip, with reason"
        raise ArmUnavailable(f"{type(e).__name__}: {e}") from e
    call.peak_bytes = _compiled_peak_bytes(fn, *args)
    return call


def jax_arm(backend: str, opts: List[str], *, baseline: bool = False) -> Arm:
    """`xla` / `cuda` (this library) or, with baseline=True, `base`: the cuda backend of the
    baseline copy that `python -m benchmarks.baseline REV --dest DIR` made ($JCG_BASELINE=DIR).

    Options: light (default here; gdn's own default is full) | full (save_mode), det
    (deterministic=True), P<n> (segments=n), tiles<n> (the forward walk's column tiles, n = 0, 1
    or 2: traced under primitives.cuda.walk_column_tiles(n); 0 is the kernel's choice)."""
    save_mode, det, segments, tiles = "light", False, None, None
    label = "base" if baseline else backend
    for o in opts:
        if o in ("light", "full"):
            save_mode = o
        elif o in ("det", "deterministic"):
            det = True
        elif o.startswith("P") and o[1:].isdigit() and int(o[1:]) > 0:
            segments = int(o[1:])
        elif o in ("tiles0", "tiles1", "tiles2"):
            tiles = int(o[5:])
        else:
            raise ValueError(f"arm {label}: unknown option {o!r} (light, full, det, P<n>, "
                             "tiles0/1/2)")
    name = ":".join([label] + opts)
    options = {"backend": backend, "save_mode": save_mode, "deterministic": det}
    if segments is not None:
        options["segments"] = segments
    if tiles is not None:
        options["walk_column_tiles"] = tiles

    def setup(wl, op, inputs):
        lib = None
        if baseline:
            from . import baseline as bl

            try:
                lib, rev = bl.load()
            except Exception as e:  # noqa: BLE001
                raise ArmUnavailable(f"{type(e).__name__}: {e}") from e
            options["library"] = f"{bl.BASE} (revision {rev})"
        dev = _jax_inputs(wl, inputs)
        fn, names = build_jax_op(wl, op, backend=backend, save_mode=save_mode, deterministic=det,
                                 segments=segments, lib=lib)
        args = tuple(dev[n] for n in names)
        do, cu = dev["do"], dev["cu_seqlens"]
        with _walk_tiles(lib, tiles):  # _jax_call traces and compiles fn
            return _jax_call(fn, args, do, cu)

    return Arm(name=name, setup=setup, framework=frameworks.JAX, to_numpy=_jax_to_numpy,
               options=options)


# ------------------------------------------------------------------------------------------------
# torch arms: the peers, same process, same host inputs (timing and a loose cross-check only)
# ------------------------------------------------------------------------------------------------


def _import_fla(module: str, name: str):
    """`module.name` of FLA, imported with the settings FLA 0.6.0 needs here."""
    import importlib
    import os

    os.environ.setdefault("FLA_FLASH_QLA", "0")  # keep FLA on its own Triton kernels
    import fla.ops.common.chunk_o as chunk_o

    # FLA 0.6.0 refuses its gated backward on Triton < 3.7.1 on Hopper (its issue 640); the GPU
    # machine has Triton 3.6. For timing only, never as a correctness reference.
    chunk_o.TRITON_ABOVE_3_7_1 = True
    return getattr(importlib.import_module(module), name)


def _torch_gdn(kind):
    """The peer's chunk_gated_delta_rule."""
    if kind == "fla":
        return _import_fla("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
    from flash_qla import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def _fla_conv():
    """FLA's Triton `causal_conv1d(x [B, T, D], weight [D, W], activation=, cu_seqlens=)` ->
    (y, final state): the layer's conv for both torch peers. fla-core 0.6.0 has it in
    fla.modules.causal_conv1d (older releases: fla.modules.convolution)."""
    errors = []
    for module in ("fla.modules.causal_conv1d", "fla.modules.convolution"):
        try:
            return _import_fla(module, "causal_conv1d")
        except Exception as e:  # noqa: BLE001
            errors.append(f"{module}: {type(e).__name__}: {e}")
    raise ArmUnavailable("the layer's conv needs FLA's causal_conv1d: " + "; ".join(errors))


def torch_arm(kind: str, opts: List[str]) -> Arm:
    """`flashqla` (FlashQLA's TileLang kernels) or `fla` (FLA's Triton kernels); the layer
    workloads run FLA's causal_conv1d in front of either."""
    if opts:
        raise ValueError(f"arm {kind}: takes no options, got {opts}")

    def setup(wl, op, inputs):
        try:
            import torch

            fn = _torch_gdn(kind)
        except Exception as e:  # noqa: BLE001
            raise ArmUnavailable(f"{kind} not importable: {type(e).__name__}: {e}") from e
        if not torch.cuda.is_available():
            raise ArmUnavailable("torch sees no CUDA device")
        conv = _fla_conv() if wl.layer else None
        before = torch.cuda.memory_allocated()
        act = torch.bfloat16 if wl.dtype == "bf16" else torch.float32
        grad = op != "fwd"
        t = lambda n, dt: torch.from_numpy(inputs[n]).to("cuda", dt)
        cu = torch.from_numpy(inputs["cu_seqlens"].astype("int64")).to("cuda")
        do = t("do", act)  # the cotangent, in o's dtype
        gdn = lambda q, k, v, g, beta: fn(q, k, v, g, beta, cu_seqlens=cu,
                                          use_qk_l2norm_in_kernel=wl.qk_l2norm)[0]
        if wl.layer:
            args = [t(n, act).requires_grad_(grad) for n in ("x", "conv_w")]
            HK, T = wl.H * wl.K, wl.T

            def layer(x, w, g, beta):
                y = conv(x, w, activation="silu", cu_seqlens=cu)[0]
                q = y[..., :HK].reshape(1, T, wl.H, wl.K).contiguous()
                k = y[..., HK:2 * HK].reshape(1, T, wl.H, wl.K).contiguous()
                v = y[..., 2 * HK:].reshape(1, T, wl.HV, wl.V).contiguous()
                return gdn(q, k, v, g, beta)
        else:
            args = [t(n, act).requires_grad_(grad) for n in ("q", "k", "v")]
            layer = gdn
        args += [t(n, torch.float32).requires_grad_(grad) for n in ("g", "beta")]

        def call():
            if op == "fwd":
                with torch.no_grad():
                    return [layer(*args)]
            if op == "ckpt":
                import torch.utils.checkpoint as ckpt

                o = ckpt.checkpoint(layer, *args, use_reentrant=False)
            else:
                o = layer(*args)
            return [o, *torch.autograd.grad(o, args, grad_outputs=do)]

        try:
            call()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            res = call()
            torch.cuda.synchronize()
            call.peak_bytes = int(torch.cuda.max_memory_allocated()) - before
            del res
        except Exception as e:  # noqa: BLE001
            raise ArmUnavailable(f"{kind} failed: {type(e).__name__}: {e}") from e
        return call

    def to_numpy(res):
        return [x.detach().float().cpu().numpy() for x in res]

    return Arm(name=kind, setup=setup, framework=frameworks.TORCH, to_numpy=to_numpy,
               options={"peer": kind})


# ------------------------------------------------------------------------------------------------
# Context parallelism: gdn_kcp under jax.shard_map over the first W devices
# ------------------------------------------------------------------------------------------------

_KCP_AXIS = "cp"


def kcp_arm(opts: List[str]) -> Arm:
    """`kcp:W[:layout][:exchange][:light|full][:xla][:P<n>][:xonly]`.

    W ranks (the first W devices), layout contiguous (default) | zigzag | doc_zigzag, exchange
    a2a (default) | ring, save mode, backend cuda (default) or xla, P segments per piece (default:
    plan_kcp). The whole global batch is split over the ranks. `xonly` times the exchange alone
    (the piece summaries of this plan through a2a or ring; fwd, or fwd+bwd through its
    transpose) on random summaries of the right shapes: the time of the exchange itself.
    """
    if not opts or not opts[0].isdigit():
        raise ValueError("arm kcp needs the rank count first, e.g. kcp:2")
    W = int(opts[0])
    cfg = dict(layout="contiguous", exchange="a2a", save_mode="light", backend="cuda",
               segments=None)
    xonly = False
    for o in opts[1:]:
        if o in ("contiguous", "zigzag", "doc_zigzag"):
            cfg["layout"] = o
        elif o in ("a2a", "ring"):
            cfg["exchange"] = o
        elif o in ("light", "full"):
            cfg["save_mode"] = o
        elif o in ("xla", "cuda"):
            cfg["backend"] = o
        elif o.startswith("P") and o[1:].isdigit():
            cfg["segments"] = int(o[1:])
        elif o == "xonly":
            xonly = True
        else:
            raise ValueError(f"arm kcp: unknown option {o!r}")
    name = ":".join(["kcp"] + opts)
    state = {}  # setup's document bounds, for to_numpy's from_layout

    def setup(wl, op, inputs):
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as Ps

        import jax_cake_gdn as jcg

        if jax.device_count() < W:
            raise ArmUnavailable(f"needs {W} devices, {jax.device_count()} visible")
        if wl.layer:
            raise ArmUnavailable("layer workloads are not wired for kcp")
        mesh = jax.make_mesh((W,), (_KCP_AXIS,), devices=jax.devices()[:W])
        tok, rep = NamedSharding(mesh, Ps(None, _KCP_AXIS)), NamedSharding(mesh, Ps())
        dev = _jax_inputs(wl, inputs)
        cu = state["cu"] = dev["cu_seqlens"]
        if xonly:
            return _kcp_exchange_call(wl, op, cfg, W, mesh, cu)
        names = ("q", "k", "v", "g", "beta")
        lay = lambda x: jax.device_put(jcg.to_layout(x, cu, cfg["layout"], W), tok)
        args = tuple(lay(dev[n]) for n in names)
        do = lay(dev["do"])

        def local(args, do, cu):
            f = lambda *a: jcg.gdn_kcp(*a, cu_seqlens=cu, axis_name=_KCP_AXIS,
                                       qk_l2norm=wl.qk_l2norm, **cfg)
            if op == "fwd":
                return f(*args)
            body = jax.checkpoint(f) if op == "ckpt" else f
            o, pull = jax.vjp(body, *args)
            return o, pull(do.astype(o.dtype))

        spec = Ps(None, _KCP_AXIS)
        out_specs = spec if op == "fwd" else (spec, (spec,) * 5)
        fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=((spec,) * 5, spec, Ps()),
                                   out_specs=out_specs))
        return _jax_call(fn, args, do, jax.device_put(cu, rep))

    def to_numpy(res):
        import jax
        import numpy as np

        import jax_cake_gdn as jcg

        cu = state["cu"]
        out = []
        for x in jax.tree_util.tree_leaves(res):
            # token arrays come back in layout order (contiguous: the packed order itself)
            if x.ndim >= 2 and cfg["layout"] != "contiguous":
                x = jcg.from_layout(np.asarray(x), cu, cfg["layout"], W)
            out.append(np.asarray(x, np.float32))
        return out

    return Arm(name=name, setup=setup, framework=frameworks.JAX,
               to_numpy=None if xonly else to_numpy, options={**cfg, "ranks": W, "xonly": xonly})


def _kcp_exchange_call(wl, op, cfg, W, mesh, cu):
    """Time the exchange alone on random summaries of the plan's shapes (see kcp_arm)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as Ps

    from jax_cake_gdn.kcp import exchange as ex
    from jax_cake_gdn.kcp.layout import chains_and_m

    C, m = chains_and_m(cfg["layout"], len(wl.doc_lens))
    rng = np.random.default_rng(0)
    shape = (W * C, m, wl.HV, wl.K)
    M = jnp.asarray(rng.standard_normal(shape + (wl.K,)) * wl.K**-0.5, jnp.float32)
    B = jnp.asarray(rng.standard_normal(shape + (wl.V,)), jnp.float32)
    sh = NamedSharding(mesh, Ps(_KCP_AXIS))
    R = jnp.zeros((W * C, m), bool)  # no piece resets (exchanges that take reset flags)
    M, B, R = (jax.device_put(x, sh) for x in (M, B, R))
    xch = ex.a2a if cfg["exchange"] == "a2a" else ex.ring
    flags = "reset" in inspect.signature(xch).parameters

    def local(M, B, R):
        f = lambda M, B: xch(M, B, *((R,) if flags else ()), _KCP_AXIS, W)
        if op == "fwd":
            return f(M, B)
        out, pull = jax.vjp(f, M, B)
        return pull(out)

    spec = Ps(_KCP_AXIS)
    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec),
                               out_specs=spec if op == "fwd" else (spec, spec)))
    return _jax_call(fn, M, B, R)


FACTORIES: Dict[str, Callable[[List[str]], Arm]] = {
    "xla": lambda opts: jax_arm("xla", opts),
    "cuda": lambda opts: jax_arm("cuda", opts),
    "base": lambda opts: jax_arm("cuda", opts, baseline=True),  # benchmarks/baseline.py's copy
    "flashqla": lambda opts: torch_arm("flashqla", opts),  # FlashQLA 0.1.3 (TileLang)
    "fla": lambda opts: torch_arm("fla", opts),  # flash-linear-attention 0.6.0 (Triton)
    "kcp": kcp_arm,  # gdn_kcp over W devices
}


def make_arm(spec: str) -> Arm:
    name, *opts = spec.split(":")
    if name not in FACTORIES:
        raise ValueError(f"unknown arm {name!r}; known: {', '.join(sorted(FACTORIES))}")
    return FACTORIES[name](opts)
