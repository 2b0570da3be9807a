// The intra-chunk WY prep (docs/design.md section 1), one CTA of 4 warps per (chunk, value head),
// value heads of one chunk adjacent in the (1-D) grid so GVA heads share k through L2:
//
//   prep:  L = strictly_lower(beta_i Gam_ij k_i.k_j),  A = (I + L)^-1   -> A bf16[NC, HV, 64, 64]
//          w = A diag(beta e^G r) K_raw -> bf16[T, HV, K],  u = A diag(beta) V -> bf16[T, HV, V]
//   solve_a: A only (prep_kernel with kWU = false; the light forward's walk makes w, u itself)
//
// (r = rstd of k, 1 without L2 norm.) k normalised by r (for K K^T), the raw k and v are rounded
// to bf16 in shared memory; K K^T and the w, u products run on tensor cores (mma.sync m16n8k16,
// f32 accumulate; warp w owns rows 16w..16w+15). w and u take the column scales on A:
//   A_w = bf16(A diag(beta e^G r)),  A_u = bf16(A diag(beta))   (A rounded to bf16 first)
//   w = A_w bf16(K_raw),  u = A_u bf16(V)   (4 k16 steps from zero, rounded to bf16)
// the roundings and product order of the walks that make w, u on chip from the saved A
// (walk_fwd_wg.cuh): the light backward's replay gets prep's w, u bit for bit (light == full),
// and the light forward's walk the state walk's states (tests/test_cuda_fwd.py). With bf16
// inputs k and v arrive by cp.async as they are.
// solve_a ahead of the forward walk (walk_fwd.cu: solve_a_walk_output) runs as a grid that fills
// the GPU once, leaves the walk's SMs free, takes items in chunk-major order from a counter and
// publishes each item's A on a flag once it is stored (handoff.cuh).
// prep runs 4 CTAs/SM (<= 128 registers, 52.8 KB shared each); solve_a at K = 128 runs 6
// (<= 80 registers, 35.5 KB), latency-bound as it is (prep_min_ctas).
//
// The 64x64 unit-lower inverse (prep): warp b solves its diagonal 16x16 block by forward
// substitution (one lane per column), then the off-diagonal blocks go by distance d = 1, 2, 3:
//   A_ij = -A_ii sum_{k=j}^{i-1} L_ik A_kj      (warp i computes block (i, i - d))
// on tensor cores with f32 operands split as x = hi + lo (bf16 each), hi*hi + hi*lo + lo*hi
// accumulated in f32 (mma3). L_ik comes from the warp's own K K^T accumulators (registers).
// Padding rows (t >= len) have k = 0 and beta = 0, so A is the identity there, as in xla.py;
// an unused chunk (len 0) gets A = I and writes no token rows.
// GVA: value head hv reads k head hv / (HV / H).
#pragma once

#include "device_common.cuh"
#include "handoff.cuh"

namespace jax_cake_gdn {

constexpr int kPrepThreads = 128;

// ---------------------------------------------------------------- w, u

constexpr int kWyXP = 128 + 8;  // bf16 pitch of the k / v tiles of w and u (D <= 128)

// bytes of one k or v tile of w and u (pitch kWyXP)
constexpr size_t kWyTile = size_t{kChunk} * kWyXP * sizeof(bf16);

// acc = A (this warp's 16 rows) x X[:, 64p : 64p + 64]; rows < len go to out (Out: f32, or bf16
// rounded to nearest; token-major).
template <typename Out>
__device__ __forceinline__ void wy_panels(const uint32_t (&a)[4][4], const bf16* Xs, int xp,
                                          int D, Out* out, int64_t row0, int64_t row_stride,
                                          int len) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  for (int p = 0; p < D / 64; ++p) {
    float acc[8][4];
    zero_acc(acc);
    mma_rm<4, 8>(acc, a, Xs + 64 * p, xp);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int t = 16 * warp + g + 8 * half;
      if (t < len) {
        Out* o = out + (row0 + t) * row_stride + 64 * p + 2 * q;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) store2(o + 8 * nt, acc[nt][2 * half], acc[nt][2 * half + 1]);
      }
    }
  }
}

