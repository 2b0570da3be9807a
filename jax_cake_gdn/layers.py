"""Flax NNX layers: `GatedDeltaNet`, the GDN token mixer of Qwen3-Next / flash-linear-attention.

    x [B, T, hidden] -> q_proj, k_proj [H * K], v_proj [HV * V] -> short causal conv + SiLU over
    the packed q|k|v channels -> q, k [B, T, H, K], v [B, T, HV, V]
    a_proj, b_proj [HV] (float32) -> g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)
    o = gdn(q, k, v, g, beta, qk_l2norm=True)                            [B, T, HV, V]
    o = rms_norm(o) * o_norm.weight * silu(g_proj(x))  (per value head) -> o_proj -> [B, T, hidden]

Context parallelism: with `axis_name` (inside `jax.shard_map`), x is this rank's slice
[1, T / W, hidden] of the layout-ordered tokens (`to_layout`), `cu_seqlens` is global, the conv
and gdn run their CP forms (`short_conv(..., axis_name, layout)`, `gdn_kcp`) and everything else
is per token. Parameters are replicated (`P()`) there; JAX sums their gradients over the ranks.

Generation: `init_cache(B)` gives a `GDNCache` (the conv's last W - 1 input rows and the
recurrent state per row); `layer(x, cache=cache)` returns `(y, new_cache)`, running the chunked
gdn over a prompt and `gdn_step` over a few new tokens.

Sharding (FSDP / TP): every parameter carries logical axis names as MaxText declares them
("embed" for the model width, "heads" for the head-major projection width, None for a
replicated axis), via `nnx.with_partitioning`; map them to mesh axes with `sharding_rules`, for
example (("embed", "fsdp"), ("heads", "tp")), and read them back with `nnx.get_partition_spec`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import spmd as core_spmd
from flax.nnx.nn.linear import default_kernel_init

from .conv import MAX_WIDTH, short_conv
from .gates import fla_beta, fla_gate
from .gdn import gdn
from .kcp import gdn_kcp
from .kcp.layout import LAYOUTS
from .recurrent import gdn_step

__all__ = ["GatedDeltaNet", "GDNCache", "RMSNormGated"]

_DEFAULT = object()  # "use the constructor's value" for call-time overrides
MODES = (None, "chunk", "recurrent")
RECURRENT_MAX_T = 64  # mode=None with a cache: gdn_step up to this many new tokens (FLA's rule)

# logical axes of the parameters (MaxText's names)
EMBED_HEADS, HEADS_EMBED, HEADS, HEADS_W, REPLICATED = (("embed", "heads"), ("heads", "embed"),
                                                        ("heads",), ("heads", None), (None,))


def _sharding(axes, rules) -> dict:
    """nnx variable metadata: logical axes and rules; sharded at creation (flax's eager
    sharding) only where a mesh is set whose axes the rules name, else annotation alone."""
    spec = core_spmd.apply_rules(axes, rules)
    mesh = jax.sharding.get_abstract_mesh()
    names = [n for a in spec if a is not None for n in ((a,) if isinstance(a, str) else a)]
    eager = (nnx.using_eager_sharding() and not mesh.empty and
             all(n in mesh.axis_names for n in names))
    meta = dict(out_sharding=axes, eager_sharding=eager)
    if rules:
        meta["sharding_rules"] = tuple(rules)
    return meta


class GDNCache(NamedTuple):
    """What generation carries between calls, per batch row (a pytree: jit, scan, donate it).

    conv: [B, W - 1, 2 H K + HV V] the last W - 1 rows of the conv's input (the projected
      q|k|v before the conv), in the layer's dtype ([B, 0, ...] without the short conv).
      Hugging Face's conv_states hold W rows, transposed: ours are their last W - 1.
    state: float32 [B, HV, K, V], the recurrent state (FLA's [K, V] layout).
    """

    conv: jax.Array
    state: jax.Array


class RMSNormGated(nnx.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight [* silu(gate)] over the last axis, in float32
    (FLA's FusedRMSNormGated / Qwen3-Next's RMSNormGated; without a gate FLA's RMSNorm; weight
    starts at ones)."""

    def __init__(self, num_features: int, *, eps: float = 1e-6, param_dtype=jnp.float32,
                 sharding_rules=None):
        self.eps = float(eps)
        self.weight = nnx.Param(jnp.ones((num_features,), param_dtype),
                                **_sharding(REPLICATED, sharding_rules))

    def __call__(self, x, gate=None):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        y = y * self.weight[...].astype(jnp.float32)
        if gate is not None:
            y = y * jax.nn.silu(gate.astype(jnp.float32))
        return y.astype(x.dtype)


def _a_log_init(key, shape, dtype=jnp.float32):
    """A_log = log(A), A ~ uniform[1, 16) (the range of FLA / Qwen3-Next, kept away from 0)."""
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


def _dt_bias_init(key, shape, dtype=jnp.float32, dt_min=1e-3, dt_max=1e-1, dt_floor=1e-4):
    """dt_bias = softplus^-1(dt), dt log-uniform in [dt_min, dt_max], clamped at dt_floor (FLA)."""
    u = jax.random.uniform(key, shape, jnp.float32)
    dt = jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = jnp.maximum(dt, dt_floor)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def _positive_int(name, val):
    if not isinstance(val, int) or isinstance(val, bool) or val < 1:
        raise ValueError(f"{name} must be a positive int, got {val!r}")


def _head_dims(head_dim, expand_v, head_k_dim, head_v_dim):
    """(K, V) from FLA's head_dim / expand_v (defaults 256, 2) or our head_k_dim / head_v_dim."""
    if head_k_dim is None:
        head_k_dim = 256 if head_dim is None else head_dim
    elif head_dim is not None and head_dim != head_k_dim:
        raise ValueError(f"head_dim ({head_dim}) and head_k_dim ({head_k_dim}) disagree; give one")
    _positive_int("head_k_dim", head_k_dim)
    if head_v_dim is None:
        ratio = 2.0 if expand_v is None else expand_v
        if not (isinstance(ratio, (int, float)) and ratio > 0 and
                float(head_k_dim * ratio).is_integer()):
            raise ValueError(f"expand_v must make head_k_dim * expand_v a positive integer, got "
                             f"expand_v={expand_v!r} with head_k_dim={head_k_dim}")
        head_v_dim = int(head_k_dim * ratio)
    elif expand_v is not None and head_v_dim != head_k_dim * expand_v:
        raise ValueError(f"expand_v ({expand_v}) and head_v_dim ({head_v_dim}) disagree; give one")
    _positive_int("head_v_dim", head_v_dim)
    return head_k_dim, head_v_dim


class GatedDeltaNet(nnx.Module):
    """The Gated DeltaNet layer (Qwen3-Next / flash-linear-attention `GatedDeltaNet`, with the
    gated output norm and one short conv over the packed q|k|v channels).

    Args:
      hidden_size: model width D.
      num_heads: H, the q/k heads (FLA's default 6; Qwen3-Next linear_num_key_heads 16).
      num_v_heads: HV (default H; Qwen3-Next 32), a multiple of H (GVA: value head i reads q/k
        head i // (HV // H)).
      head_dim, expand_v: FLA's names: K = head_dim, V = head_dim * expand_v (FLA's defaults:
        256 and 2.0; Qwen3-Next: linear_key_head_dim = linear_value_head_dim = 128, expand_v 1).
      head_k_dim, head_v_dim: K and V directly (instead of head_dim / expand_v).
      use_gate: output gate silu(g_proj(x)) in the output norm (FLA's default True; Qwen3-Next's
        z). False: a plain RMSNorm and no g_proj.
      use_short_conv: the causal depthwise conv + SiLU on q|k|v (default True). False: SiLU alone
        (FLA's layer without its conv).
      conv_size: short conv width W, 1..4 (FLA and Qwen3-Next: 4).  conv_bias: a conv bias
        (FLA's default False; Qwen3-Next has none).
      qk_l2norm: L2-normalise q and k per head inside gdn (default True, as FLA and Qwen3-Next).
      norm_eps: eps of the output RMSNorm (default 1e-6, Qwen3-Next's rms_norm_eps; FLA's 1e-5).
      allow_neg_eigval: beta = 2 * sigmoid(b) in (0, 2) (FLA's option), else sigmoid(b).
      dtype: activations (q, k, v, o and the projections; bfloat16 or float32). The gate
        projections a, b and g, beta are always float32.
      param_dtype: parameters (float32).
      backend: gdn / short_conv backend (None: the library's choice, "xla", "cuda").
      axis_name, layout: context-parallel defaults (see the module docstring); `__call__` may
        override them. exchange, save_mode, segments: passed to `gdn_kcp` (save_mode also to `gdn`).
      sharding_rules: logical-to-mesh axis rules stored with every parameter, e.g.
        (("embed", "fsdp"), ("heads", "tp")) (the module docstring says which axes are named).
        Built under `jax.set_mesh(mesh)` with such rules, the parameters are created sharded.
      rngs: nnx.Rngs (uses the `params` stream).

    Parameters (logical axes): q_proj, k_proj [D, H*K], v_proj, g_proj [D, HV*V], a_proj,
    b_proj [D, HV] (nnx.Linear, no bias; ("embed", "heads")), o_proj [HV*V, D] ("heads",
    "embed"), conv_weight [2*H*K + HV*V, W] and conv_bias [2*H*K + HV*V] (uniform
    +-1/sqrt(W), PyTorch's Conv1d init; ("heads", None) / ("heads",)), A_log, dt_bias [HV]
    (("heads",)), o_norm.weight [V] (ones; replicated).
    """

    def __init__(self, hidden_size: int, *, num_heads: int, num_v_heads: int | None = None,
                 head_dim: int | None = None, expand_v: float | None = None,
                 head_k_dim: int | None = None, head_v_dim: int | None = None,
                 use_gate: bool = True, use_short_conv: bool = True, conv_size: int = 4,
                 conv_bias: bool = False, qk_l2norm: bool = True, norm_eps: float = 1e-6,
                 allow_neg_eigval: bool = False, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                 backend: str | None = None, axis_name: str | None = None,
                 layout: str = "contiguous", exchange: str = "a2a", save_mode: str = "full",
                 segments: int | None = None, sharding_rules=None, rngs: nnx.Rngs):
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        for name, val in (("hidden_size", hidden_size), ("num_heads", num_heads),
                          ("num_v_heads", num_v_heads)):
            _positive_int(name, val)
        head_k_dim, head_v_dim = _head_dims(head_dim, expand_v, head_k_dim, head_v_dim)
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
        self.use_gate, self.use_short_conv = bool(use_gate), bool(use_short_conv)
        self.qk_l2norm, self.allow_neg_eigval = bool(qk_l2norm), bool(allow_neg_eigval)
        self.dtype, self.param_dtype, self.backend = dtype, param_dtype, backend
        self.axis_name, self.layout = axis_name, layout
        self.exchange, self.save_mode, self.segments = exchange, save_mode, segments

        meta = lambda axes: _sharding(axes, sharding_rules)
        lin = lambda n_in, n_out, dt, axes: nnx.Linear(
            n_in, n_out, use_bias=False, dtype=dt, param_dtype=param_dtype,
            kernel_init=default_kernel_init, kernel_metadata=meta(axes), rngs=rngs)
        D = hidden_size
        self.q_proj = lin(D, self.key_dim, dtype, EMBED_HEADS)
        self.k_proj = lin(D, self.key_dim, dtype, EMBED_HEADS)
        self.v_proj = lin(D, self.value_dim, dtype, EMBED_HEADS)
        self.a_proj = lin(D, num_v_heads, jnp.float32, EMBED_HEADS)
        self.b_proj = lin(D, num_v_heads, jnp.float32, EMBED_HEADS)
        self.g_proj = lin(D, self.value_dim, dtype, EMBED_HEADS) if self.use_gate else None
        self.o_proj = lin(self.value_dim, D, dtype, HEADS_EMBED)
        C = 2 * self.key_dim + self.value_dim
        bound = conv_size ** -0.5
        uniform = lambda shape: jax.random.uniform(rngs.params(), shape, param_dtype, -bound,
                                                   bound)
        self.conv_weight = nnx.Param(uniform((C, conv_size)), **meta(HEADS_W)) \
            if self.use_short_conv else None
        self.conv_bias = nnx.Param(uniform((C,)), **meta(HEADS)) \
            if (self.use_short_conv and conv_bias) else None
        self.A_log = nnx.Param(_a_log_init(rngs.params(), (num_v_heads,), param_dtype),
                               **meta(HEADS))
        self.dt_bias = nnx.Param(_dt_bias_init(rngs.params(), (num_v_heads,), param_dtype),
                                 **meta(HEADS))
        self.o_norm = RMSNormGated(head_v_dim, eps=norm_eps, param_dtype=param_dtype,
                                   sharding_rules=sharding_rules)

    # ---- pieces -------------------------------------------------------------------------------

    @property
    def conv_history(self) -> int:
        """Rows of conv input a cache carries: W - 1 (0 without the short conv)."""
        return self.conv_size - 1 if self.use_short_conv else 0

    def _cache_shapes(self, batch_size):
        return ((batch_size, self.conv_history, 2 * self.key_dim + self.value_dim),
                (batch_size, self.num_v_heads, self.head_k_dim, self.head_v_dim))

    def init_cache(self, batch_size: int) -> GDNCache:
        """An empty cache for `batch_size` sequences (zeros: as if each started here)."""
        _positive_int("batch_size", batch_size)
        conv, state = self._cache_shapes(batch_size)
        return GDNCache(jnp.zeros(conv, self.dtype), jnp.zeros(state, jnp.float32))

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

    def _project(self, x):
        """x in `dtype` -> (q|k|v before the conv [B, T, C], a, b [B, T, HV] float32)."""
        qkv = jnp.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)
        return qkv, self.a_proj(x), self.b_proj(x)

    def _conv(self, qkv, cu_seqlens=None, cp=None):
        """The short conv (+ bias) and SiLU over q|k|v channels; SiLU alone without the conv."""
        if not self.use_short_conv:
            return jax.nn.silu(qkv.astype(jnp.float32)).astype(qkv.dtype)
        w = self.conv_weight[...].astype(self.dtype)
        kw = dict(cu_seqlens=cu_seqlens, backend=self.backend, **(cp or {}))
        if self.conv_bias is None:
            return short_conv(qkv, w, activation="silu", **kw)
        y = short_conv(qkv, w, activation=None, **kw).astype(jnp.float32)
        return jax.nn.silu(y + self.conv_bias[...].astype(jnp.float32)).astype(qkv.dtype)

    def _conv_continued(self, qkv, history, n):
        """The conv continuing each row from `history` [B, W-1, C] (its previous input rows);
        row b's real tokens are its first n[b]. Returns (y, the new history: the last W - 1
        rows of history + real tokens)."""
        H = history.shape[1]
        full = jnp.concatenate([history.astype(qkv.dtype), qkv], axis=1)
        y = self._conv(full)[:, H:]  # every row of `full` precedes the real tokens it feeds
        idx = (n[:, None] + jnp.arange(H))[..., None]
        return y, jnp.take_along_axis(full, idx, axis=1)

    def _split(self, qkv):
        B, T = qkv.shape[:2]
        HK, H, HV = self.key_dim, self.num_heads, self.num_v_heads
        return (qkv[..., :HK].reshape(B, T, H, self.head_k_dim),
                qkv[..., HK:2 * HK].reshape(B, T, H, self.head_k_dim),
                qkv[..., 2 * HK:].reshape(B, T, HV, self.head_v_dim))

    def _gates(self, a, b):
        return (fla_gate(a, self.A_log[...], self.dt_bias[...]),
                fla_beta(b, sigmoid=True, allow_neg_eigval=self.allow_neg_eigval))

    def _output(self, o, x):
        """Gated RMSNorm per value head, then o_proj: [B, T, HV, V] -> [B, T, hidden]."""
        B, T = x.shape[:2]
        gate = None
        if self.use_gate:
            gate = self.g_proj(x).reshape(B, T, self.num_v_heads, self.head_v_dim)
        return self.o_proj(self.o_norm(o, gate).reshape(B, T, self.value_dim))

    # ---- public ---------------------------------------------------------------------------------

    def gdn_inputs(self, x, cu_seqlens=None, *, axis_name=_DEFAULT, layout=_DEFAULT):
        """The exact inputs the layer hands to gdn / gdn_kcp: (q, k, v, g, beta).

        q, k [B, T, H, K] and v [B, T, HV, V] in `dtype` (after the conv and SiLU; gdn then
        L2-normalises q and k with qk_l2norm), g and beta [B, T, HV] float32.
        """
        axis_name, layout = self._cp(axis_name, layout)
        self._check_x(x, cu_seqlens, axis_name)
        qkv, a, b = self._project(x.astype(self.dtype))
        cp = dict(axis_name=axis_name, layout=layout) if axis_name is not None else None
        return (*self._split(self._conv(qkv, cu_seqlens, cp)), *self._gates(a, b))

    def gdn_output(self, q, k, v, g, beta, *, cu_seqlens=None, initial_state=None,
                   output_final_state=False, axis_name=_DEFAULT, layout=_DEFAULT):
        """The layer's gdn call on `gdn_inputs`' results: o [B, T, HV, V], or (o, final state)
        with output_final_state (gdn's arguments); gdn_kcp with an axis name (o alone)."""
        axis_name, layout = self._cp(axis_name, layout)
        if axis_name is None:
            return gdn(q, k, v, g, beta, cu_seqlens=cu_seqlens, qk_l2norm=self.qk_l2norm,
                       initial_state=initial_state, output_final_state=output_final_state,
                       save_mode=self.save_mode, backend=self.backend)
        return gdn_kcp(q, k, v, g, beta, cu_seqlens=cu_seqlens, axis_name=axis_name,
                       layout=layout, exchange=self.exchange, save_mode=self.save_mode,
                       segments=self.segments, qk_l2norm=self.qk_l2norm, backend=self.backend)

    def __call__(self, x, *, cu_seqlens=None, attention_mask=None, initial_state=None,
                 cache: GDNCache | None = None, mode: str | None = None, axis_name=_DEFAULT,
                 layout=_DEFAULT):
        """x [B, T, hidden_size] -> y [B, T, hidden_size] in `dtype`; (y, new cache) with a cache.

        cu_seqlens: optional int32 [N + 1] document bounds (then B == 1), may be traced.
        attention_mask: optional [B, T] bool or int padding mask, 1 = keep (Hugging Face's).
          Masked tokens are dropped, as FLA's layer drops them: each row's kept tokens, in order,
          form one sequence (continuing from the cache where one is given), so left padding,
          right padding and holes all work; masked tokens change nothing else and their outputs
          are 0. Costs a gather of x and of y per row.
        initial_state: optional float32 [N or B, HV, K, V] entry state of each document (row).
        cache: a `GDNCache` (from `init_cache` or a previous call): the rows continue from it,
          and the call returns the cache after these tokens as well.
        mode: "chunk" (the chunked gdn), "recurrent" (`gdn_step`, token by token) or None:
          recurrent when a cache is given and T <= 64, else chunk. Same results either way.
        axis_name, layout: override the constructor's context-parallel settings; with an axis
          name, call inside jax.shard_map with x the rank's slice [1, T / W, hidden_size] of the
          layout-ordered tokens and the global cu_seqlens (no mask, initial state or cache).
        """
        axis_name, layout = self._cp(axis_name, layout)
        self._check_x(x, cu_seqlens, axis_name)
        B, T = x.shape[:2]
        mode = self._check_call(B, T, cu_seqlens, attention_mask, initial_state, cache, mode,
                                axis_name)
        x = x.astype(self.dtype)
        keep = order = None
        n = jnp.full((B,), T, jnp.int32)
        if attention_mask is not None:  # kept tokens first in each row, in their order
            mask = jnp.asarray(attention_mask).astype(bool)
            order = jnp.argsort(~mask, axis=1, stable=True)
            n = jnp.sum(mask, axis=1, dtype=jnp.int32)
            keep = jnp.arange(T)[None, :] < n[:, None]
            x = jnp.take_along_axis(jnp.where(mask[..., None], x, 0), order[..., None], axis=1)
        qkv, a, b = self._project(x)
        tail = None
        if cache is not None or keep is not None:
            history = cache.conv if cache is not None else \
                jnp.zeros((B, self.conv_history, qkv.shape[-1]), qkv.dtype)
            qkv, tail = self._conv_continued(qkv, history, n)
        else:
            cp = dict(axis_name=axis_name, layout=layout) if axis_name is not None else None
            qkv = self._conv(qkv, cu_seqlens, cp)
        q, k, v = self._split(qkv)
        g, beta = self._gates(a, b)
        if keep is not None:  # g = 0, beta = 0: the state passes masked tokens unchanged
            g, beta = jnp.where(keep[..., None], g, 0.0), jnp.where(keep[..., None], beta, 0.0)
        h0 = cache.state if cache is not None else initial_state
        state = None
        if mode == "recurrent":
            o, state = gdn_step(q, k, v, g, beta, h0, qk_l2norm=self.qk_l2norm)
        elif cache is not None:
            o, state = self.gdn_output(q, k, v, g, beta, initial_state=h0,
                                       output_final_state=True, axis_name=None)
        else:
            o = self.gdn_output(q, k, v, g, beta, cu_seqlens=cu_seqlens, initial_state=h0,
                                axis_name=axis_name, layout=layout)
        y = self._output(o, x)
        if keep is not None:  # back to the caller's token order, 0 where masked
            y = jnp.where(keep[..., None], y, 0)
            y = jnp.take_along_axis(y, jnp.argsort(order, axis=1)[..., None], axis=1)
        return y if cache is None else (y, GDNCache(tail, state))

    def _check_call(self, B, T, cu_seqlens, attention_mask, initial_state, cache, mode,
                    axis_name) -> str:
        """ValueError / TypeError naming the argument; returns the resolved mode."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        recurrent = True if mode == "recurrent" else None
        exclusive = []  # (what the call has, the arguments it rules out)
        if axis_name is not None:
            exclusive.append(("axis_name (context parallel)", (
                ("attention_mask", attention_mask), ("initial_state", initial_state),
                ("cache", cache), ("mode='recurrent'", recurrent))))
        if cu_seqlens is not None:
            exclusive.append(("cu_seqlens (packed documents; this works on batch rows)", (
                ("attention_mask", attention_mask), ("cache", cache),
                ("mode='recurrent'", recurrent))))
        for given, args in exclusive:
            for name, val in args:
                if val is not None:
                    raise ValueError(f"{name} is not supported with {given}")
        if attention_mask is not None:
            if not hasattr(attention_mask, "shape") or tuple(attention_mask.shape) != (B, T):
                raise ValueError(f"attention_mask must be [B, T] = {(B, T)}, got "
                                 f"{getattr(attention_mask, 'shape', type(attention_mask))}")
            dt = jnp.asarray(attention_mask).dtype
            if not (dt == jnp.bool_ or jnp.issubdtype(dt, jnp.integer)):
                raise TypeError(f"attention_mask must be bool or integer (1 = keep), got {dt}")
        if cache is not None:
            if initial_state is not None:
                raise ValueError("initial_state and cache exclude each other: the cache's state "
                                 "is the initial state")
            if not isinstance(cache, GDNCache):
                raise TypeError(f"cache must be a GDNCache (init_cache), got "
                                f"{type(cache).__name__}")
            for name, got, shape in zip(("cache.conv", "cache.state"), cache,
                                        self._cache_shapes(B)):
                if tuple(got.shape) != shape:
                    raise ValueError(f"{name} must have shape {shape}, got {tuple(got.shape)}")
            if cache.state.dtype != jnp.float32:
                raise TypeError(f"cache.state must be float32, got {cache.state.dtype}")
        if mode is None:
            return "recurrent" if (cache is not None and T <= RECURRENT_MAX_T) else "chunk"
        return mode
