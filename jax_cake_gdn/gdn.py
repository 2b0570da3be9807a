"""gdn(): the public op: argument checks, then on each device's block (sharding.py) the segment
plan and core.gdn_op."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import primitives, sharding, vma
from .checks import bounds_ok, check_arrays, check_gdn_inputs, concrete
from .core import Config, LocalMerge, forward, gdn_op
from .gates import GATE_OPTIONS, apply_options, saved_layout_gates
from .guards import cuda_only, floor_decay, nan_guard
from .plan import plan_segments
from .rows import packed_bounds
from .segments import doc_segments

__all__ = ["gdn", "saved_layout", "saved_bytes"]

def _setup(q, k, v, g, beta, cu_seqlens, scale, qk_l2norm, initial_state, save_mode, backend,
           deterministic=False):
    """Checks, the config and the number of non-empty documents the plan assumes."""
    d = check_gdn_inputs(q, k, v, g, beta, cu_seqlens=cu_seqlens, scale=scale,
                         initial_state=initial_state, save_mode=save_mode, per_row=True)
    prims = primitives.resolve(backend, K=d.K, V=d.V)
    cfg = Config(prims, float(d.K**-0.5 if scale is None else np.asarray(scale)),
                 bool(qk_l2norm), save_mode, bool(deterministic))
    cu = None if cu_seqlens is None else concrete(cu_seqlens)
    if cu_seqlens is None:
        docs = d.B
    elif cu is None:
        docs = d.N * (d.B if cu_seqlens.ndim == 2 else 1)
    else:
        docs = max(1, int(np.count_nonzero(np.diff(cu, axis=-1))))
    return d, cfg, docs


def _packed(cfg: Config, segments, docs_per_row: float, q, k, v, g, beta, h0, cu):
    """One device's arrays -> (P, the packed op's arguments q, k, v, g, beta, h0, bounds).

    B rows of T tokens become one packed axis (rows.py), initial states [B, N, ...] one per
    packed document [B * N, ...]. Traceable; P is static (the plan, from this device's shapes)."""
    B, T = q.shape[:2]
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    bounds, N = packed_bounds(cu, B, T)
    P = plan_segments(B * T, HV, max(1, round(docs_per_row * B)), segments=segments).P
    like = (q, k, v, g, beta) + (() if h0 is None else (h0,))
    h0 = vma.zeros((N, HV, K, V), jnp.float32, *like) if h0 is None else h0.reshape(N, HV, K, V)
    axes = vma.union(*like)  # one type for all: the backward's cotangents carry every axis
    pack = lambda x: vma.cast(x.reshape((B * T,) + x.shape[2:]), axes)
    if cfg.prims.name == "cuda":
        bounds = cuda_only(bounds)
    return P, (pack(q), pack(k), pack(v), pack(g), pack(beta), vma.cast(h0, axes),
               doc_segments(bounds, B * T, P))


def _local(cfg: Config, segments, docs_per_row: float, guard: bool, args: dict):
    """(o, final) of gdn on one device's block (sharding.call): args holds q, k, v, g, beta and
    optionally initial_state and cu_seqlens."""
    q, v, cu = args["q"], args["v"], args.get("cu_seqlens")
    B, T = q.shape[:2]
    h0 = args.get("initial_state")
    P, packed = _packed(cfg, segments, docs_per_row,
                        *(args[n] for n in ("q", "k", "v", "g", "beta")), h0, cu)
    guard_inputs, guard_outputs = nan_guard(cfg.prims, bounds_ok(cu, T) if guard else None)
    packed = guard_inputs(packed[:6]) + packed[6:]  # q, k, v, g, beta, h0; then the table
    o, final = gdn_op(cfg, LocalMerge() if P > 1 else None, *packed)
    rows = () if cu is None or cu.ndim == 1 else (B,)
    final = final.reshape(rows + (-1,) + final.shape[1:])
    return guard_outputs((o.reshape((B, T) + v.shape[2:]), final))


def _rule(d, cu_seqlens, initial_state) -> sharding.Rule:
    """gdn's factors (sharding.py): batch b and q/k heads h split, value heads with their group."""
    vh = "h" if d.HV == d.H else "(h r)"
    form = None if cu_seqlens is None else cu_seqlens.ndim
    state = {None: f"b {vh} k d", 1: f"n {vh} k d", 2: f"b n {vh} k d"}[form]
    ins = dict(q="b t h k", k="b t h k", v=f"b t {vh} d", g=f"b t {vh}", beta=f"b t {vh}")
    if initial_state is not None:
        ins["initial_state"] = state
    if form is not None:
        ins["cu_seqlens"] = {1: "m", 2: "b m"}[form]
    return sharding.Rule("gdn", ins, (f"b t {vh} d", state), {"r": d.HV // d.H},
                         {"b": "batch rows B", "h": "q/k heads H (a GVA group of HV / H value "
                          "heads stays on one device)"})


def gdn(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
        cu_seqlens: jax.Array | None = None, scale: float | None = None, qk_l2norm: bool = False,
        initial_state: jax.Array | None = None, output_final_state: bool = False,
        save_mode: str = "full", deterministic: bool = False, backend: str | None = None,
        use_gate_in_kernel: bool = False, A_log: jax.Array | None = None,
        dt_bias: jax.Array | None = None, use_beta_sigmoid_in_kernel: bool = False,
        allow_neg_eigval: bool = False,
        segments: int | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Gated DeltaNet, chunked (C = 64), differentiable in every input.

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T;  o_t = scale * S_t^T q_t.

    Args:
      q, k: [B, T, H, K] bfloat16 or float32.  v: [B, T, HV, V], same dtype (HV % H == 0).
      g: [B, T, HV] float32 log decay (<= 0), or the raw gate input with use_gate_in_kernel.
        The op clamps the log decay from below at guards.DECAY_FLOOR = -20 (exp(-20) < 2.1e-9):
        a stronger decay (-1e8, -inf) acts as the reset it is, with zero gradient below the
        floor, instead of costing the chunk's float32 gate cumsum its precision.
      beta: [B, T, HV] float32 in (0, 1), or raw logits with use_beta_sigmoid_in_kernel.
      cu_seqlens: optional int32 document bounds. [N + 1] over the T tokens of one packed row
        (then B == 1), or per row [B, N + 1]: row b's bounds over its own T tokens, so data
        parallelism over packed rows splits the batch (cu_seqlens rather than [B, T] segment
        ids: a document's index selects its initial / final state, and N + 1 bounds per row
        cost a fraction of T ids). May be traced, so a jitted step does not retrace when
        boundaries change (repeat the last entry for empty documents up to a fixed capacity N).
        Documents never exchange state. Concrete bounds are checked (ValueError); traced bounds
        that break the rules make o NaN on every device that holds a bad row (all of o on one
        device) and put NaN into its gradients.
      scale: output scale, default K ** -0.5; a concrete Python or NumPy number (it is static
        in the kernels; o is linear in scale, so scale o for a traced factor).
      qk_l2norm: L2-normalise q and k per head row inside the op (x / sqrt(sum x^2 + 1e-6)).
      initial_state: optional float32 entry state per document: [B, HV, K, V] without
        cu_seqlens, [N, HV, K, V] with [N + 1] bounds, [B, N, HV, K, V] with per-row bounds.
      output_final_state: also return the exit state per document, float32, initial_state's
        shape.
      save_mode: "full" (default) keeps the inputs, every segment's entry state, gate cumsum,
        A (and rstd) and the walk's tapes w, h and v_new (and u on xla; bfloat16 on the cuda
        backend, float32 on xla; see `saved_layout`): the faster fwd+bwd. "light" keeps all but
        the tapes and replays w, u and the state walk in the backward: about a third of full's
        residual memory (B23: 0.84 vs 2.35 GiB) for one more walk. Both run w, u, the walk
        and the output as one kernel (full's also stores w, h, v_new, bit for bit what light's
        replay makes), so o and (with deterministic=True) the gradients are bitwise equal
        between the modes. Under jax.checkpoint both run the walk twice (full recomputes it
        with its tapes, light replays it), so light, which keeps less, suits checkpointed
        layers.
      deterministic: True: bitwise-reproducible gradients (every sum in a fixed order): repeated
        runs with the same shapes on the same device give bitwise-equal outputs and gradients,
        and the two save modes bitwise-equal gradients. False (default): on the cuda backend
        with GVA (H < HV) the backward kernel sums dq and dk over each group of value heads
        with f32 atomic adds, whose order varies, so dq and dk can differ in their last bits
        from run to run and between save modes (every other output and gradient is still
        bitwise reproducible); its f32 dq, dk hand-off is H/HV the size of the fixed-order one's
        at about the same speed. The xla backend is deterministic either way.
      backend: None (cuda when the extension is built and a GPU is visible, else xla), "xla" or
        "cuda". Under "cuda" every primitive of the forward and the backward is a CUDA kernel
        (`primitives.CUDA_KERNELS`; the GVA group sum and L2-norm backward of dq/dk too); the
        gate options are jax.numpy. Compiling a "cuda" call for another platform (arrays on
        the host) is a ValueError; lowering it for cuda works on any host.
      use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval: the gate
        options of flash-linear-attention's `chunk_gated_delta_rule`, same names and meaning
        (see `jax_cake_gdn.gates`). use_gate_in_kernel=True: g is raw and the log decay is
        -exp(A_log) * softplus(g + dt_bias) (A_log required, dt_bias optional, both float32
        [HV]). use_beta_sigmoid_in_kernel=True: beta = sigmoid(beta); with allow_neg_eigval=True
        (which requires it) beta = 2 * sigmoid(beta). Gradients flow to the raw g and beta, A_log
        and dt_bias. Computed in jax.numpy before the kernels on every backend today; fusing it
        into the cuda prep kernel is future work.
      segments: cut the packed token axis into this many equal units walked in parallel and
        joined by their affine summaries (docs/design.md section 3): the units that carry a
        state on are summarised by the transfer kernel (one extra state-only walk over them, and
        its backward twin in the backward) and merged in order. None (default): 1, gdn's kernels
        alone; on one GPU the transfer costs about what the shorter chains save
        (`plan.plan_segments`, docs/performance.md).

    Sharding (jax_cake_gdn.sharding): the arrays may be sharded over the batch and the heads
    (q/k heads H with the value heads HV, so a GVA group stays on one device) on Explicit or
    Auto mesh axes, or be one device's block inside jax.shard_map. Each device runs the op on
    its block with no collective, and o and final keep the inputs' sharding; on Auto axes the
    backward also recomputes the gate cumsum, L2 norm and A per device. A sharded token axis
    is a ValueError: context parallelism is `gdn_kcp`.

    Returns:
      o [B, T, HV, V] in v's dtype, or (o, final_state) when output_final_state.
    """
    check_arrays("gdn", q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens,
                 initial_state=initial_state)
    d, cfg, docs = _setup(q, k, v, g, beta, cu_seqlens, scale, qk_l2norm, initial_state,
                          save_mode, backend, deterministic)
    g, beta = apply_options(g, beta, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                            dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                            allow_neg_eigval=allow_neg_eigval)
    args = dict(q=q, k=k, v=v, g=floor_decay(g), beta=beta, initial_state=initial_state,
                cu_seqlens=cu_seqlens)
    args = {n: x for n, x in args.items() if x is not None}
    guard = cu_seqlens is not None and concrete(cu_seqlens) is None  # concrete: checked above
    local = functools.partial(_local, cfg, segments, docs / d.B, guard)
    o, final = sharding.call(local, _rule(d, cu_seqlens, initial_state), args)
    return (o, final) if output_final_state else o


def saved_layout(q, k, v, g, beta, *, cu_seqlens=None, scale: float | None = None,
                 qk_l2norm: bool = False, initial_state=None, save_mode: str = "full",
                 backend: str | None = None, num_ranks: int | None = None,
                 **kcp_kw) -> dict[str, tuple[tuple[int, ...], np.dtype, int]]:
    """Residuals kept for the backward: {name: (shape, dtype, bytes)}.

    Takes the arguments of `gdn` (arrays or jax.ShapeDtypeStruct); computes nothing on device.
    Names match the checkpoint names (`gdn_<name>`); `ct.*` is the chunk table; `g_floor` is the
    decay floor's mask (guards.floor_decay). The gate options (use_gate_in_kernel, A_log,
    dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval) add the raw inputs they keep: g_raw,
    A_log, dt_bias, beta_raw. Shapes are one device's: pass a device's block when sharded.
    With `num_ranks=W` (and gdn_kcp's layout, exchange, segments, num_docs): the residuals of
    `gdn_kcp` on each rank (every rank keeps the same shapes), for global q..beta shapes. An
    argument neither op takes is a TypeError.
    """
    for name in ("output_final_state", "deterministic"):  # gdn arguments that change nothing
        kcp_kw.pop(name, None)
    gate_kw = {n: kcp_kw.pop(n) for n in GATE_OPTIONS if n in kcp_kw}
    if num_ranks is not None:
        from .kcp.saved import saved_layout_kcp

        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"num_ranks must be a positive int or None, got {num_ranks!r}")
        if initial_state is not None:
            raise ValueError("initial_state is not an argument of gdn_kcp (documents start from "
                             "zero under context parallelism): leave it out with num_ranks")

        return saved_layout_kcp(q, k, v, g, beta, cu_seqlens=cu_seqlens, num_ranks=num_ranks,
                                save_mode=save_mode, scale=scale, qk_l2norm=qk_l2norm,
                                backend=backend, **gate_kw, **kcp_kw)
    segments = kcp_kw.pop("segments", None)
    if kcp_kw:
        raise TypeError(f"saved_layout got context-parallel arguments {sorted(kcp_kw)} without "
                        "num_ranks")
    d, cfg, docs = _setup(q, k, v, g, beta, cu_seqlens, scale, qk_l2norm, initial_state,
                          save_mode, backend)

    def residuals(*a):
        P, packed = _packed(cfg, segments, docs / d.B, *a)
        return forward(cfg, LocalMerge() if P > 1 else None, *packed)[1]

    res, tabs = jax.eval_shape(residuals, q, k, v, g, beta, initial_state, cu_seqlens)
    table = [(f"ct.{f}", x) for f, x in tabs.ct._asdict().items()]
    table += [(f"seg.{f}", x) for f, x in tabs._asdict().items() if f != "ct"]
    out = {}
    for name, x in list(res.items()) + table:
        if x is not None:
            out[name] = (tuple(x.shape), jnp.dtype(x.dtype), int(np.prod(x.shape)) *
                         jnp.dtype(x.dtype).itemsize)
    out.update(saved_layout_gates(g, beta, **gate_kw))
    out["g_floor"] = (tuple(g.shape), np.dtype(bool), int(np.prod(g.shape)))  # floor_decay's mask
    return out


def saved_bytes(*args, **kwargs) -> int:
    """Total bytes of `saved_layout(...)`."""
    return sum(b for _, _, b in saved_layout(*args, **kwargs).values())
