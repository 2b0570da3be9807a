"""gdn(): the public op on one device: argument checks, the segment plan, then core.gdn_op."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import primitives
from .checks import check_gdn_inputs, concrete
from .core import Config, LocalMerge, forward, gdn_op
from .gates import GATE_OPTIONS, apply_options, saved_layout_gates
from .guards import bounds_guard
from .plan import plan_segments
from .segments import doc_segments

__all__ = ["gdn", "saved_layout", "saved_bytes"]


def _setup(q, k, v, g, beta, cu_seqlens, scale, qk_l2norm, initial_state, save_mode, backend,
           segments=None):
    """Checks, the config, the plan (P units) and the host-side arguments."""
    d = check_gdn_inputs(q, k, v, g, beta, cu_seqlens=cu_seqlens, scale=scale,
                         initial_state=initial_state, save_mode=save_mode)
    prims = primitives.resolve(backend, K=d.K, V=d.V)
    cfg = Config(prims, float(d.K**-0.5 if scale is None else scale), bool(qk_l2norm), save_mode)
    if cu_seqlens is None:
        bounds = np.arange(d.B + 1, dtype=np.int32) * d.T
    else:
        bounds = cu_seqlens
    cu = concrete(bounds)
    docs = d.N if cu is None else max(1, int(np.count_nonzero(np.diff(cu))))
    if segments is None and prims.name != "cuda":  # segments pay on the GPU's SMs only
        segments = 1
    P = plan_segments(d.B * d.T, d.HV, docs, segments=segments).P
    if initial_state is None:
        h0 = jax.ShapeDtypeStruct((d.N, d.HV, d.K, d.V), jnp.float32)
    else:
        h0 = initial_state
    return d, cfg, P, (q, k, v, g, beta, h0, bounds)


def _packed_args(d, P, q, k, v, g, beta, h0, bounds):
    """Flatten B into the token axis and build the segment table (traceable)."""
    pack = lambda x: jnp.asarray(x).reshape((d.B * d.T,) + x.shape[2:])
    h0 = jnp.zeros(h0.shape, h0.dtype) if isinstance(h0, jax.ShapeDtypeStruct) else jnp.asarray(h0)
    return pack(q), pack(k), pack(v), pack(g), pack(beta), h0, doc_segments(bounds, d.B * d.T, P)


def gdn(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
        cu_seqlens: jax.Array | None = None, scale: float | None = None, qk_l2norm: bool = False,
        initial_state: jax.Array | None = None, output_final_state: bool = False,
        save_mode: str = "light", deterministic: bool = False, backend: str | None = None,
        use_gate_in_kernel: bool = False, A_log: jax.Array | None = None,
        dt_bias: jax.Array | None = None, use_beta_sigmoid_in_kernel: bool = False,
        allow_neg_eigval: bool = False,
        segments: int | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Gated DeltaNet, chunked (C = 64), differentiable in every input.

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T;  o_t = scale * S_t^T q_t.

    Args:
      q, k: [B, T, H, K] bfloat16 or float32.  v: [B, T, HV, V], same dtype (HV % H == 0).
      g: [B, T, HV] float32 log decay (<= 0), or the raw gate input with use_gate_in_kernel.
      beta: [B, T, HV] float32 in (0, 1), or raw logits with use_beta_sigmoid_in_kernel.
      cu_seqlens: optional int32 [N + 1] document bounds over T (then B == 1); may be traced, so a
        jitted step does not retrace when boundaries change (repeat the last entry for empty
        documents up to a fixed capacity). Documents never exchange state. Concrete bounds are
        checked (ValueError); traced bounds that break the rules make o all NaN (and put NaN
        into the gradients).
      scale: output scale, default K ** -0.5.
      qk_l2norm: L2-normalise q and k per head row inside the op (x / sqrt(sum x^2 + 1e-6)).
      initial_state: optional float32 [N or B, HV, K, V] entry state per document.
      output_final_state: also return the exit state per document, float32 [N or B, HV, K, V].
      save_mode: "light" keeps inputs, every segment's entry state, gate cumsum, A (and rstd) and
        replays w, u and the state walk in the backward; "full" also keeps w, the h tape and
        v_new (and u on xla; bfloat16 on the cuda backend, float32 on xla; see `saved_layout`).
        Both run w, u, the walk and the output as one kernel (full's also stores w, h, v_new, bit
        for bit what light's replay makes), so o and (with deterministic=True) the gradients are
        bitwise equal between the modes. Full skips the replay: the faster fwd+bwd, for about
        twice light's residual memory. Under jax.checkpoint full runs its walk twice where light
        replays once, so light suits checkpointed layers.
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
        gate options are jax.numpy.
      use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval: the gate
        options of flash-linear-attention's `chunk_gated_delta_rule`, same names and meaning
        (see `jax_cake_gdn.gates`). use_gate_in_kernel=True: g is raw and the log decay is
        -exp(A_log) * softplus(g + dt_bias) (A_log required, dt_bias optional, both float32
        [HV]). use_beta_sigmoid_in_kernel=True: beta = sigmoid(beta); with allow_neg_eigval=True
        (which requires it) beta = 2 * sigmoid(beta). Gradients flow to the raw g and beta, A_log
        and dt_bias. Computed in jax.numpy before the kernels on every backend today; fusing it
        into the cuda prep kernel is future work.
      segments: cut the packed token axis into this many equal units walked in parallel and
        joined by their affine summaries (docs/design.md section 3), so that few long documents
        fill the GPU: the units that carry a state on are summarised by the transfer kernel
        (one extra state-only walk over them, and its backward twin) and merged in order.
        None (default): `plan.plan_segments` picks from documents x value heads against the SMs
        (1 on the xla backend, and where the chains fill the GPU: then gdn runs no transfer).

    Returns:
      o [B, T, HV, V] in v's dtype, or (o, final_state) when output_final_state.
    """
    d, cfg, P, args = _setup(q, k, v, g, beta, cu_seqlens, scale, qk_l2norm, initial_state,
                             save_mode, backend, segments)
    cfg = cfg._replace(deterministic=bool(deterministic))
    g, beta = apply_options(g, beta, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                            dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                            allow_neg_eigval=allow_neg_eigval)
    args = (q, k, v, g, beta) + args[5:]
    guard_inputs, guard_outputs = bounds_guard(cfg.prims, cu_seqlens, d.T)
    packed = _packed_args(d, P, *args)
    packed = guard_inputs(packed[:6]) + packed[6:]  # q, k, v, g, beta, h0; then the table
    o, final = gdn_op(cfg, LocalMerge() if P > 1 else None, *packed)
    o, final = guard_outputs((o.reshape(d.B, d.T, d.HV, d.V), final))
    return (o, final) if output_final_state else o


