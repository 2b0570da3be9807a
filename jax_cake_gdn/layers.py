"""Flax NNX layers: `GatedDeltaNet`, the GDN token mixer of Qwen3-Next / flash-linear-attention.

    x [B, T, hidden] -> q_proj, k_proj [H * K], v_proj [HV * V] -> short causal conv + SiLU over
    the packed q|k|v channels -> q, k [B, T, H, K], v [B, T, HV, V]
    a_proj, b_proj [HV] (float32) -> g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)
    o = gdn(q, k, v, g, beta, qk_l2norm=True)                            [B, T, HV, V]
    o = rms_norm(o) * o_norm.weight * silu(g_proj(x))  (per value head) -> o_proj -> [B, T, hidden]

Context parallelism: with `axis_name` (inside `jax.shard_map`), x is this rank's slice
[1, T / W, hidden] of the layout-ordered tokens (`to_layout`), `cu_seqlens` is global, the conv
and gdn run their CP forms (`short_conv(..., axis_name, layout)`, `gdn_kcp`) and everything else
is per token. Parameters are replicated (`P()`); JAX sums their gradients over the ranks.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from .conv import MAX_WIDTH, short_conv
from .gates import fla_beta, fla_gate
from .gdn import gdn
from .kcp import gdn_kcp
from .kcp.layout import LAYOUTS

__all__ = ["GatedDeltaNet", "RMSNormGated"]

_DEFAULT = object()  # "use the constructor's value" for call-time overrides


class RMSNormGated(nnx.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight * silu(gate) over the last axis, computed in float32
    (FLA's FusedRMSNormGated / Qwen3-Next's RMSNormGated; weight starts at ones)."""

    def __init__(self, num_features: int, *, eps: float = 1e-6, param_dtype=jnp.float32):
        self.eps = float(eps)
        self.weight = nnx.Param(jnp.ones((num_features,), param_dtype))

    def __call__(self, x, gate):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        y = y * self.weight[...].astype(jnp.float32)
        return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def _a_log_init(key, shape, dtype=jnp.float32):
    """A_log = log(A), A ~ uniform[1, 16) (the range of FLA / Qwen3-Next, kept away from 0)."""
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


def _dt_bias_init(key, shape, dtype=jnp.float32, dt_min=1e-3, dt_max=1e-1, dt_floor=1e-4):
    """dt_bias = softplus^-1(dt), dt log-uniform in [dt_min, dt_max], clamped at dt_floor (FLA)."""
    u = jax.random.uniform(key, shape, jnp.float32)
    dt = jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = jnp.maximum(dt, dt_floor)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