// w = A_w Ks, u = A_u Vs (bf16 tiles) for this warp's rows (aw, au: its bf16 fragments of A_w,
// A_u, 4 k-steps).
__device__ __forceinline__ void wy_store(const uint32_t (&aw)[4][4],
                                         const uint32_t (&au)[4][4], const bf16* Ks,
                                         const bf16* Vs, bf16* __restrict__ w,
                                         bf16* __restrict__ u, ChunkSpan cs, int hv, int HV,
                                         int K, int V) {
  constexpr int XP = kWyXP;
  wy_panels(aw, Ks, XP, K, w + int64_t{hv} * K, cs.start, int64_t{HV} * K, cs.len);
  wy_panels(au, Vs, XP, V, u + int64_t{hv} * V, cs.start, int64_t{HV} * V, cs.len);
}

// ---------------------------------------------------------------- prep: A, then w and u

// x = hi + lo, each a bf16 pair (x0 in the low half), for near-f32 products on tensor cores.
__device__ __forceinline__ void split2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = pack_bf16(x0 - hf.x, x1 - hf.y);
}

// Split A fragment of the 16 x 16 f32 row-major tile at p (pitch ld).
__device__ __forceinline__ void split_a(const float* p, int ld, uint32_t (&hi)[4],
                                        uint32_t (&lo)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int r = 0; r < 4; ++r) {  // r: a0 (g, 2q), a1 (g+8, 2q), a2 (g, 8+2q), a3 (g+8, 8+2q)
    const float2 x = *reinterpret_cast<const float2*>(p + (g + 8 * (r & 1)) * ld + 8 * (r >> 1) +
                                                      2 * q);
    split2(x.x, x.y, hi[r], lo[r]);
  }
}

// acc[16 x 16] += A (split fragment) * B, B the 16 x 16 f32 row-major tile at p (pitch ld), in
// three bf16 products: lo*hi + hi*lo + hi*hi.
__device__ __forceinline__ void mma3(float (&acc)[2][4], const uint32_t (&ahi)[4],
                                     const uint32_t (&alo)[4], const float* p, int ld) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    uint32_t bhi[2], blo[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // b0: k = 2q, 2q+1; b1: k = 8+2q, 9+2q; n = g
      const float* x = p + (2 * q + 8 * r) * ld + 8 * nt + g;
      split2(x[0], x[ld], bhi[r], blo[r]);
    }
    mma_bf16(acc[nt], alo, bhi[0], bhi[1]);
    mma_bf16(acc[nt], ahi, blo[0], blo[1]);
    mma_bf16(acc[nt], ahi, bhi[0], bhi[1]);
  }
}

// Store a 16 x 16 f32 C tile (2 n-tiles) times s at p (pitch ld, even).
__device__ __forceinline__ void store_c16(float* p, int ld, const float (&c)[2][4], float s) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    *reinterpret_cast<float2*>(p + g * ld + 8 * nt + 2 * q) =
        make_float2(s * c[nt][0], s * c[nt][1]);
    *reinterpret_cast<float2*>(p + (g + 8) * ld + 8 * nt + 2 * q) =
        make_float2(s * c[nt][2], s * c[nt][3]);
  }
}

// Resident CTAs per SM that prep_kernel<., K, kWU> is compiled for (at 6, K = 64 spills).
template <int K, bool kWU>
constexpr int prep_min_ctas() {
  return !kWU && K == 128 ? 6 : 4;
}

// kWU = false (solve_a): no v tile (Ks only stages the raw k).
template <int K, bool kWU = true>
struct PrepSmem {
  static constexpr int KP = K + 8;   // bf16 pitch of the rstd-scaled k tile (K K^T)
  static constexpr int AP = 72;      // f32 pitch of A (float2 fragment loads conflict free)
  static constexpr size_t kKr = size_t{kChunk} * KP * sizeof(bf16);
  static constexpr size_t kAf = size_t{kChunk} * AP * sizeof(float);
  static constexpr size_t kA = kKr > kAf ? kKr : kAf;  // the k tile, then A (after K K^T)
  static constexpr size_t kX = kWyTile;
  // + beta, G (and kWU: w's column scales beta e^G r)
  static constexpr size_t bytes =
      kA + (kWU ? 2 : 1) * kX + (kWU ? 3 : 2) * kChunk * sizeof(float);
  // 4 CTAs/SM (solve_a at K = 128: 6): 228 KB per SM, 1 KB reserved per CTA
  static_assert(prep_min_ctas<K, kWU>() * (bytes + 1024) <= 228 * 1024,
                "prep no longer fits its CTAs/SM");
};

