// Device helpers shared by the kernel families, forward and backward (mma.sync tiles, loaders,
// bf16 state tapes, chunk bounds).
//
// Tensor-core work uses mma.sync.m16n8k16 (bf16 x bf16 -> f32) fed by ldmatrix from padded
// shared-memory tiles (rows of D + 8 bf16: 16-byte aligned and bank-conflict free for ldmatrix).
// Fragment conventions (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with g = lane / 4 and
// q = lane % 4:
//   A (16 x 16, row major): a0 = (g, 2q..2q+1), a1 = (g+8, 2q..), a2 = (g, 8+2q..),
//                           a3 = (g+8, 8+2q..)
//   B (16 x 8):             b0 = (k = 2q..2q+1, n = g), b1 = (k = 8+2q.., n = g)
//   C (16 x 8, f32):        c0, c1 = (g, 2q), (g, 2q+1);  c2, c3 = (g+8, 2q), (g+8, 2q+1)
// A C fragment pair (n-tiles 2s, 2s+1) is the A fragment of k-step s (the flash-attention trick),
// and a C fragment of X^T is the B fragment of X (state_walk keeps S^T so that S feeds an mma
// straight from registers).
//
// Input element types: bf16 (__nv_bfloat16) or f32, selected by template; every accumulation is
// f32.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "common.cuh"

namespace jax_cake_gdn {

using bf16 = __nv_bfloat16;

// ---------------------------------------------------------------- PTX wrappers

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// e^x as ex2.approx.ftz(x log2 e): __expf without its fix-up for results below 2^-126 (they
// flush to 0; every use here is a decay or gate factor of an O(1) value). Two instructions
// where __expf takes five.
__device__ __forceinline__ float exp_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}

// Four 8x8 b16 matrices; lane l gives the row address of matrix l / 8, row l % 8.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

// Stores four 8x8 b16 matrices: lane l gives the row address of matrix l / 8, row l % 8; r[i]
// holds this thread's pair of matrix i (row lane / 4, columns 2 (lane % 4)..), as ldsm_x4 loads.
__device__ __forceinline__ void stsm_x4(void* p, uint32_t r0, uint32_t r1, uint32_t r2,
                                        uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :
               : "r"(smem_u32(p)), "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// stsm_x4 with each matrix stored transposed: lane l gives the address of row l % 8 of matrix
// l / 8 as stored (column l % 8 of the thread fragments' matrix).
__device__ __forceinline__ void stsm_x4_t(void* p, uint32_t r0, uint32_t r1, uint32_t r2,
                                          uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :
               : "r"(smem_u32(p)), "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// d += a * b  (m16n8k16, bf16 inputs, f32 accumulators)
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16-byte async copy global -> shared; when !pred nothing is read and the 16 bytes are zeroed.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool pred) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(pred ? 16 : 0)
               : "memory");
}

// 4-byte async copy (zero fill when !pred).
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool pred) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(pred ? 4 : 0)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() { cp_async_wait<0>(); }

// ---------------------------------------------------------------- conversions

