"""Benchmark workloads (docs/design.md, performance protocol), their random inputs, and the
floor model.

Every workload is packed (B = 1) with `cu_seqlens`. Inputs are generated on the host in numpy, so
every framework times the same values: bf16 arrays are rounded to bf16 once and stored as
float32 (exactly representable), arms cast them to their own bf16.

Names: `B23` (`B23rev`: its documents in reverse order), `long`, `small_heads`, `long131k`,
`long262k`, `tiny`; append `-layer` (e.g. `B23-layer`) for the layer variant, a short causal conv
(W = 4, SiLU) over the packed q/k/v channels followed by gdn. `custom` derives a workload of
other shapes from a named one.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

import ml_dtypes
import numpy as np

# Measured H200 rates the floor divides by (docs/design.md).
PEAK_FLOPS = 795e12  # bf16 dense matmul, FLOP/s
PEAK_BYTES = 4.26e12  # device copy, B/s

OPS = ("fwd", "fwd+bwd", "ckpt")


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    doc_lens: Tuple[int, ...]
    H: int
    HV: int
    K: int = 128
    V: int = 128
    dtype: str = "bf16"  # q, k, v (and o); g, beta are always float32
    qk_l2norm: bool = True
    layer: bool = False  # short conv over packed q/k/v channels, then gdn
    conv_width: int = 4
    chunk: int = 64  # only for the floor model

    @property
    def T(self) -> int:
        return int(sum(self.doc_lens))

    @property
    def N(self) -> int:
        return len(self.doc_lens)

    @property
    def conv_channels(self) -> int:
        return 2 * self.H * self.K + self.HV * self.V

    @property
    def cu_seqlens(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.doc_lens)]).astype(np.int32)

    @property
    def itemsize(self) -> int:
        return 2 if self.dtype == "bf16" else 4

    def describe(self) -> dict:
        d = dataclasses.asdict(self)
        d["doc_lens"] = list(self.doc_lens)
        d["T"] = self.T
        return d

    # ----------------------------------------------------------------------------------------
    # Inputs
    # ----------------------------------------------------------------------------------------

    def make_inputs(self, seed: int = 0) -> Dict[str, np.ndarray]:
        """Fresh random host inputs (never zeros).

        gdn workloads: q, k [1,T,H,K]; v [1,T,HV,V]; g, beta [1,T,HV] f32; do [1,T,HV,V] (the
        cotangent of o); cu_seqlens [N+1] int32. Layer workloads replace q, k, v by x [1,T,C]
        (C = 2*H*K + HV*V, channel order q | k | v) and conv_w [C, W].
        """
        rng = np.random.default_rng(seed)
        T, H, HV, K, V = self.T, self.H, self.HV, self.K, self.V

        def act(shape):  # activations in the workload dtype, held as float32
            x = rng.standard_normal(shape, dtype=np.float32)
            if self.dtype == "bf16":
                x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
            return x

        out = {}
        if self.layer:
            C, W = self.conv_channels, self.conv_width
            out["x"] = act((1, T, C))
            w = rng.standard_normal((C, W), dtype=np.float32) / np.float32(np.sqrt(W))
            if self.dtype == "bf16":
                w = w.astype(ml_dtypes.bfloat16).astype(np.float32)
            out["conv_w"] = w
        else:
            out["q"] = act((1, T, H, K))
            out["k"] = act((1, T, H, K))
            out["v"] = act((1, T, HV, V))
        a = rng.standard_normal((1, T, HV), dtype=np.float32)
        out["g"] = -np.logaddexp(np.float32(0), -a).astype(np.float32)  # log-sigmoid(a) <= 0
        b = rng.standard_normal((1, T, HV), dtype=np.float32)
        out["beta"] = (1.0 / (1.0 + np.exp(-b))).astype(np.float32)  # sigmoid, in (0, 1)
        out["do"] = act((1, T, HV, V))
        out["cu_seqlens"] = self.cu_seqlens
        return out

    # ----------------------------------------------------------------------------------------
    # Floor model
    # ----------------------------------------------------------------------------------------

    def flops(self, op: str) -> float:
        """FLOPs of one call of `op` (fwd = F, fwd+bwd = F + Bw, ckpt = 2F + Bw).

        Per token per value head the chunked form costs (C = chunk, full square products)
            walk 4KV (w S, K^T v_new) + output 2KV + 2CK + 2CV (Q S, Q K^T, P v_new)
            + WY 2CK + 2CK + 2CV (K K^T, w, u) + 2C^2/3 (the unit-lower inverse);
        this shape function is normalised so that K = V = 128, C = 64 gives the design's
        176 kFLOP forward and 508 kFLOP backward exactly. The layer adds the depthwise conv
        (2 W FLOP per channel per token forward, twice that backward).
        """
        def shape(K, V, C):
            return 6 * K * V + 6 * C * K + 4 * C * V + 2 * C * C / 3

        r = shape(self.K, self.V, self.chunk) / shape(128, 128, 64)
        tok = self.T * self.HV
        F, Bw = 176e3 * r * tok, 508e3 * r * tok
        if self.layer:
            cf = 2.0 * self.conv_width * self.conv_channels * self.T
            F, Bw = F + cf, Bw + 2 * cf
        return {"fwd": F, "fwd+bwd": F + Bw, "ckpt": 2 * F + Bw}[op]

    def bytes(self, op: str) -> float:
        """Unavoidable HBM bytes of one call: read the inputs, write the outputs, nothing else.

        fwd reads q, k, v (or x, conv_w), g, beta and writes o; bwd reads those and do and
        writes their gradients. Residuals (A, gate cumsum, ...) are not counted.
        """
        T, es = self.T, self.itemsize
        if self.layer:
            act_in = T * self.conv_channels * es + self.conv_channels * self.conv_width * 4
        else:
            act_in = T * (2 * self.H * self.K + self.HV * self.V) * es
        gates = 2 * T * self.HV * 4
        o = T * self.HV * self.V * es
        F = act_in + gates + o
        Bw = 2 * (act_in + gates) + o  # read inputs + do, write grads
        return {"fwd": F, "fwd+bwd": F + Bw, "ckpt": 2 * F + Bw}[op]

    def tflops(self, op: str, ms: float) -> float:
        """The FLOP rate (TFLOP/s) of one call of `op` that takes `ms` milliseconds."""
        return self.flops(op) / (ms * 1e-3) / 1e12

    def floor(self, op: str) -> dict:
        f, b = self.flops(op), self.bytes(op)
        tf, tb = f / PEAK_FLOPS * 1e3, b / PEAK_BYTES * 1e3
        return {"flops": f, "bytes": b, "flop_ms": tf, "byte_ms": tb, "ms": max(tf, tb),
                "bound": "flops" if tf >= tb else "bytes"}


# 65536 tokens in 6 uneven documents, none a multiple of 64.
SMALL_HEADS_DOCS = (21000, 15000, 12000, 9000, 5536, 3000)

_BASE = {
    "B23": Workload("B23", (12288, 8192, 7168, 5120), H=16, HV=48),
    # B23's documents shortest first: the walks start the longest segment's CTAs first anyway
    # (chunks.py seg_order); in table order the 12288-token document's would start last
    "B23rev": Workload("B23rev", (5120, 7168, 8192, 12288), H=16, HV=48),
    "long": Workload("long", (65536,), H=16, HV=48),
    "small_heads": Workload("small_heads", SMALL_HEADS_DOCS, H=2, HV=6),
    # context-parallel scaling: one document of 131072 (CP2) and 262144 (CP4, CP8) tokens
    "long131k": Workload("long131k", (131072,), H=16, HV=48),
    "long262k": Workload("long262k", (262144,), H=16, HV=48),
    # CPU smoke: 3 uneven docs (one not a multiple of anything), GVA on.
    "tiny": Workload("tiny", (150, 97, 53), H=2, HV=4, K=32, V=32),
}


def names():
    return sorted(_BASE) + sorted(n + "-layer" for n in _BASE)


def get(name: str) -> Workload:
    layer = name.endswith("-layer")
    base = name[: -len("-layer")] if layer else name
    if base not in _BASE:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(names())}")
    w = _BASE[base]
    return dataclasses.replace(w, name=name, layer=True) if layer else w


def split_evenly(tokens: int, docs: int) -> Tuple[int, ...]:
    """`docs` document lengths summing to `tokens`, the first `tokens % docs` one longer."""
    if docs < 1 or tokens < docs:
        raise ValueError(f"need 1 <= docs <= tokens, got {docs} docs of {tokens} tokens")
    q, r = divmod(tokens, docs)
    return tuple(q + (i < r) for i in range(docs))


def _pair(text: str, what: str) -> Tuple[int, int]:
    parts = [int(x) for x in str(text).split(",")]
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or min(parts) < 1:
        raise ValueError(f"{what}: one or two positive integers, got {text!r}")
    return parts[0], parts[1]


def custom(base: Workload, *, tokens=None, docs=None, heads=None, head_dim=None) -> Workload:
    """`base` with other shapes; each argument left None keeps the base's.

    tokens: T. docs: document lengths "a,b,c" (they sum to T when both are given) or a count N
    ("4": T split evenly). tokens alone splits T evenly over the base's document count.
    heads: "H,HV" (HV a multiple of H) or "H" (HV = H). head_dim: "K,V" or "D" (K = V = D).
    The name says the shape, e.g. `T4096-N3-H2x4-K64V64` (`-layer` kept).
    """
    doc_lens = base.doc_lens
    if docs is not None:
        parts = [int(x) for x in str(docs).split(",") if x.strip()]
        if len(parts) == 1:
            doc_lens = split_evenly(tokens if tokens is not None else base.T, parts[0])
        else:
            if min(parts) < 1:
                raise ValueError(f"document lengths must be positive, got {docs!r}")
            doc_lens = tuple(parts)
            if tokens is not None and tokens != sum(parts):
                raise ValueError(f"--docs sum to {sum(parts)} tokens, not --tokens {tokens}")
    elif tokens is not None:
        doc_lens = split_evenly(tokens, base.N)
    H, HV = _pair(heads, "heads") if heads is not None else (base.H, base.HV)
    if HV % H:
        raise ValueError(f"heads: HV ({HV}) must be a multiple of H ({H})")
    K, V = _pair(head_dim, "head_dim") if head_dim is not None else (base.K, base.V)
    T = sum(doc_lens)
    name = f"T{T}-N{len(doc_lens)}-H{H}x{HV}-K{K}V{V}" + ("-layer" if base.layer else "")
    return dataclasses.replace(base, name=name, doc_lens=tuple(doc_lens), H=H, HV=HV, K=K, V=V)
