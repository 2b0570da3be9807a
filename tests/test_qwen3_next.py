"""Qwen3-Next weights: our layer, loaded by `from_qwen3_next`, against a float64 numpy
transcription of transformers' `Qwen3NextGatedDeltaNet.forward` (modeling_qwen3_next.py:
fix_query_key_value_ordering, the depthwise Conv1d with padding W - 1, the gates,
torch_recurrent_gated_delta_rule, Qwen3NextRMSNormGated, out_proj; written from HF's code, not
from our layer) on random weights and inputs."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_rms

pytest.importorskip("flax")

from jax_cake_gdn.qwen3_next import QWEN3_NEXT_KEYS, from_qwen3_next  # noqa: E402


def hf_config(nk, nv, dk, dv, D=24, W=4):
    return dict(hidden_size=D, linear_num_key_heads=nk, linear_num_value_heads=nv,
                linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=W,
                rms_norm_eps=1e-6, hidden_act="silu")


def hf_weights(rng, cfg, conv_bias=False):
    D, nk, nv = cfg["hidden_size"], cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, W = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], \
        cfg["linear_conv_kernel_dim"]
    C = 2 * nk * dk + nv * dv
    n = lambda *s, sc=1.0: (rng.standard_normal(s) * sc).astype(np.float32)
    sd = {"in_proj_qkvz.weight": n(2 * nk * dk + 2 * nv * dv, D, sc=D**-0.5),
          "in_proj_ba.weight": n(2 * nv, D, sc=D**-0.5),
          "conv1d.weight": n(C, 1, W, sc=0.5),
          "A_log": np.log(rng.uniform(1, 16, nv)).astype(np.float32),
          "dt_bias": n(nv), "norm.weight": 1 + n(dv, sc=0.1),
          "out_proj.weight": n(D, nv * dv, sc=(nv * dv) ** -0.5)}
    if conv_bias:
        sd["conv1d.bias"] = n(C, sc=0.1)
    return sd


def hf_forward(sd, cfg, x, attention_mask=None):
    """Qwen3NextGatedDeltaNet.forward without a cache, in float64 numpy."""
    sd = {k: np.asarray(v, np.float64) for k, v in sd.items()}
    x = np.asarray(x, np.float64)
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, W = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], \
        cfg["linear_conv_kernel_dim"]
    eps = cfg["rms_norm_eps"]
    silu = lambda t: t / (1 + np.exp(-t))
    # apply_mask_to_padding_states
    if attention_mask is not None and attention_mask.shape[1] > 1 and attention_mask.shape[0] > 1:
        x = x * attention_mask[:, :, None]
    B, T, _ = x.shape
    qkvz = x @ sd["in_proj_qkvz.weight"].T
    ba = x @ sd["in_proj_ba.weight"].T
    # fix_query_key_value_ordering
    qkvz = qkvz.reshape(B, T, nk, 2 * dk + 2 * dv * nv // nk)
    ba = ba.reshape(B, T, nk, 2 * nv // nk)
    r = nv // nk
    q, k, v, z = np.split(qkvz, np.cumsum([dk, dk, r * dv]), axis=3)
    b, a = np.split(ba, [r], axis=3)
    v, z = v.reshape(B, T, -1, dv), z.reshape(B, T, -1, dv)
    b, a = b.reshape(B, T, nv), a.reshape(B, T, nv)
    q, k, v = (t.reshape(B, T, -1) for t in (q, k, v))
    mixed = np.concatenate([q, k, v], -1).transpose(0, 2, 1)  # [B, C, T]
    # nn.Conv1d(groups=C, padding=W-1) then [:, :, :T], silu
    w = sd["conv1d.weight"]  # [C, 1, W]
    padded = np.pad(mixed, ((0, 0), (0, 0), (W - 1, W - 1)))
    conv = sum(w[None, :, 0, j, None] * padded[:, :, j:j + T] for j in range(W))
    if "conv1d.bias" in sd:
        conv = conv + sd["conv1d.bias"][None, :, None]
    mixed = silu(conv).transpose(0, 2, 1)
    key_dim = nk * dk
    q, k, v = np.split(mixed, [key_dim, 2 * key_dim], axis=-1)
    q, k, v = q.reshape(B, T, -1, dk), k.reshape(B, T, -1, dk), v.reshape(B, T, -1, dv)
    beta = 1 / (1 + np.exp(-b))
    g = -np.exp(sd["A_log"]) * np.logaddexp(0, a + sd["dt_bias"])
    q, k = np.repeat(q, r, axis=2), np.repeat(k, r, axis=2)  # repeat_interleave
    # torch_recurrent_gated_delta_rule(use_qk_l2norm_in_kernel=True)
    l2 = lambda t: t / np.sqrt((t * t).sum(-1, keepdims=True) + 1e-6)
    q, k = l2(q) * dk**-0.5, l2(k)
    S = np.zeros((B, nv, dk, dv))
    o = np.zeros((B, T, nv, dv))
    for t in range(T):
        S = S * np.exp(g[:, t])[..., None, None]
        kv_mem = (S * k[:, t, :, :, None]).sum(-2)
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        o[:, t] = (S * q[:, t, :, :, None]).sum(-2)
    # Qwen3NextRMSNormGated(o, z), then out_proj
    o = o * (1 / np.sqrt((o * o).mean(-1, keepdims=True) + eps)) * sd["norm.weight"] * silu(z)
    return o.reshape(B, T, nv * dv) @ sd["out_proj.weight"].T


@pytest.mark.parametrize("nk,nv,dk,dv,conv_bias", [(2, 4, 16, 8, False), (3, 3, 8, 16, True)])
def test_layer_matches_hf_forward(rng, nk, nv, dk, dv, conv_bias):
    cfg = hf_config(nk, nv, dk, dv)
    sd = hf_weights(rng, cfg, conv_bias)
    layer = from_qwen3_next(sd, cfg, dtype=jnp.float32, backend="xla")
    x = rng.standard_normal((2, 77, cfg["hidden_size"])).astype(np.float32)
    ref = hf_forward(sd, cfg, x)
    assert rel_rms(layer(jnp.asarray(x)), ref) <= 3e-6
    if conv_bias:  # HF's zeroed padding feeds silu(bias) into the state: not a dropped token
        return
    # left padding (how HF batches prompts for generation): HF zeroes the padded tokens' inputs,
    # which then leave its state at zero, as our dropping them does
    mask = np.ones((2, 77), np.int64)
    mask[1, :13] = 0
    y = layer(jnp.asarray(x), attention_mask=jnp.asarray(mask))
    assert rel_rms(y, hf_forward(sd, cfg, x, mask)) <= 3e-6


def test_prefix_and_config_object(rng):
    cfg = hf_config(2, 4, 16, 8)  # the first test's shapes: the ops are compiled already
    sd = hf_weights(rng, cfg)
    model_sd = {f"model.layers.3.linear_attn.{k}": v for k, v in sd.items()}
    model_sd["model.layers.3.mlp.gate.weight"] = np.zeros(3)  # other entries are ignored
    cfg_obj = type("Qwen3NextConfig", (), cfg)()
    layer = from_qwen3_next(model_sd, cfg_obj, prefix="model.layers.3.linear_attn.",
                            dtype=jnp.float32, backend="xla")
    x = rng.standard_normal((2, 77, cfg["hidden_size"])).astype(np.float32)
    assert rel_rms(layer(jnp.asarray(x)), hf_forward(sd, cfg, x)) <= 3e-6
    assert layer.dtype == jnp.float32 and layer.q_proj.kernel.dtype == jnp.float32


def test_bad_checkpoints(rng):
    cfg = hf_config(2, 4, 8, 8)
    sd = hf_weights(rng, cfg)
    for key in QWEN3_NEXT_KEYS:
        with pytest.raises(KeyError, match=key):
            from_qwen3_next({k: v for k, v in sd.items() if k != key}, cfg)
    with pytest.raises(ValueError, match="in_proj_ba.weight"):
        from_qwen3_next(dict(sd, **{"in_proj_ba.weight": np.zeros((9, 24))}), cfg)
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        from_qwen3_next(sd, {k: v for k, v in cfg.items() if k != "linear_num_value_heads"})
    with pytest.raises(ValueError, match="hidden_act"):
        from_qwen3_next(sd, dict(cfg, hidden_act="gelu"))
