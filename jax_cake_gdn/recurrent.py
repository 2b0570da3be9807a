"""gdn_step(): the Gated DeltaNet recurrence token by token, for decoding.

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T;   o_t = scale * S_t^T q_t

The same math and conventions as `gdn` (docs/design.md section 1: GVA, the optional q/k L2 norm,
FLA's gate options), written as a `lax.scan` over the few new tokens in jax.numpy: any device,
jit-friendly, differentiable by JAX autodiff. Each token reads and writes the whole state
[B, HV, K, V] a few times for about 8 K V flops per value head: memory-bound work, as a decode
step is. For prompts use the chunked `gdn(..., output_final_state=True)` and continue from its
final state here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .checks import check_gdn_inputs
from .gates import apply_options
from .primitives.xla import l2norm_rstd

__all__ = ["gdn_step"]

_HI = jax.lax.Precision.HIGHEST


def gdn_step(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
             state: jax.Array | None = None, *, scale: float | None = None,
             qk_l2norm: bool = False, use_gate_in_kernel: bool = False,
             A_log: jax.Array | None = None, dt_bias: jax.Array | None = None,
             use_beta_sigmoid_in_kernel: bool = False,
             allow_neg_eigval: bool = False) -> tuple[jax.Array, jax.Array]:
    """Advance B independent recurrent states by T tokens (T = 1 for plain decoding).

    Args:
      q, k: [B, T, H, K] bfloat16 or float32.  v: [B, T, HV, V], same dtype (HV % H == 0; value
        head i reads q/k head i // (HV // H)).
      g, beta: [B, T, HV] float32 (log decay <= 0, beta), or raw with the gate options.
      state: float32 [B, HV, K, V], the state after the tokens before these (for example the
        final state of `gdn(..., output_final_state=True)` over the prompt); None = zeros.
      scale, qk_l2norm, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
        allow_neg_eigval: as in `gdn`, same meaning.

    Returns:
      (o [B, T, HV, V] in v's dtype, new state float32 [B, HV, K, V]). Every product is float32.
      Row b of the batch is its own sequence (no cu_seqlens: pad or stack the sequences).
    """
    d = check_gdn_inputs(q, k, v, g, beta, cu_seqlens=None, scale=scale, initial_state=None,
                         save_mode="light")
    if state is not None:
        if not hasattr(state, "shape") or tuple(state.shape) != (d.B, d.HV, d.K, d.V):
            raise ValueError(f"state must have shape [B, HV, K, V] = {(d.B, d.HV, d.K, d.V)}, "
                             f"got {getattr(state, 'shape', type(state).__name__)}")
        if state.dtype != jnp.float32:
            raise TypeError(f"state must be float32, got {state.dtype}")
    g, beta = apply_options(g, beta, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                            dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                            allow_neg_eigval=allow_neg_eigval)
    B, T, H, HV, K, V = d.B, d.T, d.H, d.HV, d.K, d.V
    R = HV // H  # value heads per q/k head
    scale = K**-0.5 if scale is None else float(scale)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    q, k = f32(q), f32(k)
    if qk_l2norm:
        q, k = q * l2norm_rstd(q)[..., None], k * l2norm_rstd(k)[..., None]
    S = jnp.zeros((B, HV, K, V), jnp.float32) if state is None else f32(state)
    # heads grouped as [H, R] so q/k broadcast over their value heads without a copy
    xs = (q[:, :, :, None], k[:, :, :, None], f32(v).reshape(B, T, H, R, V),
          f32(g).reshape(B, T, H, R), f32(beta).reshape(B, T, H, R))
    xs = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), xs)  # time first for the scan

    S, o = jax.lax.scan(_step, S.reshape(B, H, R, K, V), xs)
    o = (scale * jnp.moveaxis(o, 0, 1)).reshape(B, T, HV, V).astype(v.dtype)
    return o, S.reshape(B, HV, K, V)


def _step(S, x):
    """One token: S [B, H, R, K, V]; q, k [B, H, 1, K]; v [B, H, R, V]; g, beta [B, H, R].
    Module level (no closure), so eager calls reuse the compiled scan."""
    qt, kt, vt, gt, bt = x
    S = S * jnp.exp(gt)[..., None, None]
    kS = jnp.einsum("bhrk,bhrkv->bhrv", kt, S, precision=_HI)
    S = S + (bt[..., None, None] * kt[..., :, None]) * (vt - kS)[..., None, :]
    return S, jnp.einsum("bhrk,bhrkv->bhrv", qt, S, precision=_HI)  # unscaled o