// Warp w's 16 x 16 f32 scratch (pitch AP) inside A's upper triangle, which is never stored:
// blocks (0, 1), (0, 2), (0, 3), (1, 2).
__device__ __forceinline__ int prep_scratch(int warp, int ap) {
  return warp < 3 ? 16 * (warp + 1) : 16 * ap + 32;
}

// A of one (chunk, head) to out (bf16 64 x 64, row-major, rounded to nearest: the values every
// reader uses as operands): the lower blocks of As (f32, pitch ap), zero above them;
// As == nullptr: the identity. 16-byte stores of 8 elements.
__device__ __forceinline__ void prep_write_a(bf16* __restrict__ out, const float* As, int ap) {
#pragma unroll 4
  for (int e = threadIdx.x; e < kChunk * kChunk / 8; e += kPrepThreads) {
    const int i = e >> 3, j = (e & 7) * 8;
    float f[8] = {};
    if (As == nullptr) {
#pragma unroll
      for (int u = 0; u < 8; ++u) f[u] = i == j + u;
    } else if ((j >> 4) <= (i >> 4)) {
      lds8(As + i * ap + j, f);
    }
    uint4 v;
    v.x = pack_bf16(f[0], f[1]);
    v.y = pack_bf16(f[2], f[3]);
    v.z = pack_bf16(f[4], f[5]);
    v.w = pack_bf16(f[6], f[7]);
    reinterpret_cast<uint4*>(out)[e] = v;
  }
}

// prep's k tile, loaded once for its two bf16 copies: Kr = k diag(rstd) (pitch kp, for K K^T;
// bf16(float(x) * rstd), load_tile_bf16's rounding) and (kWU) Ks = bf16(k) (pitch kWyXP, for w).
//
// bf16 inputs: the raw k and v rows go to Ks and Vs by cp.async (cp_async_tile: rows
// t >= len zero-filled) and the thread that copied a 16-byte chunk of k later makes that same
// chunk's Kr (so its own cp.async.wait is all it needs); v is waited for after the diagonal
// solve, so its load hides behind K K^T and the solve. f32 inputs: through registers (one global
// read of k, two shared stores).

// rstd of this thread's k chunks (TilePieces rows, clamped).
template <int K>
struct PrepKScales {
  using P = TilePieces<kChunk, K, kPrepThreads>;
  static constexpr int kPer = P::kPer;
  float rs[kPer];
  __device__ __forceinline__ void load(const ScaleRstd& r, int len) {
#pragma unroll
    for (int j = 0; j < kPer; ++j) rs[j] = r(min(P::row0() + j * P::kRowStep, len - 1));
  }
};

// bf16: this thread's raw k chunks in Ks (its cp.async group done) -> Kr.
template <int K>
__device__ __forceinline__ void prep_k_finish(bf16* Kr, int kp, const bf16* Ks,
                                              const PrepKScales<K>& sc, int len) {
  using P = typename PrepKScales<K>::P;
#pragma unroll
  for (int j = 0; j < P::kPer; ++j) {
    const int t = P::row0() + j * P::kRowStep, c8 = P::col();
    if (t < len) {
      float f[8];
      lds8(Ks + t * kWyXP + c8, f);
      sts8_bf16(Kr + t * kp + c8, f, sc.rs[j]);
    } else {
      sts8_zero(Kr + t * kp + c8);  // Ks: zero-filled by cp.async
    }
  }
}

// f32: k rows -> Kr and (kWU) Ks through registers, NB chunks per thread in flight
// (load_tile_bf16's batching).
template <int K, bool kWU>
__device__ __forceinline__ void prep_load_k_f32(bf16* Kr, int kp, bf16* Ks, const float* src,
                                                int64_t row_stride, int len,
                                                const ScaleRstd& r) {
  using P = TilePieces<kChunk, K, kPrepThreads>;
  constexpr int kNB = 4;
  static_assert(P::kPer % kNB == 0, "tile does not split evenly");
  const int t0 = P::row0(), c8 = P::col();
#pragma unroll 1
  for (int b0 = 0; b0 < P::kPer; b0 += kNB) {
    float f[kNB][8], rs[kNB];
#pragma unroll
    for (int j = 0; j < kNB; ++j) {
      const int tt = min(t0 + (b0 + j) * P::kRowStep, len - 1);
      load8(src + tt * row_stride + c8, f[j]);
      rs[j] = r(tt);
    }
#pragma unroll
    for (int j = 0; j < kNB; ++j) {
      const int t = t0 + (b0 + j) * P::kRowStep;
      if (t < len) {
        sts8_bf16(Kr + t * kp + c8, f[j], rs[j]);
        if constexpr (kWU) sts8_bf16(Ks + t * kWyXP + c8, f[j], 1.f);
      } else {
        sts8_zero(Kr + t * kp + c8);
        if constexpr (kWU) sts8_zero(Ks + t * kWyXP + c8);
      }
    }
  }
}

