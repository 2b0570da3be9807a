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


def check_cu_seqlens(cu_seqlens, B, T, *, name="cu_seqlens", per_row: bool = False):
    """Validate document bounds over T tokens: [N + 1] (then B == 1) or, with per_row, also
    [B, N + 1] (row b's bounds over its own T tokens). Returns the documents per row N."""
    _array(name, cu_seqlens)
    ndim = cu_seqlens.ndim
    if ndim not in ((1, 2) if per_row else (1,)) or cu_seqlens.shape[-1] < 2:
        form = "[N + 1] (B == 1) or per-row [B, N + 1]" if per_row else "1-D [N + 1]"
        raise ValueError(f"{name} must be {form} with N >= 1, got shape "
                         f"{tuple(cu_seqlens.shape)}")
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array (int32), got {cu_seqlens.dtype}")
    if ndim == 1 and B != 1:
        raise ValueError(f"{name} [N + 1] needs a packed batch (B == 1), got B = {B}"
                         + ("; give per-row bounds [B, N + 1] for several rows" if per_row
                            else ""))
    if ndim == 2 and cu_seqlens.shape[0] != B:
        raise ValueError(f"{name} [B, N + 1] must have a row per batch row B = {B}, got shape "
                         f"{tuple(cu_seqlens.shape)}")
    cu = concrete(cu_seqlens)
    if cu is not None:
        for r, row in enumerate(cu.reshape(-1, cu.shape[-1])):
            at = name if ndim == 1 else f"{name}[{r}]"
            if row[0] != 0:
                raise ValueError(f"{at} must start at 0, got {row[0]}")
            if np.any(np.diff(row) < 0):
                raise ValueError(f"{at} must be non-decreasing, got {row.tolist()}")
            if row[-1] != T:
                raise ValueError(f"{at}[-1] must equal the token count T = {T}, got {row[-1]}")
    return cu_seqlens.shape[-1] - 1


def check_arrays(op: str, **named) -> None:
    """TypeError for a jax.ShapeDtypeStruct where `op` computes on values."""
    for name, x in named.items():
        if isinstance(x, jax.ShapeDtypeStruct):
            raise TypeError(f"{op} computes on arrays, but {name} is a jax.ShapeDtypeStruct; for "
                            f"shapes alone use jax.eval_shape({op}, ...) (and saved_layout for "
                            f"the residuals)")


def check_scale(scale) -> None:
    """scale: None or a concrete positive finite real (Python or NumPy scalar, 0-d array)."""
    if scale is None:
        return
    value = concrete(scale)
    if value is None:
        raise TypeError("scale must be a concrete number: it is a static parameter of the "
                        f"kernels, got a traced value {scale!r}; o is linear in scale, so "
                        "multiply o by a traced factor instead")
    if (value.ndim != 0 or value.dtype == bool or not np.issubdtype(value.dtype, np.number)
            or np.iscomplexobj(value)):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"scale must be positive and finite, got {scale!r}")


def check_gdn_inputs(q, k, v, g, beta, *, cu_seqlens, scale, initial_state, save_mode,
                     per_row: bool = False) -> Dims:
    """Dims of valid gdn arguments (N: documents per row); ValueError / TypeError naming the
    argument otherwise. per_row: cu_seqlens may also be [B, N + 1] (then initial_state is
    [B, N, HV, K, V])."""
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
    N = B if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T, per_row=per_row)
    if initial_state is not None:
        _array("initial_state", initial_state)
        rows = (B, N) if cu_seqlens is not None and cu_seqlens.ndim == 2 else (N,)
        if tuple(initial_state.shape) != rows + (HV, K, V):
            form = "[B, N, HV, K, V]" if len(rows) == 2 else "[N, HV, K, V]"
            raise ValueError(f"initial_state must have shape {form} = {rows + (HV, K, V)}, "
                             f"got {tuple(initial_state.shape)}")
        if initial_state.dtype != jnp.float32:
            raise TypeError(f"initial_state must be float32, got {initial_state.dtype}")
    check_scale(scale)
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
    scalar: every row ([N + 1] or [B, N + 1]) keeps the rules checked there (start 0,
    non-decreasing, last == T, lengths multiples of `multiple`). The ops poison their outputs
    and gradients with NaN where this is False (never silently wrong; guards.py)."""
    if concrete(cu_seqlens) is not None:
        return None
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    lengths = cu[..., 1:] - cu[..., :-1]
    return (jnp.all(cu[..., 0] == 0) & jnp.all(cu[..., -1] == T) & jnp.all(lengths >= 0)
            & jnp.all(lengths % multiple == 0))
