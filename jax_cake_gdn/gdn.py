"""gdn(): argument checks, the custom_vjp rules over the primitives, save modes, residual names."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from . import primitives
from .checks import bounds_ok, check_gdn_inputs
from .chunks import ChunkTable, chunk_table
from .gates import GATE_OPTIONS, apply_options, saved_layout_gates
from .primitives import Primitives

__all__ = ["gdn", "saved_layout", "saved_bytes"]


class _Config(NamedTuple):
    prims: Primitives
    scale: float
    qk_l2norm: bool
    save_mode: str
    with_output: bool = True  # False: exit states only (the transfer walk of kcp/), o is [T, HV, 0]
    deterministic: bool = True  # False: chunk_bwd may sum dq, dk with atomic adds


def _name(res: dict) -> dict:
    """Tag every residual array with a checkpoint name `gdn_<key>` for remat policies."""
    return {n: (None if x is None else checkpoint_name(x, f"gdn_{n}")) for n, x in res.items()}


def _forward(cfg: _Config, q, k, v, g, beta, h0, ct: ChunkTable):
    """Packed forward: q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV]; h0 [N, HV, K, V]."""
    P = cfg.prims
    rq = P.l2norm_rstd(q) if cfg.qk_l2norm else None
    rk = P.l2norm_rstd(k) if cfg.qk_l2norm else None
    G = P.gate_cumsum(g, ct)
    full = cfg.save_mode == "full"
    if cfg.with_output:  # A alone; one walk makes w, u and emits o (full: and the tapes)
        A = P.solve_a(k, beta, G, rk, ct)
        out = P.walk_output(q, k, v, beta, A, G, h0, rq, rk, ct, scale=cfg.scale,
                            out_dtype=v.dtype, tapes=full)
        o, final = out[:2]
        if full:
            w, u, h, v_new = out[2:]
    else:  # exit states only (kcp's transfer walk)
        A, w, u = P.prep(k, v, beta, G, rk, ct)
        h, v_new, final = P.state_walk(k, w, u, G, h0, rk, ct)
        o = jnp.zeros(v.shape[:2] + (0,), v.dtype)
    res = dict(q=q, k=k, v=v, beta=beta, h0=h0, G=G, A=A, rstd_q=rq, rstd_k=rk)
    if full:
        res.update(w=w, u=u, h=h, v_new=v_new)
    return (o, final), (_name(res), ct)


def _backward(cfg: _Config, residuals, cts):
    res, ct = residuals
    do, dfinal = jnp.asarray(cts[0]), jnp.asarray(cts[1])
    P = cfg.prims
    q, k, v, beta, G, A = res["q"], res["k"], res["v"], res["beta"], res["G"], res["A"]
    rq, rk = res["rstd_q"], res["rstd_k"]
    if not cfg.with_output:
        do = jnp.zeros(v.shape, v.dtype)
    if cfg.save_mode == "full":  # the forward walk's tapes, bit for bit the replay's
        w, u, h, v_new = res["w"], res["u"], res["h"], res["v_new"]
    else:  # light: replay w, u (bitwise as prep made them) and the state walk
        w, u, h, v_new = P.replay(k, v, beta, G, A, res["h0"], rk, ct)
    dq, dk, dv, dg, dbeta, dh0 = P.walk_chunk_bwd(q, k, v, beta, G, A, w, u, h, v_new, do,
                                                  dfinal, rq, rk, ct, scale=cfg.scale,
                                                  deterministic=cfg.deterministic)
    return dq, dk, dv, dg, dbeta, dh0, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gdn_packed(cfg, q, k, v, g, beta, h0, ct):
    return _forward(cfg, q, k, v, g, beta, h0, ct)[0]


_gdn_packed.defvjp(_forward, _backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def nan_unless(prims: Primitives, x, ok):
    """x, or NaN everywhere when the bool scalar ok is False (cuda: in place, one launch instead
    of a pass over x). The cotangent passes through: `nan_grads_unless` on the inputs poisons
    the gradients instead, where the cuda kernel works in place on our own kernels' outputs (on
    a dO that XLA cannot alias it would cost a copy, on the xla set a pass over dO)."""
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
    """(guard_inputs, guard_output) for traced cu_seqlens that may break the rules
    (checks.bounds_ok): the output becomes NaN everywhere and so do the inputs' gradients. Both
    are the identity when the bounds are concrete (checked on the host)."""
    ok = None if cu_seqlens is None else bounds_ok(cu_seqlens, T, multiple)
    if ok is None:
        return (lambda xs: xs), (lambda o: o)
    return (lambda xs: nan_grads_unless(prims, xs, ok)), (lambda o: nan_unless(prims, o, ok))


def _setup(q, k, v, g, beta, cu_seqlens, scale, qk_l2norm, initial_state, save_mode, backend):
    d = check_gdn_inputs(q, k, v, g, beta, cu_seqlens=cu_seqlens, scale=scale,
                         initial_state=initial_state, save_mode=save_mode)
    cfg = _Config(primitives.resolve(backend, K=d.K, V=d.V),
                  float(d.K**-0.5 if scale is None else scale),
                  bool(qk_l2norm), save_mode)
    if cu_seqlens is None:
        bounds = np.arange(d.B + 1, dtype=np.int32) * d.T
    else:
        bounds = cu_seqlens
    if initial_state is None:
        h0 = jax.ShapeDtypeStruct((d.N, d.HV, d.K, d.V), jnp.float32)
    else:
        h0 = initial_state
    return d, cfg, (q, k, v, g, beta, h0, bounds)


def _packed_args(d, q, k, v, g, beta, h0, bounds):
    """Flatten B into the token axis and build the chunk table (traceable)."""
    pack = lambda x: jnp.asarray(x).reshape((d.B * d.T,) + x.shape[2:])
    h0 = jnp.zeros(h0.shape, h0.dtype) if isinstance(h0, jax.ShapeDtypeStruct) else jnp.asarray(h0)
    return pack(q), pack(k), pack(v), pack(g), pack(beta), h0, chunk_table(bounds, d.B * d.T)


def gdn(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
        cu_seqlens: jax.Array | None = None, scale: float | None = None, qk_l2norm: bool = False,
        initial_state: jax.Array | None = None, output_final_state: bool = False,
        save_mode: str = "light", deterministic: bool = False, backend: str | None = None,
        use_gate_in_kernel: bool = False, A_log: jax.Array | None = None,
        dt_bias: jax.Array | None = None, use_beta_sigmoid_in_kernel: bool = False,
        allow_neg_eigval: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
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
      save_mode: "light" keeps inputs, entry states, gate cumsum, A (and rstd) and replays w, u and
        the state walk in the backward; "full" also keeps w, the h tape and v_new (and u on xla;
        bfloat16 on the cuda backend, float32 on xla; see `saved_layout`). Both make A alone
        (solve_a) and run w, u, the walk and the output as one kernel (walk_output; full's also
        stores w, h, v_new, bit for bit what light's replay makes), so o and (with
        deterministic=True) the gradients are bitwise equal between the modes. Full skips the
        replay: the faster fwd+bwd (B23 on an H200, 2026-12-01: 5.89 vs 6.55 ms; fwd 1.64 vs
        1.41 ms) for 1.5 GiB more residuals there (`saved_bytes`: 2.35 vs 0.84 GiB); under
        jax.checkpoint full runs its walk twice where light replays, so light suits checkpointed
        layers (README, Checkpointing).
      deterministic: True: bitwise-reproducible gradients (every sum in a fixed order): repeated
        runs with the same shapes on the same device give bitwise-equal outputs and gradients,
        and the two save modes bitwise-equal gradients. False (default): on the cuda backend
        with GVA (H < HV) the backward kernel sums dq and dk over each group of value heads
        with f32 atomic adds, whose order varies, so dq and dk can differ in their last bits
        from run to run and between save modes (every other output and gradient is still
        bitwise reproducible). Its f32 dq, dk hand-off is H/HV the size of the fixed-order
        one's: less memory, the same speed (B23 on an H200: fwd+bwd peak 4.24 vs 5.24 GiB,
        7.37 vs 7.40 ms). The xla backend is deterministic either way.
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

    Returns:
      o [B, T, HV, V] in v's dtype, or (o, final_state) when output_final_state.
    """
    d, cfg, args = _setup(q, k, v, g, beta, cu_seqlens, scale, qk_l2norm, initial_state,
                          save_mode, backend)
    cfg = cfg._replace(deterministic=bool(deterministic))
    g, beta = apply_options(g, beta, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                            dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                            allow_neg_eigval=allow_neg_eigval)
    args = (q, k, v, g, beta) + args[5:]
    guard_inputs, guard_output = bounds_guard(cfg.prims, cu_seqlens, d.T)
    packed = _packed_args(d, *args)
    packed = guard_inputs(packed[:6]) + packed[6:]  # q, k, v, g, beta, h0; then the chunk table
    o, final = _gdn_packed(cfg, *packed)
    o = guard_output(o.reshape(d.B, d.T, d.HV, d.V))
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
    With `num_ranks=W` (and gdn_kcp's layout, exchange, save_transfer, segments): the residuals
    of `gdn_kcp` on each rank (every rank keeps the same shapes), for global q..beta shapes.
    """
    for name in ("output_final_state", "deterministic"):  # gdn arguments that change nothing
        kcp_kw.pop(name, None)
    gate_kw = {n: kcp_kw.pop(n) for n in GATE_OPTIONS if n in kcp_kw}
    if num_ranks is not None:
        from .kcp.saved import saved_layout_kcp

        return saved_layout_kcp(q, k, v, g, beta, cu_seqlens=cu_seqlens, num_ranks=num_ranks,
                                save_mode=save_mode, scale=scale, qk_l2norm=qk_l2norm,
                                backend=backend, **gate_kw, **kcp_kw)
    if kcp_kw:
        raise TypeError(f"saved_layout got context-parallel arguments {sorted(kcp_kw)} without "
                        "num_ranks")
    d, cfg, args = _setup(q, k, v, g, beta, cu_seqlens, scale, qk_l2norm, initial_state,
                          save_mode, backend)
    res, ct = jax.eval_shape(lambda *a: _forward(cfg, *_packed_args(d, *a))[1], *args)
    out = {}
    for name, x in list(res.items()) + [(f"ct.{f}", x) for f, x in ct._asdict().items()]:
        if x is not None:
            out[name] = (tuple(x.shape), jnp.dtype(x.dtype), int(np.prod(x.shape)) *
                         jnp.dtype(x.dtype).itemsize)
    out.update(saved_layout_gates(g, beta, **gate_kw))
    return out


def saved_bytes(*args, **kwargs) -> int:
    """Total bytes of `saved_layout(...)`."""
    return sum(b for _, _, b in saved_layout(*args, **kwargs).values())
