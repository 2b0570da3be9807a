// The intra-chunk WY prep (DESIGN.md section 1), one CTA of 4 warps per (chunk, value head),
// value heads of one chunk adjacent in the (1-D) grid so GVA heads share k through L2:
//
//   solve_a:  L = strictly_lower(beta_i Gam_ij k_i.k_j),  A = (I + L)^-1   -> A f32[NC, HV, 64, 64]
//   wy:       w = A diag(beta e^G) K -> f32[T, HV, K],  u = A diag(beta) V -> f32[T, HV, V]
//
// k (normalised by rstd_k when given) and v are rounded to bf16 in shared memory; K K^T, A Kb and
// A Vb run on tensor cores (mma.sync m16n8k16, f32 accumulate; warp w owns rows 16w..16w+15).
// Tiles come in with batched loads (load_tile_bf16: 4-8 16/32-byte loads in flight per thread).
// The 64x64 unit-lower inverse is f32: the four 16x16 diagonal blocks by forward substitution
// (one thread per column), then the off-diagonal blocks by distance d = 1, 2, 3:
//   A_ij = -A_ii sum_{k=j}^{i-1} L_ik A_kj.
// Padding rows (t >= len) have k = 0 and beta = 0, so A is the identity there, as in xla.py;
// an unused chunk (len 0) gets A = I and writes no token rows.
// GVA: value head hv reads k head hv / (HV / H).
#pragma once

#include "fwd_common.cuh"

namespace jax_cake_gdn {

constexpr int kPrepThreads = 128;

template <int K>
struct SolveASmem {
  static constexpr int KP = K + 8;  // bf16 row pitch of the k tile
  static constexpr int LP = 65;     // f32 row pitch of L and A
  static constexpr size_t kK = size_t{kChunk} * KP * sizeof(bf16);
  static constexpr size_t kL = size_t{kChunk} * LP * sizeof(float);
  static constexpr size_t kT = size_t{3} * 16 * 17 * sizeof(float);
  static constexpr size_t bytes = kK + 2 * kL + kT + 2 * kChunk * sizeof(float);
};

template <typename In, int K>
__global__ void __launch_bounds__(kPrepThreads)
    solve_a_kernel(const In* __restrict__ k, const float* __restrict__ beta,
                   const float* __restrict__ G, const float* __restrict__ rstd,  // nullable
                   const int32_t* __restrict__ cstart, const int32_t* __restrict__ clen,
                   float* __restrict__ A, int64_t num_tokens, int H, int HV) {
  using Sm = SolveASmem<K>;
  constexpr int KP = Sm::KP, LP = Sm::LP;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Ks = reinterpret_cast<bf16*>(smem);
  float* Ls = reinterpret_cast<float*>(smem + Sm::kK);
  float* As = Ls + kChunk * LP;
  float* Ts = As + kChunk * LP;  // [3][16][17] scratch of the off-diagonal stage
  float* sb = Ts + 3 * 16 * 17;  // beta (0 on padding rows)
  float* sg = sb + kChunk;       // G (G of the last row on padding rows)

  const int hv = blockIdx.x % HV, c = blockIdx.x / HV;  // value heads of one k head adjacent
  const int hk = hv / (HV / H);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
  const int len = cs.len;

  if (len > 0) {
    load_tile_bf16<kChunk, K, 8, kPrepThreads>(Ks, KP, k + hk * K + cs.start * H * K,
                                               int64_t{H} * K, len,
                                               ScaleRstd{rstd, cs.start, H, hk});
  } else {
    for (int idx = tid; idx < kChunk * (K / 8); idx += kPrepThreads)
      sts8_zero(Ks + (idx / (K / 8)) * KP + (idx % (K / 8)) * 8);
  }
  if (tid < kChunk) {
    const int t = tid;
    const int tl = min(t, len - 1);
    sg[t] = len > 0 ? G[(cs.start + tl) * HV + hv] : 0.f;
    sb[t] = t < len ? beta[(cs.start + t) * HV + hv] : 0.f;
  }
  __syncthreads();

  // K K^T for this warp's 16 rows x 64 columns, then L (strictly lower) into Ls.
  {
    constexpr int KS = K / 16;
    uint32_t a[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) lda_rm(a[ks], Ks + (16 * warp) * KP + 16 * ks, KP);
    float acc[8][4];
    zero_acc(acc);
    mma_rt<KS, 8>(acc, a, Ks, KP);
    const int g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 16 * warp + g + 8 * (e >> 1), j = 8 * nt + 2 * q + (e & 1);
        Ls[i * LP + j] = i > j ? sb[i] * __expf(sg[i] - sg[j]) * acc[nt][e] : 0.f;
      }
    }
  }
  __syncthreads();

  // Diagonal 16x16 blocks: thread (b, col) solves column col of (I + L_bb) x = e_col.
  if (tid < kChunk) {
    const int b = tid >> 4, col = tid & 15;
    const float* Lb = Ls + (16 * b) * LP + 16 * b;
    float x[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      float s = 0.f;
#pragma unroll
      for (int kk = 0; kk < r; ++kk) s = fmaf(Lb[r * LP + kk], x[kk], s);
      x[r] = r == col ? 1.f : (r < col ? 0.f : -s);
    }
    float* Ab = As + (16 * b) * LP + 16 * b + col;
#pragma unroll
    for (int r = 0; r < 16; ++r) Ab[r * LP] = x[r];
  }
  __syncthreads();

  // Off-diagonal blocks, by distance d = i - j.
  for (int d = 1; d < 4; ++d) {
    const int nelem = (4 - d) * 256;
    for (int e = tid; e < nelem; e += kPrepThreads) {
      const int blk = e >> 8, r = (e >> 4) & 15, cc = e & 15;
      const int bi = d + blk, bj = bi - d;
      const float* Lrow = Ls + (16 * bi + r) * LP;
      const float* Acol = As + 16 * bj + cc;
      float s = 0.f;
      for (int kk = 16 * bj; kk < 16 * bi; ++kk) s = fmaf(Lrow[kk], Acol[kk * LP], s);
      Ts[(blk * 16 + r) * 17 + cc] = s;
    }
    __syncthreads();
    for (int e = tid; e < nelem; e += kPrepThreads) {
      const int blk = e >> 8, r = (e >> 4) & 15, cc = e & 15;
      const int bi = d + blk, bj = bi - d;
      const float* Arow = As + (16 * bi + r) * LP + 16 * bi;
      float s = 0.f;
#pragma unroll
      for (int x = 0; x < 16; ++x) s = fmaf(Arow[x], Ts[(blk * 16 + x) * 17 + cc], s);
      As[(16 * bi + r) * LP + 16 * bj + cc] = -s;
    }
    __syncthreads();
  }

  float* out = A + (static_cast<int64_t>(c) * HV + hv) * (kChunk * kChunk);
