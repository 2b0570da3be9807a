"""The cuda primitives: jax.ffi.ffi_call into the kernels of cuda/ (sm_90a), via jax_cake_gdn._cuda.

The extension is imported lazily. When it is missing (nvcc absent at install time, or
JAX_CAKE_GDN_NO_CUDA=1, or an import error) `available()` is False, `unavailable_reason()` says
why, and the first request for the cuda backend (`require()`) warns once. Handlers are registered
with XLA (platform "CUDA") once, on first use; lowering for the cuda platform works on a CPU-only
host too, running needs an sm_90 GPU.

Every wrapper checks its arguments (ValueError naming the argument, at trace time): the handlers in
cuda/ read their sizes from the buffers and check nothing again. Every wrapper builds its result
types from its inputs (`_result`), so that under `jax.shard_map`
the results carry the union of the inputs' varying manual axes (vma); without that, gradients
under shard_map are silently wrong (docs/design.md section 2).
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from .. import vma

__all__ = [
    "available",
    "unavailable_reason",
    "gpu_available",
    "require",
    "target_names",
    "gate_cumsum",
    "l2norm_rstd",
    "l2norm_bwd",
    "prep",
    "solve_a",
    "state_walk",
    "replay",
    "walk_output",
    "solve_a_walk_output",
    "walk_bwd",
    "chunk_bwd",
    "walk_chunk_bwd",
    "transfer",
    "transfer_bwd",
    "nan_unless",
    "SUPPORTED_DIMS",
    "supports",
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


def _result(shape, dtype, axes: frozenset) -> jax.ShapeDtypeStruct:
    """A result type varying over `vma` (jax 0.11: `manual_axis_type`, not `vma=`).

    A non-empty manual_axis_type needs the (abstract) mesh in the type, so the result gets the
    current mesh, unsharded over its non-manual axes: per-shard primitives never shard their
    outputs themselves.
    """
    if not axes:
        return jax.ShapeDtypeStruct(shape, dtype)
    mesh = jax.sharding.get_abstract_mesh()
    return jax.ShapeDtypeStruct(
        shape,
        dtype,
        sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
        manual_axis_type=jax.sharding.ManualAxisType(varying=axes),
    )


def _call(target: str, results, *args, input_output_aliases=None, **attrs):
    """ffi_call `jax_cake_gdn_<target>`; `results` is a list of (shape, dtype); inputs' vma is
    unified and carried by every result."""
    _ensure()
    axes = vma.union(*args)
    args = [vma.cast(x, axes) for x in args]
    out_types = [_result(shape, dtype, axes) for shape, dtype in results]
    fn = jax.ffi.ffi_call(_TARGET_PREFIX + target, out_types, vmap_method="sequential",
                          input_output_aliases=input_output_aliases)
    return fn(*args, **attrs)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _below_2_31(fn: str, *sizes) -> None:
    """(what, n) pairs: sizes the kernels index with int32 (grids, tensor-map rows) < 2^31."""
    for what, n in sizes:
        _check(int(n) < 2**31, f"{fn}: {what} = {n} must be below 2^31")


# ------------------------------------------------------------------------------------------------
# Wrappers: one per FFI target (per-shard primitives; no custom_vjp here)
# ------------------------------------------------------------------------------------------------


def gate_cumsum(g, ct):
    """Chunk-local inclusive cumsum of the gate: G[s + t, h] = sum_{u <= t} g[s + u, h].

    g: f32[T, HV]; ct: the chunk table (chunks.ChunkTable; its start and length, int32[NC]:
    0 <= length <= 64, the used chunks cover every token exactly once; length 0 marks an unused
    chunk, whose start may be T). Returns f32[T, HV]. Sequential f32 sum per (chunk, head):
    deterministic.
    """
    fn = "gate_cumsum"
    g = jnp.asarray(g)
    _check(g.ndim == 2, f"{fn}: g must be [T, HV], got shape {g.shape}")
    _check(g.dtype == np.float32, f"{fn}: g must be float32, got {g.dtype}")
    _check(g.shape[1] <= 1 << 20, f"{fn}: HV = {g.shape[1]} must be at most 2^20")
    return _call(fn, [(g.shape, jnp.float32)], g, *_table(fn, ct))[0]


# ------------------------------------------------------------------------------------------------
# The kernels of the primitives (cuda/prep.cu, walk_fwd.cu, transfer.cu, l2norm.cu; the backward
# in walk_bwd.cu, chunk_bwd.cu, walk_chunk_bwd.cu). Each wrapper takes its primitive's arguments
# as primitives/xla.py does (`ct` the chunk table), but A, w, u, v_new, the state tape h and the
# backward's dS_end and dvn are bfloat16 (the f32 values rounded to nearest: every kernel that
# reads them uses them as bf16 operands, u as the start of an f32 accumulator). The cuda
# primitives therefore do not mix with the xla ones at these arrays without a cast
# (primitives/__init__.py: one backend per call). q/k/v may be bfloat16 or float32 (same
# dtype); matrix products run on bf16 tensor cores with float32 accumulation.
# ------------------------------------------------------------------------------------------------

SUPPORTED_DIMS = (64, 128)  # head dims K and V the kernels are instantiated for
_CHUNK = 64
_QKV_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float32))
# An absent optional operand (no L2 norm): f32[1]. Not f32[0]: a zero-size custom-call operand
# crashes XLA's SPMD partitioner (shardy) under shard_map (jax 0.11.2).
_ABSENT = np.zeros((1,), np.float32)
_A_FROM = "as the cuda prep / solve_a return it"
_W_FROM = "as the cuda prep / replay return it"
_VNEW_FROM = "as the cuda state_walk returns it"


def supports(K: int, V: int) -> bool:
    """True when the cuda kernels handle head dims K (q/k) and V (v)."""
    return int(K) in SUPPORTED_DIMS and int(V) in SUPPORTED_DIMS


def _check_dims(fn: str, K: int | None = None, V: int | None = None) -> None:
    if K is not None and int(K) not in SUPPORTED_DIMS:
        raise ValueError(f"{fn}: K = {K} is not supported by the cuda kernels "
                         f"(K must be one of {SUPPORTED_DIMS}); use backend='xla'")
    if V is not None and int(V) not in SUPPORTED_DIMS:
        raise ValueError(f"{fn}: V = {V} is not supported by the cuda kernels "
                         f"(V must be one of {SUPPORTED_DIMS}); use backend='xla'")


def _qkv(fn: str, name: str, x, rank: int = 3):
    x = jnp.asarray(x)
    _check(x.ndim == rank, f"{fn}: {name} must have rank {rank}, got shape {x.shape}")
    _check(np.dtype(x.dtype) in _QKV_DTYPES,
           f"{fn}: {name} must be bfloat16 or float32, got {x.dtype}")
    return x


def _qk(fn: str, q, k):
    """q, k: one rank-3 shape [T, H, K] and one dtype (bf16 or f32)."""
    q = _qkv(fn, "q", q)
    k = _qkv(fn, "k", k)
    _check(k.shape == q.shape, f"{fn}: k must have q's shape {q.shape}, got {k.shape}")
    _check(k.dtype == q.dtype, f"{fn}: k must have q's dtype {q.dtype}, got {k.dtype}")
    return q, k


def _tokens(fn: str, name: str, x, T: int, like, like_name: str):
    """A [T, HV, V] array (v, do) in the dtype of `like` (named like_name): (x, HV, V)."""
    x = _qkv(fn, name, x)
    _check(x.shape[0] == T, f"{fn}: {name} must be [T, HV, V] with T = {T}, got {x.shape}")
    _check(x.dtype == like.dtype,
           f"{fn}: {name} must have {like_name}'s dtype {like.dtype}, got {x.dtype}")
    return x, x.shape[1], x.shape[2]


def _out_dtype(fn: str, out_dtype):
    out_dtype = np.dtype(out_dtype)
    _check(out_dtype in _QKV_DTYPES,
           f"{fn}: out_dtype must be bfloat16 or float32, got {out_dtype}")
    return out_dtype


def _f32(fn: str, name: str, x, shape):
    x = jnp.asarray(x)
    _check(x.dtype == np.float32, f"{fn}: {name} must be float32, got {x.dtype}")
    _check(tuple(x.shape) == tuple(shape),
           f"{fn}: {name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    return x


def _bf16(fn: str, name: str, x, shape, what: str):
    """A bfloat16 intermediate (A, w, u, v_new, h, dS_end) of the given shape; `what` says where it
    comes from."""
    x = jnp.asarray(x)
    _check(x.dtype == jnp.bfloat16,
           f"{fn}: {name} must be bfloat16 ({what}), got {x.dtype}")
    _check(tuple(x.shape) == tuple(shape),
           f"{fn}: {name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    return x


def _i32(fn: str, name: str, x, n: int | None = None):
    x = jnp.asarray(x)
    _check(x.ndim == 1, f"{fn}: {name} must be int32[n], got shape {x.shape}")
    _check(x.dtype == np.int32, f"{fn}: {name} must be int32, got {x.dtype}")
    if n is not None:
        _check(x.shape[0] == n, f"{fn}: {name} must have {n} entries, got {x.shape[0]}")
    return x


def _rstd(fn: str, name: str, r, T: int, H: int):
    if r is None:
        return jnp.asarray(_ABSENT)
    return _f32(fn, name, r, (T, H))


def _heads(fn: str, H: int, HV: int) -> None:
    _check(H > 0 and HV > 0, f"{fn}: H = {H} and HV = {HV} must be positive")
    _check(HV % H == 0, f"{fn}: HV = {HV} must be a multiple of H = {H}")
    _check(HV < 65536, f"{fn}: HV = {HV} must be below 65536")


def _table(fn: str, ct):
    """The chunk table's arrays the kernels take: (chunk_start, chunk_len), int32[NC]."""
    cs = _i32(fn, "chunk_start", ct.start)
    cl = _i32(fn, "chunk_len", ct.length, cs.shape[0])
    _below_2_31(fn, ("NC", cs.shape[0]))
    return cs, cl