def saved_layout(q, k, v, g, beta, *, cu_seqlens=None, scale: float | None = None,
                 qk_l2norm: bool = False, initial_state=None, save_mode: str = "light",
                 backend: str | None = None, num_ranks: int | None = None,
                 **kcp_kw) -> dict[str, tuple[tuple[int, ...], np.dtype, int]]:
    """Residuals kept for the backward: {name: (shape, dtype, bytes)}.

    Takes the arguments of `gdn` (arrays or jax.ShapeDtypeStruct); computes nothing on device.
    Names match the checkpoint names (`gdn_<name>`); `ct.*` is the chunk table. The gate options
    (use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval) add the raw
    inputs they keep: g_raw, A_log, dt_bias, beta_raw.
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
    d, cfg, P, args = _setup(q, k, v, g, beta, cu_seqlens, scale, qk_l2norm, initial_state,
                             save_mode, backend, kcp_kw.pop("segments", None))
    if kcp_kw:
        raise TypeError(f"saved_layout got context-parallel arguments {sorted(kcp_kw)} without "
                        "num_ranks")
    merge = LocalMerge() if P > 1 else None
    res, tabs = jax.eval_shape(lambda *a: forward(cfg, merge, *_packed_args(d, P, *a))[1], *args)
    table = [(f"ct.{f}", x) for f, x in tabs.ct._asdict().items()]
    table += [(f"seg.{f}", x) for f, x in tabs._asdict().items() if f != "ct"]
    out = {}
    for name, x in list(res.items()) + table:
        if x is not None:
            out[name] = (tuple(x.shape), jnp.dtype(x.dtype), int(np.prod(x.shape)) *
                         jnp.dtype(x.dtype).itemsize)
    out.update(saved_layout_gates(g, beta, **gate_kw))
    return out


def saved_bytes(*args, **kwargs) -> int:
    """Total bytes of `saved_layout(...)`."""
    return sum(b for _, _, b in saved_layout(*args, **kwargs).values())
