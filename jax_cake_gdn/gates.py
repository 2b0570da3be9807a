"""FLA-compatible gate options of `gdn` / `gdn_kcp`: raw gate and raw beta preprocessing.

Same names and meaning as flash-linear-attention's `chunk_gated_delta_rule`
(fla/ops/gated_delta_rule/chunk.py, FLA 0.6.0), so models port line by line:

  use_gate_in_kernel=True, A_log [HV], dt_bias [HV] or None (float32):
      g_raw is the raw gate input and the log decay is
      g = -exp(A_log) * softplus(g_raw + dt_bias)          (float32; FLA's `naive_gdn_gate`)
  use_beta_sigmoid_in_kernel=True:
      beta_raw is the raw logit and beta = sigmoid(beta_raw)
  allow_neg_eigval=True (requires use_beta_sigmoid_in_kernel=True, as in FLA):
      beta = 2 * sigmoid(beta_raw), in (0, 2)

These are small pure jax.numpy functions; `gdn` and `gdn_kcp` call `apply_options` before their
custom_vjp op, so JAX autodiff gives the gradients of the raw g, raw beta, A_log and dt_bias.
This is computed in jax.numpy before the kernels on every backend today (the "cuda" backend
included); fusing it into the cuda prep kernel (gate cumsum) is future work.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from .checks import check_gate_options

__all__ = ["fla_gate", "fla_beta", "apply_options", "saved_layout_gates", "GATE_OPTIONS"]


def fla_gate(g_raw: jax.Array, A_log: jax.Array, dt_bias: jax.Array | None = None) -> jax.Array:
    """Log decay g = -exp(A_log) * softplus(g_raw + dt_bias), float32, shape of g_raw [..., HV].

    A_log and dt_bias are [HV] (broadcast over the leading axes); dt_bias=None adds no bias.
    """
    x = jnp.asarray(g_raw, jnp.float32)
    if dt_bias is not None:
        x = x + jnp.asarray(dt_bias, jnp.float32)
    return -jnp.exp(jnp.asarray(A_log, jnp.float32)) * jax.nn.softplus(x)


def fla_beta(b_raw: jax.Array, *, sigmoid: bool = True,
             allow_neg_eigval: bool = False) -> jax.Array:
    """beta from the raw input: sigmoid(b_raw) if `sigmoid` (else b_raw), times 2 if
    `allow_neg_eigval` (FLA: beta = 2 * sigmoid(b_raw) in (0, 2), so the eigenvalue 1 - beta of
    I - beta k k^T (unit k) lies in (-1, 1))."""
    b = jnp.asarray(b_raw, jnp.float32)
    if sigmoid:
        b = jax.nn.sigmoid(b)
    if allow_neg_eigval:
        b = 2.0 * b
    return b


GATE_OPTIONS = ("use_gate_in_kernel", "A_log", "dt_bias", "use_beta_sigmoid_in_kernel",
                "allow_neg_eigval")


def apply_options(g, beta, *, use_gate_in_kernel: bool = False, A_log=None, dt_bias=None,
                  use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False):
    """(g, beta) as the op consumes them: log decay and beta, after the FLA options above.

    With every option off this returns its inputs unchanged (no extra operations or residuals).
    Arguments are checked by `checks.check_gate_options` (called here). For the backward only the
    raw inputs are kept (checkpoint names `gdn_g_raw`, `gdn_A_log`, `gdn_dt_bias`, `gdn_beta_raw`);
    the elementwise gate and sigmoid are recomputed from them (jax.checkpoint), so each option
    adds one [B, T, HV] float32 residual (plus the [HV] vectors) where plain autodiff of the gate
    keeps three. The gradients are JAX autodiff of `fla_gate` / `fla_beta`.
    """
    check_gate_options(g, beta, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                       dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                       allow_neg_eigval=allow_neg_eigval)
    remat = functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    if use_gate_in_kernel:
        name = lambda x, n: None if x is None else checkpoint_name(x, f"gdn_{n}")
        g = remat(fla_gate)(name(g, "g_raw"), name(A_log, "A_log"), name(dt_bias, "dt_bias"))
    if use_beta_sigmoid_in_kernel:
        f = functools.partial(fla_beta, sigmoid=True, allow_neg_eigval=allow_neg_eigval)
        beta = remat(f)(checkpoint_name(beta, "gdn_beta_raw"))
    return g, beta


def saved_layout_gates(g, beta, **options) -> dict:
    """Residuals `apply_options` adds for the backward: {name: (shape, dtype, bytes)}, read off
    JAX's residual analysis; names without the `gdn_` prefix. g, beta may be abstract."""
    from jax._src.ad_checkpoint import saved_residuals  # public only as print_saved_residuals

    arrays = {n: options.pop(n, None) for n in ("A_log", "dt_bias")}
    given = [n for n, x in arrays.items() if x is not None]

    def f(g, beta, *vecs):
        return apply_options(g, beta, **dict(zip(given, vecs)), **options)

    sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    out = {}
    for aval, desc in saved_residuals(f, sds(g), sds(beta), *(sds(arrays[n]) for n in given)):
        m = re.search(r"named 'gdn_([^']+)'", desc)
        name = m.group(1) if m else f"gates: {desc}"
        dt = jnp.dtype(aval.dtype)
        out[name] = (tuple(aval.shape), dt, int(np.prod(aval.shape)) * dt.itemsize)
    return out