// Two floats -> bf16x2 in one register (lo in the low half: the lower k / column index).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// 8 consecutive elements (16-byte aligned) -> float[8]; read-only path.
__device__ __forceinline__ void load8(const float* p, float (&f)[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
  f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

// The same from shared memory (plain loads).
__device__ __forceinline__ void lds8(const float* p, float (&f)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
  f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

// A bf16 pair held in a uint32 (x in the low half) -> float2.
__device__ __forceinline__ float2 unpack2(uint32_t w) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
}

// 8 bf16 held in a uint4 -> float[8].
__device__ __forceinline__ void unpack8(const uint4 v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = unpack2(w[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

// 8 bf16 (16-byte aligned) -> float[8]; read-only path.
__device__ __forceinline__ void load8(const bf16* p, float (&f)[8]) {
  unpack8(__ldg(reinterpret_cast<const uint4*>(p)), f);
}

__device__ __forceinline__ void lds8(const bf16* p, float (&f)[8]) {
  unpack8(*reinterpret_cast<const uint4*>(p), f);
}

// float[8] * s -> 8 bf16 in one 16-byte shared store.
__device__ __forceinline__ void sts8_bf16(bf16* p, const float (&f)[8], float s) {
  uint4 v;
  v.x = pack_bf16(f[0] * s, f[1] * s);
  v.y = pack_bf16(f[2] * s, f[3] * s);
  v.z = pack_bf16(f[4] * s, f[5] * s);
  v.w = pack_bf16(f[6] * s, f[7] * s);
  *reinterpret_cast<uint4*>(p) = v;
}

__device__ __forceinline__ void sts8_zero(bf16* p) {
  *reinterpret_cast<uint4*>(p) = make_uint4(0u, 0u, 0u, 0u);
}

// Two adjacent output elements (8- or 4-byte aligned) in the output type.
__device__ __forceinline__ void store2(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}

__device__ __forceinline__ void store2(bf16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}

// ---------------------------------------------------------------- tile loads

// How Threads threads split a Rows x D tile into pieces of 8 elements (kVpr per row): piece
// idx = tid + j * Threads is row idx / kVpr, columns 8 (idx % kVpr).., so thread tid has the fixed
// column col() and rows row0() + j * kRowStep, j < kPer. tid = threadIdx.x % Threads: the whole
// CTA, or a warpgroup of it (e.g. a producer warpgroup after the compute ones). Every tile helper
// below (and the loops that read such a tile back by thread) uses this mapping; with the fixed
// column, a piece's address is one multiply-add on its row (no division per piece).
template <int Rows, int D, int Threads>
struct TilePieces {
  static constexpr int kVpr = D / 8, kRowStep = Threads / kVpr, kPer = Rows / kRowStep;
  static_assert(D % 8 == 0 && Threads % kVpr == 0 && Rows % kRowStep == 0,
                "tile does not split evenly");
  __device__ __forceinline__ static int tid() { return static_cast<int>(threadIdx.x % Threads); }
  __device__ __forceinline__ static int row0() { return tid() / kVpr; }
  __device__ __forceinline__ static int col() { return tid() % kVpr * 8; }
};

// A Rows x D tile of bf16 (or f32) into shared memory as it is (pitch ld) by 16-byte cp.async
// pieces (8 bf16, or 2 pieces of 4 f32 per 8-element piece of TilePieces): row t < len is
// src[t*row_stride + col], rows t >= len are zero. The caller commits and waits. kUnroll: the
// issue loop's unroll factor (all pieces by default; less keeps fewer live registers).
// cp_async_tile_at: the same with element (t, c) of the tile at at(t, c) (a T*; e.g. a swizzled
// slab, wgmma.cuh), for bf16 tiles.
template <int Rows, int D, int Threads, int kUnroll = Rows, typename T, typename At>
__device__ __forceinline__ void cp_async_tile_at(At at, const T* src, int64_t row_stride,
                                                 int len) {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "bf16 or f32");
  using P = TilePieces<Rows, D, Threads>;
  const int t0 = P::row0(), c = P::col();
#pragma unroll(kUnroll < P::kPer ? kUnroll : P::kPer)
  for (int j = 0; j < P::kPer; ++j) {
    const int t = t0 + j * P::kRowStep;
    const bool ok = t < len;
    const T* s = src + t * row_stride + c;
    T* d = at(t, c);
    cp_async16(d, ok ? s : src, ok);
    if constexpr (sizeof(T) == 4) cp_async16(d + 4, ok ? s + 4 : src, ok);
  }
}

template <int Rows, int D, int Threads, int kUnroll = Rows, typename T>
__device__ __forceinline__ void cp_async_tile(T* dst, int ld, const T* src, int64_t row_stride,
                                              int len) {
  cp_async_tile_at<Rows, D, Threads, kUnroll>([=](int t, int c) { return dst + t * ld + c; },
                                              src, row_stride, len);
}

// In place, after cp.async.wait: this thread's pieces of a cp_async_tile bf16 tile (element
// (t, c) at at(t, c)) times the row scale s[t] (shared memory), rounded to bf16 (the values
// load_tile_bf16 gives); rows >= len stay as they are (zero after cp_async_tile).
template <int Rows, int D, int Threads, typename At>
__device__ __forceinline__ void scale_tile_bf16_at(At at, int len, const float* s) {
  using P = TilePieces<Rows, D, Threads>;
  const int t0 = P::row0(), c = P::col();
#pragma unroll
  for (int j = 0; j < P::kPer; ++j) {
    const int t = t0 + j * P::kRowStep;
    if (t < len) {
      float f[8];
      lds8(at(t, c), f);
      sts8_bf16(at(t, c), f, s[t]);
    }
  }
}

// A Rows x D tile into shared memory as bf16 (pitch ld): row t < len is src[t*row_stride + col]
// times scale(t); rows t >= len are zero. Each thread issues up to NB 8-element loads (from
// clamped, always valid rows, with no branch between them) before it stores any, so NB loads per
// thread are in flight at once; batches run one after another. len must be >= 1.
// load_tile_bf16_at: the same with element (t, c) of the tile at at(t, c) (a bf16*; e.g. a
// swizzled slab, wgmma.cuh).
template <int Rows, int D, int NB, int Threads, typename In, typename Scale, typename At>
__device__ __forceinline__ void load_tile_bf16_at(At at, const In* src, int64_t row_stride,
                                                  int len, Scale scale) {
  using P = TilePieces<Rows, D, Threads>;
  constexpr int kNB = NB < P::kPer ? NB : P::kPer;  // loads per batch
  static_assert(P::kPer % kNB == 0, "tile does not split evenly");
  const int t0 = P::row0(), c = P::col();
#pragma unroll 1
  for (int b0 = 0; b0 < P::kPer; b0 += kNB) {
    float f[kNB][8];
    float s[kNB];
#pragma unroll
    for (int j = 0; j < kNB; ++j) {
      const int tt = min(t0 + (b0 + j) * P::kRowStep, len - 1);
      load8(src + tt * row_stride + c, f[j]);
      s[j] = scale(tt);
    }
#pragma unroll
    for (int j = 0; j < kNB; ++j) {
      const int t = t0 + (b0 + j) * P::kRowStep;
      if (t < len) {
        sts8_bf16(at(t, c), f[j], s[j]);
      } else {
        sts8_zero(at(t, c));
      }
    }
  }
}

template <int Rows, int D, int NB, int Threads, typename In, typename Scale>
__device__ __forceinline__ void load_tile_bf16(bf16* dst, int ld, const In* src,
                                               int64_t row_stride, int len, Scale scale) {
  load_tile_bf16_at<Rows, D, NB, Threads>([=](int t, int c) { return dst + t * ld + c; }, src,
                                          row_stride, len, scale);
}

// A per-row f32 vector of a chunk: row t is src[(start + t) * stride + col] (src may be null: the
// vector is absent and not loaded).
struct RowVector {
  float* dst;
  const float* src;
  int64_t stride, col;
};

// cp.async of a chunk's row vectors into shared memory (rows >= len zero) by Threads threads
// (tid = threadIdx.x % Threads); vector n is issued by the threads of 64-thread group
// n % (Threads / 64), one row each.
template <int Threads, int N>
__device__ __forceinline__ void cp_async_row_vectors(const RowVector (&v)[N], int64_t start,
                                                     int len) {
  static_assert(Threads % kChunk == 0, "whole 64-thread groups");
#pragma unroll
  for (int n = 0; n < N; ++n) {
    const int t = static_cast<int>(threadIdx.x % Threads) - (n % (Threads / kChunk)) * kChunk;
    if (t >= 0 && t < kChunk && v[n].src != nullptr) {
      const bool ok = t < len;
      cp_async4(v[n].dst + t, ok ? v[n].src + (start + t) * v[n].stride + v[n].col : v[n].src,
                ok);
    }
  }
}

struct ScaleOne {
  __device__ __forceinline__ float operator()(int) const { return 1.f; }
};

// rstd of token row start + t of head hk (1 without L2 norm).
struct ScaleRstd {
  const float* rstd;
  int64_t start;
  int H, hk;
  __device__ __forceinline__ float operator()(int t) const {
    return rstd != nullptr ? __ldg(rstd + (start + t) * H + hk) : 1.f;
  }
};

// ---------------------------------------------------------------- warp-level tile products

// A fragment of rows [0, 16) x cols [0, 16) of a row-major bf16 tile (p at its [0][0]).
__device__ __forceinline__ void lda_rm(uint32_t (&a)[4], const bf16* p, int ld) {
  const int lane = threadIdx.x & 31;
  ldsm_x4(a, p + (lane & 15) * ld + (lane >> 4) * 8);
}

// A fragment of X = M^T, where M is a row-major bf16 tile (p at M[k0][m0]): A[m][k] = M[k][m].
__device__ __forceinline__ void lda_tr(uint32_t (&a)[4], const bf16* p, int ld) {
  const int lane = threadIdx.x & 31, i = lane >> 3, r = lane & 7;
  ldsm_x4_t(a, p + (r + (i >> 1) * 8) * ld + (i & 1) * 8);
}

// acc[16 x 8NT] += A[16 x 16KS] * B, B[k][n] = M[k][n] with M row-major in shared memory
// (p at M[0][0]; k rows, n contiguous): "A times a row-major matrix".
template <int KS, int NT>
__device__ __forceinline__ void mma_rm(float (&acc)[NT][4], const uint32_t (&a)[KS][4],
                                       const bf16* p, int ld) {
  static_assert(NT % 2 == 0, "n-tiles come in pairs");
  const int lane = threadIdx.x & 31, i = lane >> 3, r = lane & 7;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      ldsm_x4_t(b, p + (16 * ks + r + (i & 1) * 8) * ld + 16 * np + (i >> 1) * 8);
      mma_bf16(acc[2 * np], a[ks], b[0], b[1]);
      mma_bf16(acc[2 * np + 1], a[ks], b[2], b[3]);
    }
  }
}

// acc[16 x 8NT] += A[16 x 16KS] * M^T, M row-major [n][k] in shared memory (p at M[0][0]):
// "A times the transpose of a row-major matrix" (Q K^T, K K^T).
template <int KS, int NT>
__device__ __forceinline__ void mma_rt(float (&acc)[NT][4], const uint32_t (&a)[KS][4],
                                       const bf16* p, int ld) {
  static_assert(NT % 2 == 0, "n-tiles come in pairs");
  const int lane = threadIdx.x & 31, i = lane >> 3, r = lane & 7;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      ldsm_x4(b, p + (16 * np + r + (i >> 1) * 8) * ld + 16 * ks + (i & 1) * 8);
      mma_bf16(acc[2 * np], a[ks], b[0], b[1]);
      mma_bf16(acc[2 * np + 1], a[ks], b[2], b[3]);
    }
  }
}

