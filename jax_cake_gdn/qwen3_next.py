"""Hugging Face Qwen3-Next linear-attention weights -> our Flax `GatedDeltaNet` layer (no torch).

transformers' `Qwen3NextGatedDeltaNet` (models/qwen3_next/modeling_qwen3_next.py) fuses its
projections and interleaves them per key head; we keep one projection per role:

  in_proj_qkvz.weight [2 nk dk + 2 nv dv, D]: rows in nk blocks, block h = [q_h (dk), k_h (dk),
      v of value heads h r .. h r + r - 1 (r dv), z of the same (r dv)], r = nv / nk
      (`fix_query_key_value_ordering`)  ->  q_proj, k_proj, v_proj, g_proj (z is the output gate)
  in_proj_ba.weight [2 nv, D]: nk blocks [b (r), a (r)]          ->  b_proj, a_proj
  conv1d.weight [C, 1, W] over the mixed channels q (all heads) | k | v, C = 2 nk dk + nv dv,
      causal (left padding W - 1), then SiLU                      ->  conv_weight [C, W]
  A_log, dt_bias [nv] (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b))  ->  same
  norm.weight [dv] (RMSNormGated: rms_norm(o) * weight * silu(z))  ->  o_norm.weight
  out_proj.weight [D, nv dv]                                     ->  o_proj

PyTorch's Linear stores [out, in]; nnx.Linear's kernel is [in, out], hence the transposes. HF
repeats q and k over each key head's r value heads (repeat_interleave), which is our GVA
(value head i reads q/k head i // r), and calls FLA with use_qk_l2norm_in_kernel=True and the
default scale dk^-0.5, as our layer does by default.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from .layers import GatedDeltaNet

__all__ = ["from_qwen3_next", "qwen3_next_layer_kwargs", "QWEN3_NEXT_KEYS"]

QWEN3_NEXT_KEYS = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "A_log",
                   "dt_bias", "norm.weight", "out_proj.weight")

# HF config name -> GatedDeltaNet argument (Qwen3NextConfig's defaults in the comments)
_CONFIG = (("hidden_size", "hidden_size"),  # 2048
           ("linear_num_key_heads", "num_heads"),  # 16
           ("linear_num_value_heads", "num_v_heads"),  # 32
           ("linear_key_head_dim", "head_k_dim"),  # 128
           ("linear_value_head_dim", "head_v_dim"),  # 128
           ("linear_conv_kernel_dim", "conv_size"),  # 4
           ("rms_norm_eps", "norm_eps"))  # 1e-6


def qwen3_next_layer_kwargs(config) -> dict:
    """GatedDeltaNet arguments from a Qwen3-Next config: a dict (config.json) or an object with
    the attributes (transformers' Qwen3NextConfig). ValueError names a missing entry."""
    get = config.get if isinstance(config, Mapping) else lambda n: getattr(config, n, None)
    out = {}
    for hf, ours in _CONFIG:
        if get(hf) is None:
            raise ValueError(f"config lacks {hf!r} (needed for {ours})")
        out[ours] = get(hf)
    act = get("hidden_act")
    if act not in (None, "silu", "swish"):
        raise ValueError(f"config hidden_act must be 'silu' (the conv and gate activation), got "
                         f"{act!r}")
    return out


def _weights(state_dict, prefix):
    sd = {}
    for name in QWEN3_NEXT_KEYS + ("conv1d.bias",):
        key = prefix + name
        if key in state_dict:
            sd[name] = np.asarray(state_dict[key], np.float32)
        elif name != "conv1d.bias":
            raise KeyError(f"state_dict lacks {key!r}")
    return sd


def _check(sd, name, shape):
    if sd[name].shape != shape:
        raise ValueError(f"{name} must have shape {shape} for this config, got "
                         f"{sd[name].shape}")


def from_qwen3_next(state_dict: Mapping, config, *, prefix: str = "", dtype=jnp.bfloat16,
                    param_dtype=jnp.float32, **layer_kw) -> GatedDeltaNet:
    """A `GatedDeltaNet` holding one Qwen3-Next linear-attention layer's weights.

    Args:
      state_dict: arrays keyed as HF names them (numpy, or anything np.asarray takes: a torch
        CPU tensor's .numpy(), a safetensors numpy load); `QWEN3_NEXT_KEYS`, plus conv1d.bias
        where the checkpoint has one.
      config: the model's config (dict or object, see `qwen3_next_layer_kwargs`).
      prefix: key prefix of the layer inside a whole model's state dict, e.g.
        "model.layers.0.linear_attn.".
      dtype, param_dtype: the layer's activation and parameter dtypes.
      **layer_kw: further GatedDeltaNet arguments (backend, sharding_rules, save_mode, ...).

    Builds the layer abstractly (nnx.eval_shape: no random init) and fills every parameter from
    the checkpoint: host-side reshapes and transposes, one copy of the weights. ValueError or
    KeyError names a missing or misshapen entry.
    """
    kw = qwen3_next_layer_kwargs(config)
    sd = _weights(state_dict, prefix)
    D, nk, nv = kw["hidden_size"], kw["num_heads"], kw["num_v_heads"]
    dk, dv, W = kw["head_k_dim"], kw["head_v_dim"], kw["conv_size"]
    if nv % nk:
        raise ValueError(f"linear_num_value_heads ({nv}) must be a multiple of "
                         f"linear_num_key_heads ({nk})")
    r, C = nv // nk, 2 * nk * dk + nv * dv
    for name, shape in (("in_proj_qkvz.weight", (2 * nk * dk + 2 * nv * dv, D)),
                        ("in_proj_ba.weight", (2 * nv, D)), ("conv1d.weight", (C, 1, W)),
                        ("A_log", (nv,)), ("dt_bias", (nv,)), ("norm.weight", (dv,)),
                        ("out_proj.weight", (D, nv * dv)), ("conv1d.bias", (C,))):
        if name in sd:
            _check(sd, name, shape)
    qkvz = sd["in_proj_qkvz.weight"].reshape(nk, 2 * dk + 2 * r * dv, D)
    ba = sd["in_proj_ba.weight"].reshape(nk, 2 * r, D)
    rows = lambda w, a, b: w[:, a:b].reshape(-1, D).T  # [in, out] for nnx.Linear
    values = {
        ("q_proj", "kernel"): rows(qkvz, 0, dk),
        ("k_proj", "kernel"): rows(qkvz, dk, 2 * dk),
        ("v_proj", "kernel"): rows(qkvz, 2 * dk, 2 * dk + r * dv),
        ("g_proj", "kernel"): rows(qkvz, 2 * dk + r * dv, 2 * dk + 2 * r * dv),
        ("b_proj", "kernel"): rows(ba, 0, r),
        ("a_proj", "kernel"): rows(ba, r, 2 * r),
        ("conv_weight",): sd["conv1d.weight"][:, 0, :],
        ("A_log",): sd["A_log"],
        ("dt_bias",): sd["dt_bias"],
        ("o_norm", "weight"): sd["norm.weight"],
        ("o_proj", "kernel"): sd["out_proj.weight"].T,
    }
    if "conv1d.bias" in sd:
        values[("conv_bias",)] = sd["conv1d.bias"]
    layer = nnx.eval_shape(lambda: GatedDeltaNet(
        **kw, **layer_kw, use_gate=True, use_short_conv=True, conv_bias="conv1d.bias" in sd,
        dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)))
    for path, var in nnx.iter_graph(layer):
        if isinstance(var, nnx.Param):
            value = values.pop(tuple(str(p) for p in path))  # every parameter has a source
            var.set_value(jnp.asarray(value, param_dtype))
    assert not values, f"unused weights {sorted(values)}"
    return layer
