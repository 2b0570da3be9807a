"""The cuda primitives: jax.ffi.ffi_call into the kernels of cuda/ (sm_90a), via jax_cake_gdn._cuda.

The extension is imported lazily. When it is missing (nvcc absent at install time, or
JAX_CAKE_GDN_NO_CUDA=1, or an import error) `available()` is False, `unavailable_reason()` says
why, and the first request for the cuda backend (`require()`) warns once. Handlers are registered
with XLA (platform "CUDA") once, on first use; lowering for the cuda platform works on a CPU-only
host too, running needs an sm_90 GPU.

Every wrapper builds its result types from its inputs (`_result`), so that under `jax.shard_map`
the results carry the union of the inputs' varying manual axes (vma); without that, gradients
under shard_map are silently wrong (DESIGN.md section 2).
"""

from __future__ import annotations

import importlib
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "available",
    "unavailable_reason",
    "gpu_available",
    "require",
    "target_names",
    "gate_cumsum",
]

_TARGET_PREFIX = "jax_cake_gdn_"

# ------------------------------------------------------------------------------------------------
# Extension loading and registration
# ------------------------------------------------------------------------------------------------

_lock = threading.Lock()
_ext = None  # the jax_cake_gdn._cuda module once loaded
_reason: str | None = None  # why it is unavailable (None: not tried yet, or loaded)
_tried = False
_registered = False
_warned = False


def _load():
    """Import jax_cake_gdn._cuda once; remember the failure reason."""
    global _ext, _reason, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _ext = importlib.import_module("jax_cake_gdn._cuda")
            except ImportError as e:
                _ext = None
                if getattr(e, "name", None) == "jax_cake_gdn._cuda":
                    _reason = (
                        "the CUDA extension jax_cake_gdn._cuda was not built (no nvcc found at "
                        "install time, or JAX_CAKE_GDN_NO_CUDA=1 was set); reinstall with nvcc "
                        "on PATH or CUDA_HOME set"
                    )
                else:
                    _reason = f"importing jax_cake_gdn._cuda failed: {e}"
    return _ext


def available() -> bool:
    """True when the CUDA extension is importable (says nothing about a GPU being present)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why `available()` is False (None when it is True)."""
    _load()
    return _reason


def gpu_available() -> bool:
    """True when JAX sees a CUDA device."""
    try:
        return len(jax.devices("cuda")) > 0
    except RuntimeError:
        return False


def target_names() -> tuple[str, ...]:
    """The FFI target names the extension provides (empty when it is unavailable)."""
    ext = _load()
    return tuple(sorted(ext.registrations())) if ext is not None else ()


def _register(ext) -> None:
    global _registered
    with _lock:
        if not _registered:
            for name, capsule in ext.registrations().items():
                jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
            _registered = True


def require() -> bool:
    """Make the cuda backend ready: load the extension and register its FFI targets.

    Returns False (after warning once, with the reason) when the extension is unavailable, so a
    backend selector can fall back to xla.
    """
    global _warned
    ext = _load()
    if ext is None:
        if not _warned:
            _warned = True
            warnings.warn(
                f"jax_cake_gdn: the cuda backend is unavailable: {_reason}. "
                "Using it will fail; the xla backend still works.",
                RuntimeWarning,
                stacklevel=2,
            )
        return False
    _register(ext)
    return True


def _ensure() -> None:
    if not require():
        raise RuntimeError(f"jax_cake_gdn cuda backend unavailable: {_reason}")


# ------------------------------------------------------------------------------------------------
# Result types carrying the inputs' varying manual axes
# ------------------------------------------------------------------------------------------------


def _vma(x) -> frozenset:
    """The varying manual axes of x (empty outside shard_map or with check_vma=False)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax 0.11: ManualAxisType; older jax: aval.vma
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def _vma_union(*xs) -> frozenset:
    return frozenset().union(*(_vma(x) for x in xs))


def _match_vma(vma: frozenset, *xs):
    """Cast every input to vary over `vma` (ffi_call wants equal vma on all operands)."""
    out = []
    for x in xs:
        missing = tuple(sorted(vma - _vma(x), key=str))
        out.append(jax.lax.pcast(x, missing, to="varying") if missing else x)
    return out


def _result(shape, dtype, vma: frozenset) -> jax.ShapeDtypeStruct:
    """A result type varying over `vma` (jax 0.11: `manual_axis_type`, not `vma=`).

    A non-empty manual_axis_type needs the (abstract) mesh in the type, so the result gets the
    current mesh, unsharded over its non-manual axes: per-shard primitives never shard their
    outputs themselves.
    """
    if not vma:
        return jax.ShapeDtypeStruct(shape, dtype)
    mesh = jax.sharding.get_abstract_mesh()
    return jax.ShapeDtypeStruct(
        shape,
        dtype,
        sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
        manual_axis_type=jax.sharding.ManualAxisType(varying=vma),
    )


def _call(target: str, results, *args, **attrs):
    """ffi_call `jax_cake_gdn_<target>`; `results` is a list of (shape, dtype); inputs' vma is
    unified and carried by every result."""
    _ensure()
    vma = _vma_union(*args)
    args = _match_vma(vma, *args)
    out_types = [_result(shape, dtype, vma) for shape, dtype in results]
    fn = jax.ffi.ffi_call(_TARGET_PREFIX + target, out_types, vmap_method="sequential")
    return fn(*args, **attrs)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


# ------------------------------------------------------------------------------------------------
# Wrappers: one per FFI target (per-shard primitives; no custom_vjp here)
# ------------------------------------------------------------------------------------------------


def gate_cumsum(g, chunk_start, chunk_len):
    """Chunk-local inclusive cumsum of the gate: G[s + t, h] = sum_{u <= t} g[s + u, h].

    g: f32[T, HV]; chunk_start, chunk_len: int32[NC] (0 <= chunk_len <= 64, the used chunks cover
    every token exactly once; chunk_len == 0 marks an unused chunk, whose start may be T).
    Returns f32[T, HV]. Sequential f32 sum per (chunk, head): deterministic.
    """
    g = jnp.asarray(g)
    chunk_start = jnp.asarray(chunk_start)
    chunk_len = jnp.asarray(chunk_len)
    _check(g.ndim == 2, f"gate_cumsum: g must be [T, HV], got shape {g.shape}")
    _check(g.dtype == np.float32, f"gate_cumsum: g must be float32, got {g.dtype}")
    for name, a in (("chunk_start", chunk_start), ("chunk_len", chunk_len)):
        _check(a.ndim == 1, f"gate_cumsum: {name} must be [NC], got shape {a.shape}")
        _check(a.dtype == np.int32, f"gate_cumsum: {name} must be int32, got {a.dtype}")
    _check(
        chunk_start.shape == chunk_len.shape,
        f"gate_cumsum: chunk_start {chunk_start.shape} and chunk_len {chunk_len.shape} differ",
    )
    return _call("gate_cumsum", [(g.shape, jnp.float32)], g, chunk_start, chunk_len)[0]