#pragma unroll 4
  for (int e = tid; e < kChunk * kChunk; e += kPrepThreads) {
    const int i = e >> 6, j = e & 63;
    out[e] = (j >> 4) > (i >> 4) ? 0.f : As[i * LP + j];
  }
}

template <int K>
struct WySmem {
  static constexpr int AP = kChunk + 8;  // bf16 pitch of A
  static constexpr int XP = 128 + 8;     // bf16 pitch of the k / v tile (D <= 128)
  static constexpr size_t kA = size_t{kChunk} * AP * sizeof(bf16);
  static constexpr size_t kX = size_t{kChunk} * XP * sizeof(bf16);
  static constexpr size_t bytes = kA + 2 * kX;
};

// acc = A (this warp's 16 rows) x X[:, 64p : 64p + 64]; rows < len go to out (f32, token-major).
__device__ __forceinline__ void wy_panels(const uint32_t (&a)[4][4], const bf16* Xs, int xp,
                                          int D, float* out, int64_t row0, int64_t row_stride,
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
        float* o = out + (row0 + t) * row_stride + 64 * p + 2 * q;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) store2(o + 8 * nt, acc[nt][2 * half], acc[nt][2 * half + 1]);
      }
    }
  }
}

template <typename In, int K>
__global__ void __launch_bounds__(kPrepThreads)
    wy_kernel(const In* __restrict__ k, const In* __restrict__ v, const float* __restrict__ beta,
              const float* __restrict__ G, const float* __restrict__ A,
              const float* __restrict__ rstd,  // nullable
              const int32_t* __restrict__ cstart, const int32_t* __restrict__ clen,
              float* __restrict__ w, float* __restrict__ u, int64_t num_tokens, int H, int HV,
              int V) {
  using Sm = WySmem<K>;
  constexpr int AP = Sm::AP, XP = Sm::XP;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* As = reinterpret_cast<bf16*>(smem);
  bf16* Ks = reinterpret_cast<bf16*>(smem + Sm::kA);
  bf16* Vs = reinterpret_cast<bf16*>(smem + Sm::kA + Sm::kX);

  const int hv = blockIdx.x % HV, c = blockIdx.x / HV;  // value heads of one k head adjacent
  const int hk = hv / (HV / H);
  const int tid = threadIdx.x, warp = tid >> 5;
  const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
  const int len = cs.len;
  if (len == 0) return;  // no token rows to write

  const float* bt = beta + cs.start * HV + hv;
  const float* gt = G + cs.start * HV + hv;
  // A (f32), k diag(beta e^G rstd) and v diag(beta) -> bf16 tiles
  load_tile_bf16<kChunk, kChunk, 4, kPrepThreads>(
      As, AP, A + (static_cast<int64_t>(c) * HV + hv) * (kChunk * kChunk), kChunk, kChunk,
      ScaleOne{});
  {
    const ScaleRstd rs{rstd, cs.start, H, hk};
    load_tile_bf16<kChunk, K, 8, kPrepThreads>(
        Ks, XP, k + hk * K + cs.start * H * K, int64_t{H} * K, len, [&](int t) {
          return __ldg(bt + t * HV) * __expf(__ldg(gt + t * HV)) * rs(t);
        });
  }
  const auto sv = [&](int t) { return __ldg(bt + t * HV); };
  const In* vsrc = v + int64_t{hv} * V + cs.start * HV * V;
  if (V == 64) {
    load_tile_bf16<kChunk, 64, 4, kPrepThreads>(Vs, XP, vsrc, int64_t{HV} * V, len, sv);
  } else {
    load_tile_bf16<kChunk, 128, 8, kPrepThreads>(Vs, XP, vsrc, int64_t{HV} * V, len, sv);
  }
  __syncthreads();
  uint32_t a[4][4];
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) lda_rm(a[ks], As + (16 * warp) * AP + 16 * ks, AP);
  wy_panels(a, Ks, XP, K, w + int64_t{hv} * K, cs.start, int64_t{HV} * K, len);
  wy_panels(a, Vs, XP, V, u + int64_t{hv} * V, cs.start, int64_t{HV} * V, len);
}

}  // namespace jax_cake_gdn