// Column j's scale s[j] on this warp's bf16 A fragments a: out = bf16(float(a) * s[j]), the
// rounding of the walks' A scaling (walk_fwd_wg.cuh).
__device__ __forceinline__ void prep_scale_cols(const uint32_t (&a)[4][4], const float* s,
                                                uint32_t (&out)[4][4]) {
  const int q = threadIdx.x & 3;
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // a0, a1: columns 2q, 2q + 1; a2, a3: 8 + 2q, 9 + 2q
      const int j = 16 * ks + 8 * (r >> 1) + 2 * q;
      const float2 x = unpack2(a[ks][r]);
      out[ks][r] = pack_bf16(x.x * s[j], x.y * s[j + 1]);
    }
  }
}

// kWU = false (solve_a): A only; v, w, u unused (may be null), V ignored. A is the same either
// way (the same code up to prep_write_a).
// One (chunk, value head) item (item = c HV + hv): prep_kernel's work for it.
template <typename In, int K, bool kWU>
__device__ __forceinline__ void prep_item(int item, unsigned char* smem, const In* __restrict__ k,
                                          const In* __restrict__ v,
                                          const float* __restrict__ beta,
                                          const float* __restrict__ G,
                                          const float* __restrict__ rstd,
                                          const int32_t* __restrict__ cstart,
                                          const int32_t* __restrict__ clen,
                                          bf16* __restrict__ A, bf16* __restrict__ w,
                                          bf16* __restrict__ u, int64_t num_tokens, int H,
                                          int HV, int V) {
  using Sm = PrepSmem<K, kWU>;
  constexpr int KP = Sm::KP, AP = Sm::AP;
  bf16* Kr = reinterpret_cast<bf16*>(smem);  // k diag(rstd), until K K^T is done
  float* As = reinterpret_cast<float*>(smem);  // then A (f32)
  bf16* Ks = reinterpret_cast<bf16*>(smem + Sm::kA);
  bf16* Vs = reinterpret_cast<bf16*>(smem + Sm::kA + Sm::kX);  // kWU only
  // beta (0 on padding rows)
  float* sb = reinterpret_cast<float*>(smem + Sm::kA + (kWU ? 2 : 1) * Sm::kX);
  float* sg = sb + kChunk;  // G (G of the last row on padding rows)
  float* sw = sg + kChunk;  // kWU: w's column scales beta e^G r (0 on padding rows)

  const int hv = item % HV, c = item / HV;  // value heads of one k head adjacent
  const int hk = hv / (HV / H);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
  const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
  const int len = cs.len;
  bf16* Aout = A + (static_cast<int64_t>(c) * HV + hv) * (kChunk * kChunk);
  if (len == 0) {  // unused chunk: A = I, no token rows
    prep_write_a(Aout, nullptr, AP);
    return;
  }

  constexpr bool kAsync = std::is_same<In, bf16>::value;
  const In* ksrc = k + hk * K + cs.start * H * K;
  const In* vsrc = v + int64_t{hv} * V + cs.start * HV * V;
  const ScaleRstd rs{rstd, cs.start, H, hk};
  if constexpr (kAsync) {
    cp_async_tile<kChunk, K, kPrepThreads>(Ks, kWyXP, ksrc, int64_t{H} * K, len);
    cp_async_commit();
    if constexpr (kWU) {
      if (V == 64) {
        cp_async_tile<kChunk, 64, kPrepThreads>(Vs, kWyXP, vsrc, int64_t{HV} * V, len);
      } else {
        cp_async_tile<kChunk, 128, kPrepThreads>(Vs, kWyXP, vsrc, int64_t{HV} * V, len);
      }
    }
    cp_async_commit();
  }
  if (tid < kChunk) {
    const int t = tid;
    const float gg = G[(cs.start + min(t, len - 1)) * HV + hv];
    const float bb = t < len ? beta[(cs.start + t) * HV + hv] : 0.f;
    sg[t] = gg;
    sb[t] = bb;
    if constexpr (kWU) sw[t] = bb * exp_ftz(gg) * rs(min(t, len - 1));  // (beta e^G) r
  }
  if constexpr (kAsync) {
    PrepKScales<K> sc;
    sc.load(rs, len);
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");  // this thread's k chunks
    prep_k_finish<K>(Kr, KP, Ks, sc, len);
  } else {
    prep_load_k_f32<K, kWU>(Kr, KP, Ks, reinterpret_cast<const float*>(ksrc), int64_t{H} * K,
                            len, rs);
    if constexpr (kWU) {
      if (V == 64) {
        load_tile_bf16<kChunk, 64, 4, kPrepThreads>(Vs, kWyXP, vsrc, int64_t{HV} * V, len,
                                                    ScaleOne{});
      } else {
        load_tile_bf16<kChunk, 128, 8, kPrepThreads>(Vs, kWyXP, vsrc, int64_t{HV} * V, len,
                                                     ScaleOne{});
      }
    }
  }
  __syncthreads();

  // K K^T for this warp's 16 rows x 64 columns, 64 k at a time.
  float acc[8][4];
  zero_acc(acc);
#pragma unroll
  for (int h = 0; h < K / 64; ++h) {
    uint32_t a[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) lda_rm(a[ks], Kr + (16 * warp) * KP + 64 * h + 16 * ks, KP);
    mma_rt<4, 8>(acc, a, Kr + 64 * h, KP);
  }
  __syncthreads();  // Kr is dead: its bytes become A

  // acc -> L (strictly lower); the diagonal block to scratch; L_{w, s} (s < w) as split A
  // fragments (C fragment pair 2s, 2s+1 = A fragment of k-step s).
  float* scr = As + prep_scratch(warp, AP);
  uint32_t lhi[3][4], llo[3][4];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    // warp-uniform: n-tiles left of the diagonal block are all i > j, right of it all zero
    // (the values are those of the one select, i > j ? ... : 0, either way)
    if (nt < 2 * warp) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 16 * warp + g + 8 * (e >> 1), j = 8 * nt + 2 * q + (e & 1);
        acc[nt][e] = sb[i] * exp_ftz(sg[i] - sg[j]) * acc[nt][e];
      }
    } else if (nt < 2 * warp + 2) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 16 * warp + g + 8 * (e >> 1), j = 8 * nt + 2 * q + (e & 1);
        const float x = sb[i] * exp_ftz(sg[i] - sg[j]) * acc[nt][e];
        acc[nt][e] = i > j ? x : 0.f;
      }
    } else {
      acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    }
    if ((nt >> 1) == warp) {
      const int col = 8 * (nt & 1) + 2 * q;
      *reinterpret_cast<float2*>(scr + g * AP + col) = make_float2(acc[nt][0], acc[nt][1]);
      *reinterpret_cast<float2*>(scr + (g + 8) * AP + col) = make_float2(acc[nt][2], acc[nt][3]);
    }
  }