template <int NT>
__device__ __forceinline__ void zero_acc(float (&acc)[NT][4]) {
#pragma unroll
  for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
}

// ---------------------------------------------------------------- bf16 state tapes

// The walks keep their K x V state in registers as S^T m16n8 accumulator fragments (state_walk,
// walk_bwd): warp w holds S[nt][e] = state[k][v] with value column v = 16 w + g + 8 (e / 2) (in
// the CTA's column tile) and key row k = 8 nt + 2 q + (e % 2), g = lane / 4, q = lane % 4.

// Loads (store = false) or stores this warp's 16 columns of an f32 row-major [K][V] state
// (base at state[k = 0][tile column 0], row pitch V elements).
template <int K>
__device__ __forceinline__ void state_rw(float (&S)[K / 8][4], float* base, int V, bool store) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int nt = 0; nt < K / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int v = 16 * warp + g + 8 * (e >> 1), kk = 8 * nt + 2 * q + (e & 1);
      float* p = base + static_cast<int64_t>(kk) * V + v;
      if (store) {
        *p = S[nt][e];
      } else {
        S[nt][e] = *p;
      }
    }
  }
}

// Writes this warp's 16 columns of the state as bf16 (round to nearest, as pack_bf16 rounds an
// operand) to a row-major [K][V] state in global memory: base at state[k = 0][tile column 0], row
// pitch V elements. 16-byte stores (each instruction covers 16 rows x 32 bytes, full sectors), via
// a transpose through this warp's columns 16 w..16 w + 15 of a 64-row bf16 shared tile (tile at its
// [0][0], pitch LD; 2 LD a multiple of 16 and LD / 2 = 4 mod 32 words: the 2-byte writes and the
// 16-byte reads are bank-conflict free) that no other warp touches meanwhile; K / 64 passes of 64
// rows. The tile's columns are free again when this returns (it ends with __syncwarp).
template <int K, int LD>
__device__ __forceinline__ void state_store_bf16(const float (&S)[K / 8][4], bf16* base, int V,
                                                 bf16* tile) {
  static_assert(K % 64 == 0, "K / 64 passes of 64 rows");
  static_assert((LD * sizeof(bf16)) % 16 == 0, "tile rows must stay 16-byte aligned");
  static_assert((LD / 2) % 32 == 4, "tile pitch: the bank-conflict-free mapping assumes 4 mod 32");
  constexpr int ld = LD;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  bf16* t = tile + 16 * warp;
  bf16* dst = base + 16 * warp;
#pragma unroll
  for (int half = 0; half < K / 64; ++half) {
    __syncwarp();  // this warp's earlier reads of t are done
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        t[(8 * nt + 2 * q + (e & 1)) * ld + g + 8 * (e >> 1)] =
            __float2bfloat16_rn(S[8 * half + nt][e]);
    __syncwarp();
    // lanes 8j..8j+7 of pass i: rows 8 (2i + j / 2) + 0..7, 16-byte piece j % 2 of the 32-byte row
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = 32 * i + lane, r = (idx & 7) + 8 * (idx >> 4), p = (idx >> 3) & 1;
      const uint4 x = *reinterpret_cast<const uint4*>(t + r * ld + 8 * p);
      *reinterpret_cast<uint4*>(dst + static_cast<int64_t>(64 * half + r) * V + 8 * p) = x;
    }
  }
  __syncwarp();
}

