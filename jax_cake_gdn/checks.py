"""Argument checks shared by gdn, gdn_kcp and short_conv: bad input fails here, by name."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

QKV_DTYPES = (jnp.bfloat16, jnp.float32)
SAVE_MODES = ("light", "full")


class Dims(NamedTuple):
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int  # documents (B when there is no cu_seqlens)


def _array(name, x):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    return x


def _rank(name, x, n, what):
    if x.ndim != n:
        raise ValueError(f"{name} must have rank {n} {what}, got shape {tuple(x.shape)}")


def concrete(x):
    """numpy value of x, or None when x is traced or abstract."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return None
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_cu_seqlens(cu_seqlens, B, T, *, name="cu_seqlens"):
    """Validate cu_seqlens; returns the number of documents (capacity) N."""
    _array(name, cu_seqlens)
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"{name} must be 1-D with at least 2 entries [N + 1], "
                         f"got shape {tuple(cu_seqlens.shape)}")
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array (int32), got {cu_seqlens.dtype}")
    if B != 1:
        raise ValueError(f"{name} needs a packed batch (B == 1), got B = {B}")
    cu = concrete(cu_seqlens)
    if cu is not None:
        if cu[0] != 0:
            raise ValueError(f"{name} must start at 0, got {cu[0]}")
        if np.any(np.diff(cu) < 0):
            raise ValueError(f"{name} must be non-decreasing, got {cu.tolist()}")
        if cu[-1] != T:
            raise ValueError(f"{name}[-1] must equal the token count T = {T}, got {cu[-1]}")
    return cu_seqlens.shape[0] - 1


def check_gdn_inputs(q, k, v, g, beta, *, cu_seqlens, scale, initial_state, save_mode) -> Dims:
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _array(name, x)
    _rank("q", q, 4, "[B, T, H, K]")
    _rank("k", k, 4, "[B, T, H, K]")
    _rank("v", v, 4, "[B, T, HV, V]")
    _rank("g", g, 3, "[B, T, HV]")
    _rank("beta", beta, 3, "[B, T, HV]")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, HV, V] with B, T = {B}, {T}, got {tuple(v.shape)}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, HV):
            raise ValueError(f"{name} must have shape [B, T, HV] = {(B, T, HV)}, "
                             f"got {tuple(x.shape)}")
    if T < 1 or K < 1 or V < 1 or H < 1:
        raise ValueError(f"q and v need T, H, K, V >= 1, got q {tuple(q.shape)}, "
                         f"v {tuple(v.shape)}")
    if HV % H:
        raise ValueError(f"v heads HV = {HV} must be a multiple of q/k heads H = {H} (GVA)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in QKV_DTYPES:
            raise TypeError(f"{name} must be bfloat16 or float32, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, x in (("g", g), ("beta", beta)):
        if x.dtype != jnp.float32:
            raise TypeError(f"{name} must be float32, got {x.dtype}")
    N = B if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T)
    if initial_state is not None:
        _array("initial_state", initial_state)
        if initial_state.shape != (N, HV, K, V):
            raise ValueError(f"initial_state must have shape [N, HV, K, V] = {(N, HV, K, V)}, "
                             f"got {tuple(initial_state.shape)}")
        if initial_state.dtype != jnp.float32:
            raise TypeError(f"initial_state must be float32, got {initial_state.dtype}")
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale must be a positive number or None, got {scale!r}")
    if save_mode not in SAVE_MODES:
        raise ValueError(f"save_mode must be one of {SAVE_MODES}, got {save_mode!r}")
    return Dims(B, T, H, HV, K, V, N)


def check_gate_options(g, beta, *, use_gate_in_kernel: bool, A_log, dt_bias,
                       use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool) -> None:
    """ValueError / TypeError naming the argument for inconsistent or malformed gate options.

    g and beta are the (already checked) [B, T, HV] inputs; HV is read from g's last axis.
    Follows flash-linear-attention: A_log is required with the flag, dt_bias is optional.
    """
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("A_log must be given (float32 [HV]) when use_gate_in_kernel=True")
    else:
        for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
            if x is not None:
                raise ValueError(f"{name} is only used with use_gate_in_kernel=True (then g is the "
                                 "raw gate input); without the flag g is already the log decay")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True "
                         "(beta = 2 * sigmoid(beta_raw), as in flash-linear-attention)")
    HV = g.shape[-1]
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if x is None:
            continue
        _array(name, x)
        if tuple(x.shape) != (HV,):
            raise ValueError(f"{name} must have shape [HV] = {(HV,)}, got {tuple(x.shape)}")
        if x.dtype != jnp.float32:
            raise TypeError(f"{name} must be float32, got {x.dtype}")


def bounds_ok(cu_seqlens, T, multiple: int = 1):
    """None for concrete cu_seqlens (check_cu_seqlens has checked them); for traced ones, a bool
    scalar: they keep the rules checked there (start 0, non-decreasing, last == T, lengths
    multiples of `multiple`). gdn poisons its output and its gradients with NaN where this is
    False (never silently wrong; gdn.bounds_guard)."""
    if concrete(cu_seqlens) is not None:
        return None
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    lengths = cu[1:] - cu[:-1]
    return ((cu[0] == 0) & (cu[-1] == T) & jnp.all(lengths >= 0)
            & jnp.all(lengths % multiple == 0))