def _segments(fn: str, ct):
    """The walks' segment table: (seg_first, seg_last, seg_len), int32[S] each, S >= 1."""
    sl = _i32(fn, "seg_len", ct.seg_len)
    S = sl.shape[0]
    _check(S >= 1, f"{fn}: seg_len must have at least one entry")
    return _i32(fn, "seg_first", ct.seg_first, S), _i32(fn, "seg_last", ct.seg_last, S), sl


def _tables(fn: str, ct):
    """Both tables and seg_order, the segment each walk CTA takes (a permutation of 0..S-1:
    chunks.py puts the longest segment first; a segment it leaves out is not walked)."""
    seg = _segments(fn, ct)
    return _table(fn, ct) + seg + (_i32(fn, "seg_order", ct.seg_order, seg[0].shape[0]),)


def l2norm_rstd(x):
    """x [T, H, K] (bf16/f32) -> 1 / sqrt(sum x^2 + 1e-6), float32 [T, H]. Any K."""
    x = _qkv("l2norm_rstd", "x", x)
    T, H, K = x.shape
    _check(K < 1 << 30, f"l2norm_rstd: K = {K} must be below 2^30")
    _check(K > 0 or T * H == 0, "l2norm_rstd: K must be positive")
    return _call("l2norm_rstd", [(x.shape[:2], jnp.float32)], x)[0]