#pragma unroll
  for (int s = 0; s < 3; ++s) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // a0 = c[2s][0..1], a1 = c[2s][2..3], a2, a3 from 2s + 1
      const float* x = acc[2 * s + (r >> 1)] + 2 * (r & 1);
      split2(x[0], x[1], lhi[s][r], llo[s][r]);
    }
  }
  __syncwarp();

  // Diagonal block: lane col < 16 solves column col of (I + L_ww) x = e_col.
  float* Aww = As + (16 * warp) * AP + 16 * warp;
  if (lane < 16) {
    const int col = lane;
    float x[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      float s = 0.f;
#pragma unroll
      for (int kk = 0; kk < r; ++kk) s = fmaf(scr[r * AP + kk], x[kk], s);
      x[r] = r == col ? 1.f : (r < col ? 0.f : -s);
    }
#pragma unroll
    for (int r = 0; r < 16; ++r) Aww[r * AP + col] = x[r];
  }
  __syncwarp();
  uint32_t dhi[4], dlo[4];  // A_ww, split
  split_a(Aww, AP, dhi, dlo);
  if constexpr (kAsync && kWU) cp_async_wait_all();  // v (read by wy_store after the barriers)
  __syncthreads();

  // Off-diagonal blocks by distance: warp i >= d computes A_{i, i-d}.
  for (int d = 1; d < 4; ++d) {
    if (warp >= d) {
      const int j = warp - d;
      float t[2][4] = {};
#pragma unroll
      for (int s = 0; s < 3; ++s)  // T = sum_{s=j}^{i-1} L_is A_sj
        if (s >= j && s < warp) mma3(t, lhi[s], llo[s], As + (16 * s) * AP + 16 * j, AP);
      store_c16(scr, AP, t, 1.f);
      __syncwarp();
      float x[2][4] = {};
      mma3(x, dhi, dlo, scr, AP);  // A_ii T
      __syncwarp();  // scr is rewritten in the next stage
      store_c16(As + (16 * warp) * AP + 16 * j, AP, x, -1.f);
    }
    __syncthreads();
  }

  if constexpr (!kWU) {
    prep_write_a(Aout, As, AP);
  } else {
    // A out (bf16), and as bf16 A fragments (the values the walks read back), column-scaled into
    // A_w, A_u for w and u.
    uint32_t a[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        float2 x = make_float2(0.f, 0.f);
        if (ks <= warp)
          x = *reinterpret_cast<const float2*>(As + (16 * warp + g + 8 * (r & 1)) * AP +
                                               16 * ks + 8 * (r >> 1) + 2 * q);
        a[ks][r] = pack_bf16(x.x, x.y);
      }
    }
    prep_write_a(Aout, As, AP);
    uint32_t aw[4][4], au[4][4];
    prep_scale_cols(a, sw, aw);
    prep_scale_cols(a, sb, au);
    wy_store(aw, au, Ks, Vs, w, u, cs, hv, HV, K, V);
  }
}