class GatedDeltaNet(nnx.Module):
    """The Gated DeltaNet layer (Qwen3-Next / flash-linear-attention `GatedDeltaNet`, with the
    gated output norm and one short conv over the packed q|k|v channels).

    Args:
      hidden_size: model width D.
      num_heads: H, the q/k heads.  num_v_heads: HV (default H), a multiple of H (GVA: value
        head i reads q/k head i // (HV // H)).
      head_k_dim: K.  head_v_dim: V.
      conv_size: short conv width, 1..4 (no bias, SiLU).
      norm_eps: eps of the gated RMSNorm on the output.
      allow_neg_eigval: beta = 2 * sigmoid(b) in (0, 2) (FLA's option), else sigmoid(b).
      dtype: activations (q, k, v, o and the projections; bfloat16 or float32). The gate
        projections a, b and g, beta are always float32.
      param_dtype: parameters (float32).
      backend: gdn / short_conv backend (None: the library's choice, "xla", "cuda").
      axis_name, layout: context-parallel defaults (see the module docstring); `__call__` may
        override them. exchange, save_mode, segments: passed to `gdn_kcp` (save_mode also to `gdn`).
      rngs: nnx.Rngs (uses the `params` stream).

    Parameters: q_proj, k_proj [D, H*K], v_proj, g_proj [D, HV*V], a_proj, b_proj [D, HV]
    (nnx.Linear, no bias), conv_weight [2*H*K + HV*V, conv_size] (uniform +-1/sqrt(conv_size),
    PyTorch's Conv1d init), A_log [HV], dt_bias [HV], o_norm.weight [V] (ones),
    o_proj [HV*V, D].
    """

    def __init__(self, hidden_size: int, *, num_heads: int, num_v_heads: int | None = None,
                 head_k_dim: int, head_v_dim: int, conv_size: int = 4, norm_eps: float = 1e-6,
                 allow_neg_eigval: bool = False, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                 backend: str | None = None, axis_name: str | None = None,
                 layout: str = "contiguous", exchange: str = "a2a", save_mode: str = "light",
                 segments: int | None = None, rngs: nnx.Rngs):
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        for name, val in (("hidden_size", hidden_size), ("num_heads", num_heads),
                          ("num_v_heads", num_v_heads), ("head_k_dim", head_k_dim),
                          ("head_v_dim", head_v_dim)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if num_v_heads % num_heads:
            raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_heads "
                             f"({num_heads})")
        if not isinstance(conv_size, int) or not 1 <= conv_size <= MAX_WIDTH:
            raise ValueError(f"conv_size must be an int in 1..{MAX_WIDTH}, got {conv_size!r}")
        if not norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {norm_eps!r}")
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
            raise ValueError(f"dtype must be bfloat16 or float32, got {dtype!r}")
        if backend not in (None, "xla", "cuda"):
            raise ValueError(f"backend must be None, 'xla' or 'cuda', got {backend!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.hidden_size, self.num_heads, self.num_v_heads = hidden_size, num_heads, num_v_heads
        self.head_k_dim, self.head_v_dim, self.conv_size = head_k_dim, head_v_dim, conv_size
        self.key_dim, self.value_dim = num_heads * head_k_dim, num_v_heads * head_v_dim
        self.allow_neg_eigval = bool(allow_neg_eigval)
        self.dtype, self.param_dtype, self.backend = dtype, param_dtype, backend
        self.axis_name, self.layout = axis_name, layout
        self.exchange, self.save_mode, self.segments = exchange, save_mode, segments

        lin = lambda n_in, n_out, dt: nnx.Linear(n_in, n_out, use_bias=False, dtype=dt,
                                                  param_dtype=param_dtype, rngs=rngs)
        D = hidden_size
        self.q_proj = lin(D, self.key_dim, dtype)
        self.k_proj = lin(D, self.key_dim, dtype)
        self.v_proj = lin(D, self.value_dim, dtype)
        self.a_proj = lin(D, num_v_heads, jnp.float32)
        self.b_proj = lin(D, num_v_heads, jnp.float32)
        self.g_proj = lin(D, self.value_dim, dtype)
        self.o_proj = lin(self.value_dim, D, dtype)
        C = 2 * self.key_dim + self.value_dim
        bound = conv_size ** -0.5
        self.conv_weight = nnx.Param(jax.random.uniform(rngs.params(), (C, conv_size),
                                                        param_dtype, -bound, bound))
        self.A_log = nnx.Param(_a_log_init(rngs.params(), (num_v_heads,), param_dtype))
        self.dt_bias = nnx.Param(_dt_bias_init(rngs.params(), (num_v_heads,), param_dtype))
        self.o_norm = RMSNormGated(head_v_dim, eps=norm_eps, param_dtype=param_dtype)

    def _cp(self, axis_name, layout):
        axis_name = self.axis_name if axis_name is _DEFAULT else axis_name
        layout = self.layout if layout is _DEFAULT else layout
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        return axis_name, layout

    def _check_x(self, x, cu_seqlens, axis_name):
        if not hasattr(x, "ndim") or x.ndim != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be [B, T, hidden_size={self.hidden_size}], got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
        if axis_name is not None and cu_seqlens is None:
            raise ValueError("GatedDeltaNet with axis_name (context parallel) needs the global "
                             "cu_seqlens")

    def gdn_inputs(self, x, cu_seqlens=None, *, axis_name=_DEFAULT, layout=_DEFAULT):
        """The exact inputs the layer hands to gdn / gdn_kcp: (q, k, v, g, beta).

        q, k [B, T, H, K] and v [B, T, HV, V] in `dtype` (after the conv and SiLU; gdn then
        L2-normalises q and k), g and beta [B, T, HV] float32.
        """
        axis_name, layout = self._cp(axis_name, layout)
        self._check_x(x, cu_seqlens, axis_name)
        B, T, _ = x.shape
        x = x.astype(self.dtype)
        qkv = jnp.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)
        cp = dict(axis_name=axis_name, layout=layout) if axis_name is not None else {}
        qkv = short_conv(qkv, self.conv_weight[...].astype(self.dtype), cu_seqlens=cu_seqlens,
                         activation="silu", backend=self.backend, **cp)
        HK, H, HV = self.key_dim, self.num_heads, self.num_v_heads
        q = qkv[..., :HK].reshape(B, T, H, self.head_k_dim)
        k = qkv[..., HK:2 * HK].reshape(B, T, H, self.head_k_dim)
        v = qkv[..., 2 * HK:].reshape(B, T, HV, self.head_v_dim)
        g = fla_gate(self.a_proj(x), self.A_log[...], self.dt_bias[...])
        beta = fla_beta(self.b_proj(x), sigmoid=True, allow_neg_eigval=self.allow_neg_eigval)
        return q, k, v, g, beta

    def gdn_output(self, q, k, v, g, beta, *, cu_seqlens=None, axis_name=_DEFAULT,
                   layout=_DEFAULT):
        """The layer's gdn call on `gdn_inputs`' results: o [B, T, HV, V] (gdn with
        qk_l2norm=True, or gdn_kcp with an axis name)."""
        axis_name, layout = self._cp(axis_name, layout)
        if axis_name is None:
            return gdn(q, k, v, g, beta, cu_seqlens=cu_seqlens, qk_l2norm=True,
                       save_mode=self.save_mode, backend=self.backend)
        return gdn_kcp(q, k, v, g, beta, cu_seqlens=cu_seqlens, axis_name=axis_name,
                       layout=layout, exchange=self.exchange, save_mode=self.save_mode,
                       segments=self.segments, qk_l2norm=True, backend=self.backend)

    def __call__(self, x, *, cu_seqlens=None, axis_name=_DEFAULT, layout=_DEFAULT):
        """x [B, T, hidden_size] -> [B, T, hidden_size] in `dtype`.

        cu_seqlens: optional int32 [N + 1] document bounds (then B == 1), may be traced.
        axis_name, layout: override the constructor's context-parallel settings; with an axis
        name, call inside jax.shard_map with x the rank's slice [1, T / W, hidden_size] of the
        layout-ordered tokens and the global cu_seqlens.
        """
        axis_name, layout = self._cp(axis_name, layout)
        q, k, v, g, beta = self.gdn_inputs(x, cu_seqlens, axis_name=axis_name, layout=layout)
        o = self.gdn_output(q, k, v, g, beta, cu_seqlens=cu_seqlens, axis_name=axis_name,
                            layout=layout)
        B, T = x.shape[:2]
        gate = self.g_proj(x.astype(self.dtype)).reshape(B, T, self.num_v_heads, self.head_v_dim)
        o = self.o_norm(o, gate).reshape(B, T, self.value_dim)
        return self.o_proj(o)