def l2norm_bwd(dy, x, rstd):
    """The dq / dk epilogue: dy f32[T, HV, K] per value head -> dx [T, H, K] in x's dtype.

    Sums each GVA group (value heads h HV/H .. (h + 1) HV/H - 1 read q/k head h) in a fixed
    order, then the L2-norm backward dx = rstd (d - (d . y) y), y = x rstd (rstd None: dx = d).
    K in SUPPORTED_DIMS.
    """
    fn = "l2norm_bwd"
    x = _qkv(fn, "x", x)
    T, H, K = x.shape
    _check_dims(fn, K=K)
    dy = jnp.asarray(dy)
    _check(dy.ndim == 3 and dy.shape[0] == T and dy.shape[2] == K,
           f"{fn}: dy must be float32 [T, HV, K] with T = {T}, K = {K}, got {dy.shape}")
    _heads(fn, H, dy.shape[1])
    _below_2_31(fn, ("T * H / 8", T * H // 8))
    dy = _f32(fn, "dy", dy, dy.shape)
    r = _rstd(fn, "rstd", rstd, T, H)
    return _call(fn, [(x.shape, x.dtype)], dy, x, r)[0]


def _k_inputs(fn, k, beta, G, rstd_k, ct, HV=None):
    """k bf16/f32 [T, H, K] (K supported), beta and G f32[T, HV] (HV from beta unless given),
    rstd_k, the chunk table: (k, beta, G, rstd_k or its placeholder, (cs, cl))."""
    k = _qkv(fn, "k", k)
    T, H, K = k.shape
    _check_dims(fn, K=K)
    if HV is None:
        beta = jnp.asarray(beta)
        _check(beta.ndim == 2 and beta.shape[0] == T,
               f"{fn}: beta must be float32 [T, HV] with T = {T}, got {beta.shape}")
        HV = beta.shape[1]
    _heads(fn, H, HV)
    beta = _f32(fn, "beta", beta, (T, HV))
    G = _f32(fn, "G", G, (T, HV))
    return k, beta, G, _rstd(fn, "rstd_k", rstd_k, T, H), _table(fn, ct)


def solve_a(k, beta, G, rstd_k, ct):
    """A bf16[NC, HV, 64, 64] alone: `prep`'s A bit for bit (the same kernel with w and u left
    out), for the light forward, whose walk makes w and u itself (`walk_output`). k bf16/f32
    [T, H, K]; beta, G f32[T, HV] (HV from beta); rstd_k f32[T, H] or None."""
    fn = "solve_a"
    k, beta, G, r, tab = _k_inputs(fn, k, beta, G, rstd_k, ct)
    NC, HV = tab[0].shape[0], beta.shape[1]
    _below_2_31(fn, ("NC * HV", NC * HV))
    return _call(fn, [((NC, HV, _CHUNK, _CHUNK), jnp.bfloat16)], k, beta, G, r, *tab)[0]


def prep(k, v, beta, G, rstd_k, ct):
    """A = (I + strictly_lower(beta_i Gam_ij k_i.k_j))^-1 bf16[NC, HV, 64, 64] (computed in f32,
    rounded to nearest: the walks and chunk_bwd use it only as a bf16 operand), then
    w = A diag(beta e^G) K bf16[T, HV, K] (likewise rounded: the walks' operand) and
    u = A diag(beta) V bf16[T, HV, V] (rounded: the walks start their f32 v_new accumulator
    from it), in one kernel. The column scales go on A: w = bf16(A diag(beta e^G rstd_k)) K and
    u = bf16(A diag(beta)) V with K, V as bf16 operands (k unnormalised), so w and u are bitwise
    what `replay` makes from this A (the light backward)."""
    fn = "prep"
    k = _qkv(fn, "k", k)
    v, HV, V = _tokens(fn, "v", v, k.shape[0], k, "k")
    _check_dims(fn, V=V)
    k, beta, G, r, tab = _k_inputs(fn, k, beta, G, rstd_k, ct, HV)
    (T, _, K), NC = k.shape, tab[0].shape[0]
    _below_2_31(fn, ("NC * HV", NC * HV))
    A, w, u = _call(fn, [((NC, HV, _CHUNK, _CHUNK), jnp.bfloat16), ((T, HV, K), jnp.bfloat16),
                         ((T, HV, V), jnp.bfloat16)], k, v, beta, G, r, *tab)
    return A, w, u


def state_walk(k, w, u, G, h0, rstd_k, ct):
    """Walk each segment's chunks in order from its entry state h0 [S, HV, K, V].

    w, u: bfloat16 [T, HV, K], [T, HV, V] as `prep` returns them. Returns h bfloat16
    [NC, HV, K, V] (the state entering each chunk, rounded to nearest from the walk's f32 state:
    the value `chunk_bwd` uses as an operand), v_new bfloat16 [T, HV, V] (likewise rounded from
    f32) and the exit state of each segment float32 [S, HV, K, V] (h0 itself for an empty
    segment). xla.state_walk returns the same h and v_new in float32.
    """
    fn = "state_walk"
    k = _qkv(fn, "k", k)
    T, H, K = k.shape
    u = jnp.asarray(u)
    _check(u.ndim == 3 and u.shape[0] == T, f"{fn}: u must be bfloat16 [T, HV, V], got {u.shape}")
    HV, V = u.shape[1], u.shape[2]
    _check_dims(fn, K=K, V=V)
    _heads(fn, H, HV)
    u = _bf16(fn, "u", u, (T, HV, V), _W_FROM)
    w = _bf16(fn, "w", w, (T, HV, K), _W_FROM)
    G = _f32(fn, "G", G, (T, HV))
    tab = _tables(fn, ct)
    NC, S = tab[0].shape[0], tab[4].shape[0]
    h0 = _f32(fn, "h0", h0, (S, HV, K, V))
    _below_2_31(fn, ("T", T), ("S * HV", S * HV))
    r = _rstd(fn, "rstd_k", rstd_k, T, H)
    return tuple(_call(fn, [((NC, HV, K, V), jnp.bfloat16), ((T, HV, V), jnp.bfloat16),
                            ((S, HV, K, V), jnp.float32)], k, w, u, G, h0, r, *tab))


def _from_a_inputs(fn, k, v, beta, A, G, h0, rstd_k, ct, seg_order=True):
    """The checks of the walks that make w, u from A (walk_output, replay, transfer; A None:
    solve_a_walk_output, which makes it), k checked already: (v, beta, A, G, h0, rstd_k or its
    placeholder, the tables (seg_order too unless seg_order=False))."""
    (T, H, K), NC = k.shape, None
    v, HV, V = _tokens(fn, "v", v, T, k, "k")
    _check_dims(fn, K=K, V=V)
    _heads(fn, H, HV)
    beta = _f32(fn, "beta", beta, (T, HV))
    G = _f32(fn, "G", G, (T, HV))
    tab = _tables(fn, ct) if seg_order else _table(fn, ct) + _segments(fn, ct)
    NC, S = tab[0].shape[0], tab[4].shape[0]
    if A is not None:
        A = _bf16(fn, "A", A, (NC, HV, _CHUNK, _CHUNK), _A_FROM)
    h0 = _f32(fn, "h0", h0, (S, HV, K, V))
    _below_2_31(fn, ("T", T), ("S * HV", S * HV), ("NC * HV * 64", NC * HV * _CHUNK))
    return v, beta, A, G, h0, _rstd(fn, "rstd_k", rstd_k, T, H), tab


def replay(k, v, beta, G, A, h0, rstd_k, ct):
    """`state_walk` on `prep`'s w, u, made on chip from A (the light backward's replay): the
    kernel rounds A diag(beta e^G rstd) and A diag(beta) to bf16 and multiplies k and v by them
    in the order prep does, so h, v_new and w are bit for bit those of `state_walk` on prep's
    w, u.

    k, v: bf16/f32 (same dtype; k [T, H, K], v [T, HV, V]); beta, G f32[T, HV]; A
    bf16[NC, HV, 64, 64] as `solve_a` / `prep` return it; h0, rstd_k and the table as
    `state_walk`. Returns w bf16[T, HV, K], None (u stays on chip: chunk_bwd does not read it),
    h bf16[NC, HV, K, V] and v_new bf16[T, HV, V], as xla.replay; the kernel's exit states are
    not returned (walk_output's are the same). Few chains: two CTAs a head, as `walk_output`.
    """
    fn = "replay"
    k = _qkv(fn, "k", k)
    v, beta, A, G, h0, r, tab = _from_a_inputs(fn, k, v, beta, A, G, h0, rstd_k, ct)
    (T, _, K), (NC, HV), S, V = k.shape, A.shape[:2], h0.shape[0], v.shape[2]
    h, v_new, w, _ = _call(fn, [((NC, HV, K, V), jnp.bfloat16), ((T, HV, V), jnp.bfloat16),
                                ((T, HV, K), jnp.bfloat16), ((S, HV, K, V), jnp.float32)],
                           k, v, beta, A, G, h0, r, *tab, column_tiles=_column_tiles(fn, V))
    return w, None, h, v_new


_WALK_TILES = [0]  # walk_column_tiles' stack; 0: the kernel's choice


@contextlib.contextmanager
def walk_column_tiles(n: int):
    """Within the block, `walk_output`, `solve_a_walk_output` and `replay` calls that are traced
    run their walk in `n` column tiles: 0 (default) lets the kernel choose (two CTAs of 64 value
    columns a head when the chains are few), 1 keeps one CTA a head, 2 asks for two (V = 128
    only; a ValueError otherwise). Every result is the same bit for bit; only the speed differs.
    For tests and benchmarks that compare the two in one process: it applies when a call is
    traced, so a jitted function keeps the choice it was first traced with."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n not in (0, 1, 2):
        raise ValueError(f"walk_column_tiles: n must be 0, 1 or 2, got {n!r}")
    _WALK_TILES.append(int(n))
    try:
        yield
    finally:
        _WALK_TILES.pop()


def _column_tiles(fn: str, V: int) -> np.int32:
    """The column_tiles attribute of a walk call (walk_column_tiles)."""
    n = _WALK_TILES[-1]
    _check(n != 2 or V == 128, f"{fn}: two column tiles (walk_column_tiles(2)) need V = 128, "
           f"got V = {V}")
    return np.int32(n)


def walk_output(q, k, v, beta, A, G, h0, rstd_q, rstd_k, ct, *, scale: float, out_dtype,
                tapes: bool = False):
    """w, u from A, state_walk and output in one kernel (the light forward): w, u, h and v_new
    never leave the chip, unless `tapes` (the full forward: the same walk also stores them).

    q, k, v: bf16/f32 (same dtype; q, k [T, H, K], v [T, HV, V]); beta f32[T, HV]; A
    bf16[NC, HV, 64, 64] as `solve_a` returns it; G, h0, rstd_k and the table as `state_walk`;
    rstd_q f32[T, H] or None. The kernel makes w = bf16(A diag(beta e^G r)) K and
    u = bf16(A diag(beta)) V as bf16 on chip, as prep does, and takes q, k unnormalised (the
    rstd factors go on accumulators and v_new). Returns o [T, HV, V] in out_dtype and the exit
    state of each segment f32[S, HV, K, V]; with `tapes` also w bf16[T, HV, K], None (u),
    h bf16[NC, HV, K, V] and v_new bf16[T, HV, V], as xla.walk_output: bit for bit `replay`'s
    (o and the exit states bit for bit those without). With few chains (segments x value heads
    at most 3/8 of the SMs) and V = 128 the kernel runs as two CTAs of 64 value columns a head
    (the recurrence is column-wise in V; each makes w itself), every result bit for bit the same
    (JAX_CAKE_GDN_WALK_TILES=1: one CTA a head; `walk_column_tiles` chooses per traced call).
    """
    fn = "walk_output"
    q, k = _qk(fn, q, k)
    v, beta, A, G, h0, rk, tab = _from_a_inputs(fn, k, v, beta, A, G, h0, rstd_k, ct)
    (T, H, K), (NC, HV), S, V = q.shape, A.shape[:2], h0.shape[0], v.shape[2]
    rq = _rstd(fn, "rstd_q", rstd_q, T, H)
    results = _walk_output_results(T, NC, S, HV, K, V, _out_dtype(fn, out_dtype), tapes)
    out = _call("walk_output_tapes" if tapes else fn, results, q, k, v, beta, A, G, h0, rq, rk,
                *tab, scale=np.float32(scale), column_tiles=_column_tiles(fn, V))
    return _walk_output_returns(out, tapes)


def _walk_output_results(T, NC, S, HV, K, V, out_dtype, tapes):
    """The FFI results of walk_output(_tapes): o, exit states (and the tapes h, v_new, w)."""
    results = [((T, HV, V), out_dtype), ((S, HV, K, V), jnp.float32)]
    if tapes:
        results += [((NC, HV, K, V), jnp.bfloat16), ((T, HV, V), jnp.bfloat16),
                    ((T, HV, K), jnp.bfloat16)]
    return results


def _walk_output_returns(out, tapes):
    """walk_output's return from those results: (o, final) or (o, final, w, None, h, v_new)."""
    if not tapes:
        return tuple(out)
    o, final, h, v_new, w = out
    return o, final, w, None, h, v_new  # u stays on chip, as in replay


def solve_a_walk_output(q, k, v, beta, G, h0, rstd_q, rstd_k, ct, *, scale: float, out_dtype,
                        tapes: bool = False):
    """`solve_a` then `walk_output` on its A in one call: (A,) + walk_output's results, each bit
    for bit what the two calls give. When the walk's CTAs (one per segment and value head) fill
    at most half the SMs and q, k, v are bf16, solve_a runs on the other SMs and the walk starts
    behind it (programmatic dependent launch; JAX_CAKE_GDN_PDL=0: after it), waiting for each
    chunk's A on a flag (cuda/handoff.cuh): one long document then pays for solve_a on idle SMs.
    Inputs as walk_output takes them, without A."""
    fn = "solve_a_walk_output"
    q, k = _qk(fn, q, k)
    v, beta, _, G, h0, rk, tab = _from_a_inputs(fn, k, v, beta, None, G, h0, rstd_k, ct)
    (T, H, K), NC, HV, S, V = q.shape, tab[0].shape[0], beta.shape[1], h0.shape[0], v.shape[2]
    rq = _rstd(fn, "rstd_q", rstd_q, T, H)
    results = ([((NC, HV, _CHUNK, _CHUNK), jnp.bfloat16), ((1 + NC * HV,), jnp.int32)]  # A, flags
               + _walk_output_results(T, NC, S, HV, K, V, _out_dtype(fn, out_dtype), tapes))
    out = _call(fn + ("_tapes" if tapes else ""), results, q, k, v, beta, G, h0, rq, rk, *tab,
                scale=np.float32(scale), column_tiles=_column_tiles(fn, V))
    return (out[0],) + _walk_output_returns(out[2:], tapes)


def transfer(k, v, beta, G, A, h0, rstd_k, ct, m_seg, b_seg):
    """The units' affine summaries (xla.transfer), one state-only walk: M f32[U, HV, K, K], the
    transfer matrix of segment m_seg[u], and B f32[U, HV, K, V], the exit of segment b_seg[u]
    from h0[b_seg[u]]; zero where the index is -1 (a CTA with nothing to summarise exits at
    once). k, v, beta, G, A, h0, rstd_k and the table as `replay` takes them (its seg_order is
    not read: the CTAs are (kind, unit, head)); m_seg, b_seg int32[U]. w, u are made on chip
    from A as prep makes them; the state stays f32."""
    fn = "transfer"
    k = _qkv(fn, "k", k)
    v, beta, A, G, h0, r, tab = _from_a_inputs(fn, k, v, beta, A, G, h0, rstd_k, ct,
                                               seg_order=False)
    HV, K, V = A.shape[1], k.shape[2], v.shape[2]
    b_seg = _i32(fn, "b_seg", b_seg)
    U = b_seg.shape[0]
    m_seg = _i32(fn, "m_seg", m_seg, U)
    _check(U >= 1, f"{fn}: b_seg must have at least one entry")
    _below_2_31(fn, ("2 U * HV", 2 * U * HV))
    B, M = _call(fn, [((U, HV, K, V), jnp.float32), ((U, HV, K, K), jnp.float32)],
                 k, v, beta, A, G, h0, r, *tab, jnp.concatenate([b_seg, m_seg]))
    return M, B


# ------------------------------------------------------------------------------------------------
# Backward kernels (cuda/walk_bwd.cu, chunk_bwd.cu; both in one call: walk_chunk_bwd.cu).
# ------------------------------------------------------------------------------------------------


def _walk_bwd_inputs(fn, q, k, w, G, do, dfinal, rstd_q, rstd_k, ct, slots="seg_order"):
    """The reverse walk's checked and converted inputs: (q, k, w, G, do, dfinal, rstd_q, rstd_k,
    the tables); slots="seg_order": seg_order among them, else the caller adds its own."""
    q, k = _qk(fn, q, k)
    T, H, K = q.shape
    do = _qkv(fn, "do", do)
    _check(do.shape[0] == T, f"{fn}: do must be [T, HV, V] with T = {T}, got {do.shape}")
    HV, V = do.shape[1], do.shape[2]
    _check_dims(fn, K=K, V=V)
    _heads(fn, H, HV)
    do = do.astype(q.dtype)
    w = _bf16(fn, "w", w, (T, HV, K), _W_FROM)
    G = _f32(fn, "G", G, (T, HV))
    tab = _tables(fn, ct) if slots == "seg_order" else _table(fn, ct) + _segments(fn, ct)
    S = tab[4].shape[0]
    dfinal = _f32(fn, "dfinal", dfinal, (S, HV, K, V))
    rq = _rstd(fn, "rstd_q", rstd_q, T, H)
    rk = _rstd(fn, "rstd_k", rstd_k, T, H)
    _below_2_31(fn, ("S * HV * V / 64", S * HV * (V // 64)))
    return q, k, w, G, do, dfinal, rq, rk, tab


def _walk_bwd_results(NC, S, HV, K, V):  # dS_end, dh0, dvn
    return [((NC, HV, K, V), jnp.bfloat16), ((S, HV, K, V), jnp.float32),
            ((NC, HV, _CHUNK, V), jnp.bfloat16)]


def walk_bwd(q, k, w, G, do, dfinal, scores, rstd_q, rstd_k, ct, *, scale: float):
    """Reverse walk for the state gradients (xla.walk_bwd).

    q, k: bf16/f32 [T, H, K]; w bf16[T, HV, K]; G f32[T, HV]; do [T, HV, V] (cast to q's dtype:
    the kernel rounds it to bf16 anyway); dfinal f32[S, HV, K, V]; scores None (the kernel
    recomputes Att); rstd_q, rstd_k f32[T, H] or None.
    Returns dS_end bf16[NC, HV, K, V] (gradient of each chunk's exit state, rounded to nearest
    from the walk's f32 gradient: `chunk_bwd` uses it only as a bf16 operand; 0 for unused chunks;
    xla.walk_bwd returns it in float32), dh0 f32[S, HV, K, V] (gradient of each segment's entry
    state; dfinal for an empty one) and dvn bf16[NC, HV, 64, V] (gradient of each chunk's v_new
    rows, padding rows and unused chunks 0: the walk's bf16 operand, which `chunk_bwd` reads
    instead of recomputing it).
    """
    fn = "walk_bwd"
    _check(scores is None, f"{fn}: scores must be None (the cuda kernel recomputes Att)")
    q, k, w, G, do, dfinal, rq, rk, tab = _walk_bwd_inputs(fn, q, k, w, G, do, dfinal, rstd_q,
                                                           rstd_k, ct)
    K, (HV, V), NC, S = q.shape[2], do.shape[1:], tab[0].shape[0], dfinal.shape[0]
    _below_2_31(fn, ("NC * HV * K", NC * HV * K))
    return tuple(_call(fn, _walk_bwd_results(NC, S, HV, K, V), q, k, w, G, do, dfinal, rq, rk,
                       *tab, scale=np.float32(scale)))


def transfer_bwd(q, k, w, G, do, dfinal, rstd_q, rstd_k, ct, seg, *, scale: float):
    """The backward twin of `transfer` (xla.transfer_bwd): per unit u, the gradient of segment
    seg[u]'s entry state from its exit gradient dfinal[s], f32 [U, HV, K, V] (zero where
    seg[u] = -1): walk_bwd's reverse walk without its tapes. Inputs as `walk_bwd` takes them
    (Att recomputed); seg int32[U] (the FFI's unit_seg)."""
    fn = "transfer_bwd"
    q, k, w, G, do, dfinal, rq, rk, tab = _walk_bwd_inputs(fn, q, k, w, G, do, dfinal, rstd_q,
                                                           rstd_k, ct, slots="unit_seg")
    HV, K, V = do.shape[1], q.shape[2], do.shape[2]
    unit_seg = _i32(fn, "unit_seg", seg)
    U = unit_seg.shape[0]
    _check(U >= 1, f"{fn}: unit_seg must have at least one entry")
    _below_2_31(fn, ("U * HV * V / 64", U * HV * (V // 64)))
    return _call(fn, [((U, HV, K, V), jnp.float32)], q, k, w, G, do, dfinal, rq, rk, *tab,
                 unit_seg, scale=np.float32(scale))[0]


def _chunk_bwd_inputs(fn, q, k, v, beta, G, A, h, v_new, do, rstd_q, rstd_k, ct):
    """chunk_bwd's checked and converted inputs (but dS_end, dvn); the table as one tuple."""
    q, k = _qk(fn, q, k)
    T, H, K = q.shape
    v, HV, V = _tokens(fn, "v", v, T, q, "q")
    _check_dims(fn, K=K, V=V)
    _heads(fn, H, HV)
    do = _qkv(fn, "do", do)
    _check(do.shape == v.shape, f"{fn}: do must have v's shape {v.shape}, got {do.shape}")
    do = do.astype(q.dtype)
    beta = _f32(fn, "beta", beta, (T, HV))
    G = _f32(fn, "G", G, (T, HV))
    cs, cl = _table(fn, ct)
    NC = cs.shape[0]
    A = _bf16(fn, "A", A, (NC, HV, _CHUNK, _CHUNK), _A_FROM)
    h = _bf16(fn, "h", h, (NC, HV, K, V), "the cuda state walk's tape")
    v_new = _bf16(fn, "v_new", v_new, (T, HV, V), _VNEW_FROM)
    rq = _rstd(fn, "rstd_q", rstd_q, T, H)
    rk = _rstd(fn, "rstd_k", rstd_k, T, H)
    _below_2_31(fn, ("NC * HV * K", NC * HV * K))
    return q, k, v, beta, G, A, h, v_new, do, rq, rk, (cs, cl)


def _chunk_bwd_results(T, H, HV, K, V, v_dtype, deterministic):  # dQ, dK, dv, dg, dbeta
    f32 = jnp.float32
    HQ = HV if deterministic else H  # the kernel sums the groups when HQ = H < HV
    return [((T, HQ, K), f32), ((T, HQ, K), f32), ((T, HV, V), v_dtype), ((T, HV), f32),
            ((T, HV), f32)]


def chunk_bwd(q, k, v, beta, G, A, w, u, h, v_new, scores, dS_end, dvn, do, rstd_q, rstd_k, ct,
              *, scale: float, deterministic: bool = True):
    """Everything after the reverse walk, parallel over (chunk, value head) (xla.chunk_bwd; w, u
    and scores are not read: they enter only via h, v_new, and Att is recomputed).

    q, k: bf16/f32 [T, H, K]; v [T, HV, V] in q's dtype; do [T, HV, V] (cast to q's dtype: the
    kernel rounds it to bf16 anyway); beta, G f32[T, HV]; A bf16[NC, HV, 64, 64] (as the cuda
    `prep` returns it); h, dS_end bf16[NC, HV, K, V] (as the cuda `state_walk` and `walk_bwd`
    return them; f32 ones from the xla primitives must be cast first, which rounds them as this
    kernel did before it took bf16); dvn bf16[NC, HV, 64, V] (as the cuda `walk_bwd` returns
    it); v_new bf16[T, HV, V] (as the cuda `state_walk` returns it); rstd_q, rstd_k f32[T, H] or
    None. h, v_new, dS_end and dvn enter every product as bf16 operands and e^{G_C}
    sum(dS_end o h) (dg) sums their bf16 values in f32.
    Returns (dq, dk [T, H, K], dv [T, HV, V]) in the dtypes of q, k, v and (dg, dbeta) f32[T, HV].
    The kernel gives dq, dk w.r.t. the normalised q, k and `l2norm_bwd` (a second kernel) applies
    the L2-norm backward. deterministic=True: the kernel writes them per value head (f32[T, HV,
    K]) and `l2norm_bwd` sums each GVA group in a fixed order. deterministic=False with H < HV:
    the kernel adds the value heads of a group into f32[T, H, K] itself (atomic adds in the order
    the CTAs reach them: dq, dk can differ in the last bits from run to run; an f32 hand-off H/HV
    the size).
    """
    del w, u, scores
    fn = "chunk_bwd"
    q, k, v, beta, G, A, h, v_new, do, rq, rk, tab = _chunk_bwd_inputs(
        fn, q, k, v, beta, G, A, h, v_new, do, rstd_q, rstd_k, ct)
    (T, H, K), (HV, V), NC = q.shape, v.shape[1:], tab[0].shape[0]
    dS_end = _bf16(fn, "dS_end", dS_end, (NC, HV, K, V), "as the cuda walk_bwd returns it")
    dvn = _bf16(fn, "dvn", dvn, (NC, HV, _CHUNK, V), "as the cuda walk_bwd returns it")
    dQ, dK, dv, dg, dbeta = _call(
        fn, _chunk_bwd_results(T, H, HV, K, V, v.dtype, deterministic),
        q, k, v, beta, G, A, h, v_new, dS_end, dvn, do, rq, rk, *tab, scale=np.float32(scale))
    return l2norm_bwd(dQ, q, rstd_q), l2norm_bwd(dK, k, rstd_k), dv, dg, dbeta


def walk_chunk_bwd(q, k, v, beta, G, A, w, u, h, v_new, do, dfinal, rstd_q, rstd_k, ct, *,
                   scale: float, deterministic: bool = True):
    """walk_bwd and chunk_bwd in one call (xla.walk_chunk_bwd; u is not read): the inputs as
    those two take them. chunk_bwd's CTAs start while the walk runs (programmatic dependent
    launch; JAX_CAKE_GDN_PDL=0: after it), on the SMs its longest-first schedule leaves idle, last
    chunk first, each waiting for its item's dS_end and dvn (cuda/handoff.cuh). Each item is
    computed as chunk_bwd alone computes it: the results are bit for bit the two calls'
    (deterministic=False: up to the order of the atomic adds, as there).
    Returns (dq, dk, dv, dg, dbeta) as chunk_bwd and dh0 as walk_bwd returns them.
    """
    del u
    fn = "walk_chunk_bwd"
    q, k, v, beta, G, A, h, v_new, do, rq, rk, _ = _chunk_bwd_inputs(
        fn, q, k, v, beta, G, A, h, v_new, do, rstd_q, rstd_k, ct)
    _, _, w, G, do, dfinal, _, _, tab = _walk_bwd_inputs(fn, q, k, w, G, do, dfinal, rstd_q,
                                                         rstd_k, ct)
    (T, H, K), (HV, V), NC, S = q.shape, v.shape[1:], tab[0].shape[0], dfinal.shape[0]
    results = (_walk_bwd_results(NC, S, HV, K, V)
               + _chunk_bwd_results(T, H, HV, K, V, v.dtype, deterministic)
               + [((1 + NC * HV,), jnp.int32)])  # the hand-off (scratch)
    _, dh0, _, dQ, dK, dv, dg, dbeta, _ = _call(
        fn, results, q, k, v, beta, w, G, A, h, v_new, do, dfinal, rq, rk, *tab,
        scale=np.float32(scale))
    return l2norm_bwd(dQ, q, rstd_q), l2norm_bwd(dK, k, rstd_k), dv, dg, dbeta, dh0


# ------------------------------------------------------------------------------------------------
# Short conv (cuda/conv.cu): the non-context-parallel short_conv, forward and backward. x [T, C]
# and weight [C, W] (W <= 4) bf16 or f32 (each its own), pos int32[T] = position of each token
# inside its document (taps before the document start read zero); activation "silu" or None.
# ------------------------------------------------------------------------------------------------

__all__ += ["conv_fwd", "conv_bwd", "conv_partials"]

CONV_MAX_WIDTH = 4
_CONV_MIN_TOKENS = 64  # the backward's token block per dweight partial: at least this many
_CONV_MAX_PARTIALS = 128  # and at most this many partials (workspace f32[NB, C, W]: 21 MB at
# C = 10240, W = 4; each backward CTA then walks >= 4 tiles of 64 tokens at T = 32768)


def nan_unless(x, ok):
    """x, or NaN everywhere (every byte 0xFF) when the bool / int scalar ok is false, in place
    (the result aliases x): costs a launch, not a pass over x. x: bf16, f16, f32 or f64."""
    _check(x.dtype in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64),
           f"nan_unless: x must be bf16, f16, f32 or f64, got {x.dtype}")
    _check(jnp.ndim(ok) == 0, f"nan_unless: ok must be a scalar, got shape {jnp.shape(ok)}")
    ok = jnp.asarray(ok).astype(jnp.int32)
    (out,) = _call("nan_unless", [(x.shape, x.dtype)], x, ok, input_output_aliases={0: 0})
    return out


def conv_partials(T: int) -> int:
    """NB, the number of token blocks (dweight partial sums) of conv_bwd over T tokens."""
    return max(1, min(-(-int(T) // _CONV_MIN_TOKENS), _CONV_MAX_PARTIALS))


def _conv_args(fn: str, x, weight, pos, activation):
    x = jnp.asarray(x)
    weight = jnp.asarray(weight)
    _check(x.ndim == 2, f"{fn}: x must be [T, C], got shape {x.shape}")
    _check(np.dtype(x.dtype) in _QKV_DTYPES,
           f"{fn}: x must be bfloat16 or float32, got {x.dtype}")
    T, C = x.shape
    _check(weight.ndim == 2 and weight.shape[0] == C,
           f"{fn}: weight must be [C, W] with C = {C}, got shape {weight.shape}")
    _check(1 <= weight.shape[1] <= CONV_MAX_WIDTH,
           f"{fn}: weight width W must be in 1..{CONV_MAX_WIDTH}, got {weight.shape[1]}")
    _check(np.dtype(weight.dtype) in _QKV_DTYPES,
           f"{fn}: weight must be bfloat16 or float32, got {weight.dtype}")
    pos = _i32(fn, "pos", pos, T)
    _check(activation in ("silu", None),
           f"{fn}: activation must be 'silu' or None, got {activation!r}")
    _check(C <= 65535 * 32, f"{fn}: C = {C} must be at most 65535 * 32")
    return x, weight, pos, np.int32(activation == "silu")


def conv_fwd(x, weight, pos, *, activation="silu"):
    """y = act(causal depthwise conv of x per document) [T, C] in x's dtype (f32 arithmetic)."""
    x, weight, pos, act = _conv_args("conv_fwd", x, weight, pos, activation)
    _below_2_31("conv_fwd", ("T / 64 + 1", x.shape[0] // 64 + 1))  # its CTAs
    return _call("conv_fwd", [(x.shape, x.dtype)], x, weight, pos, activation=act)[0]


def conv_bwd(x, weight, pos, dy, *, activation="silu"):
    """(dx [T, C] in x's dtype, dweight [C, W] in weight's dtype) of conv_fwd for cotangent dy
    (cast to x's dtype). dweight: f32 sums per token block, added in a fixed order (deterministic,
    no atomics), then cast."""
    fn = "conv_bwd"
    x, weight, pos, act = _conv_args(fn, x, weight, pos, activation)
    dy = jnp.asarray(dy)
    _check(dy.shape == x.shape, f"{fn}: dy must have x's shape {x.shape}, got {dy.shape}")
    dy = dy.astype(x.dtype)
    NB = conv_partials(x.shape[0])
    dx, dw, _ = _call(fn, [(x.shape, x.dtype), (weight.shape, jnp.float32),
                           ((NB,) + weight.shape, jnp.float32)],
                      x, weight, pos, dy, activation=act)
    return dx, dw.astype(weight.dtype)