// %smid: the SM this CTA runs on.
__device__ __forceinline__ int sm_id() {
  int id;
  asm volatile("mov.u32 %0, %%smid;\n" : "=r"(id));
  return id;
}

// One CTA per item (grid NC HV, chunk-major).
template <typename In, int K, bool kWU = true>
__global__ void __launch_bounds__(kPrepThreads, (prep_min_ctas<K, kWU>()))
    prep_kernel(const In* __restrict__ k, const In* __restrict__ v,
                const float* __restrict__ beta, const float* __restrict__ G,
                const float* __restrict__ rstd,  // nullable
                const int32_t* __restrict__ cstart, const int32_t* __restrict__ clen,
                bf16* __restrict__ A, bf16* __restrict__ w, bf16* __restrict__ u,
                int64_t num_tokens, int H, int HV, int V) {
  extern __shared__ __align__(16) unsigned char smem[];
  prep_item<In, K, kWU>(blockIdx.x, smem, k, v, beta, G, rstd, cstart, clen, A, w, u,
                        num_tokens, H, HV, V);
}

// solve_a ahead of the forward walk (walk_fwd.cu: solve_a_walk_output): a grid that fills the GPU
// once, whose CTAs on SMs with id < reserve exit at once (but the last: it takes every item left
// if need be), so that the walk's CTAs, launched behind this grid with programmatic dependent
// launch, get those SMs; the others take items in order from the counter a_ready[0] and publish
// each A on a_ready[1 + item] (handoff.cuh).
template <typename In, int K>
__global__ void __launch_bounds__(kPrepThreads, (prep_min_ctas<K, false>()))
    solve_a_ahead_kernel(const In* __restrict__ k, const float* __restrict__ beta,
                         const float* __restrict__ G,
                         const float* __restrict__ rstd,  // nullable
                         const int32_t* __restrict__ cstart, const int32_t* __restrict__ clen,
                         bf16* __restrict__ A, int64_t num_tokens, int H, int HV,
                         int32_t* a_ready, int items, int reserve) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int next;
  allow_dependent_launch();
  if (sm_id() < reserve && blockIdx.x + 1 != gridDim.x) return;
  for (;;) {
    __syncthreads();  // the last item's shared memory and `next` read by every thread
    if (threadIdx.x == 0) next = atomicAdd(a_ready, 1);
    __syncthreads();
    const int item = next;
    if (item >= items) return;
    prep_item<In, K, false>(item, smem, k, nullptr, beta, G, rstd, cstart, clen, A, nullptr,
                            nullptr, num_tokens, H, HV, 0);
    handoff_publish_a(a_ready + 1, item);
  }
}

}  // namespace jax_cake_gdn