// Zeros this warp's 16 columns of a bf16 [K][V] state (base as above). Rare paths only (unused
// chunk slots), so plain 2-byte stores.
template <int K>
__device__ __forceinline__ void state_zero_bf16(bf16* base, int V) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  const bf16 z = __float2bfloat16_rn(0.f);
#pragma unroll
  for (int nt = 0; nt < K / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      base[static_cast<int64_t>(8 * nt + 2 * q + (e & 1)) * V + 16 * warp + g + 8 * (e >> 1)] = z;
}

// ---------------------------------------------------------------- chunk bounds

// Tokens [start, start + len) of chunk c, clamped to the buffer (a malformed table then gives
// wrong values that poison shows, never an out-of-bounds access). len == 0: unused chunk.
struct ChunkSpan {
  int64_t start;
  int len;
};

__device__ __forceinline__ ChunkSpan chunk_span(const int32_t* cstart, const int32_t* clen,
                                                int c, int64_t num_tokens) {
  ChunkSpan s;
  s.start = cstart[c];
  int len = min(max(clen[c], 0), kChunk);
  if (s.start < 0 || s.start >= num_tokens) len = 0;
  s.len = static_cast<int>(min(static_cast<int64_t>(len), num_tokens - max(s.start, int64_t{0})));
  if (s.len <= 0) {
    s.len = 0;
    s.start = 0;
  }
  return s;
}

}  // namespace jax_cake_gdn
