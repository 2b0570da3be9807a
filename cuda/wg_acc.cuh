// Helpers on the wgmma accumulator layout (wgmma.cuh): the 64 x N accumulator of a warpgroup
// holds rows 16 wq + g + 8 (e / 2) and columns 8 j + 2 q + e % 2 in element 4 j + e (wq: the warp
// in its warpgroup, g = lane / 4, q = lane % 4); a K x 64 state is K / 64 such accumulators
// (rows 64 b..). Loading them, storing them as swizzled slabs or to global memory, the Att gate
// and the state update, shared by the walks.
//
// Slab transfers move 8x8 matrices with ldmatrix / stmatrix, four a warp instruction: for the
// column pieces j, j + 1 of a warp's 16 rows, matrix m = 0..3 is (rows 8 (m % 2).., piece
// j + m / 2), so a thread's register m is its pair 4 j + 2 (m % 2) + 4 (m / 2) of the
// accumulator, and lane l addresses row l % 8 of matrix l / 8 (each 8-column piece is one
// 16-byte unit of the 128-byte swizzle).
#pragma once

#include "device_common.cuh"
#include "wgmma.cuh"

namespace jax_cake_gdn {

// Row and column (within a piece pair) of the 8-column piece that lane addresses in an x4 group.
__device__ __forceinline__ int wg_x4_row(int wq) {
  const int lane = threadIdx.x & 31;
  return 16 * wq + (lane & 7) + 8 * ((lane >> 3) & 1);
}
__device__ __forceinline__ int wg_x4_col() { return 8 * ((threadIdx.x & 31) >> 4); }

// A 64 x 64 accumulator from a bf16 swizzled slab (row r, column c at sw128_offset(r, c); the
// layout wg_store_slab writes).
__device__ __forceinline__ void wg_load_slab64(float (&acc)[32], const unsigned char* slab,
                                               int wq) {
  const int row = wg_x4_row(wq), col = wg_x4_col();
#pragma unroll
  for (int j = 0; j < 8; j += 2) {
    uint32_t r[4];
    ldsm_x4(r, slab + sw128_offset(row, 8 * j + col));
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const __nv_bfloat162 x = *reinterpret_cast<const __nv_bfloat162*>(&r[m]);
      acc[4 * j + 2 * m] = __low2float(x);
      acc[4 * j + 2 * m + 1] = __high2float(x);
    }
  }
}

// Rows 0..63 (times s0 for rows 16 wq + g, s1 for 16 wq + g + 8) of a 64 x N accumulator x as
// bf16 into a swizzled slab at columns col0.. (row r at slab rows row0 + r).
template <int N>
__device__ __forceinline__ void wg_stsm_rows(const float (&x)[N / 2], unsigned char* slab,
                                             int wq, int row0, int col0, float s0, float s1) {
  static_assert(N % 16 == 0, "pairs of 8-column pieces");
  const int row = row0 + wg_x4_row(wq), col = col0 + wg_x4_col();
#pragma unroll
  for (int j = 0; j < N / 8; j += 2)
    stsm_x4(slab + sw128_offset(row, 8 * j + col), pack_bf16(s0 * x[4 * j], s0 * x[4 * j + 1]),
            pack_bf16(s1 * x[4 * j + 2], s1 * x[4 * j + 3]),
            pack_bf16(s0 * x[4 * j + 4], s0 * x[4 * j + 5]),
            pack_bf16(s1 * x[4 * j + 6], s1 * x[4 * j + 7]));
}

// Columns of a 64 x 64 accumulator x (column c times f[c], f: 64 floats) as bf16 into a
// swizzled [64 columns][64 rows] slab: element (r, c) at sw128_offset(c, r) (stmatrix .trans):
// a transposed accumulator (rows: value, columns: token) to token rows.
__device__ __forceinline__ void wg_stsm_cols_t(const float (&x)[32], unsigned char* slab, int wq,
                                               const float* f) {
  const int lane = threadIdx.x & 31, q = lane & 3;
  const int col = 16 * wq + 8 * ((lane >> 3) & 1), row_in = (lane & 7) + 8 * (lane >> 4);
#pragma unroll
  for (int j = 0; j < 8; j += 2) {
    const float f0 = f[8 * j + 2 * q], f1 = f[8 * j + 2 * q + 1];
    const float f2 = f[8 * j + 8 + 2 * q], f3 = f[8 * j + 9 + 2 * q];
    stsm_x4_t(slab + sw128_offset(8 * j + row_in, col), pack_bf16(f0 * x[4 * j], f1 * x[4 * j + 1]),
              pack_bf16(f0 * x[4 * j + 2], f1 * x[4 * j + 3]),
              pack_bf16(f2 * x[4 * j + 4], f3 * x[4 * j + 5]),
              pack_bf16(f2 * x[4 * j + 6], f3 * x[4 * j + 7]));
  }
}

// One k16 step of a transposed accumulator as A fragments (wg_acc_to_a: columns 16 ts..16 ts +
// 15) into the slab of wg_stsm_cols_t (unscaled): element (r, c) at sw128_offset(c, r).
__device__ __forceinline__ void wg_stsm_frag_t(const uint32_t (&a)[4], unsigned char* slab,
                                               int ts, int wq) {
  const int lane = threadIdx.x & 31;
  const int col = 16 * wq + 8 * ((lane >> 3) & 1), row_in = (lane & 7) + 8 * (lane >> 4);
  stsm_x4_t(slab + sw128_offset(16 * ts + row_in, col), a[0], a[1], a[2], a[3]);
}

// A 64 x N accumulator transposed as bf16 into N / 64 such slabs: element (r, c)
// in slab c / 64 (slabs 8 KB apart) at sw128_offset(c % 64, r); the bf16 values of wg_acc_to_a.
template <int N>
__device__ __forceinline__ void wg_stsm_t(const float (&x)[N / 2], unsigned char* slabs, int wq) {
#pragma unroll
  for (int ts = 0; ts < N / 16; ++ts) {
    uint32_t a[4];
    wg_acc_to_a<N>(x, ts, a);
    wg_stsm_frag_t(a, slabs + (ts / 4) * (kChunk * 128), ts % 4, wq);
  }
}

// Column c of a 64 x N accumulator times f[c] (f: N floats, shared memory).
template <int N>
__device__ __forceinline__ void wg_scale_cols(float (&x)[N / 2], const float* f) {
  const int q = threadIdx.x & 3;
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    const float f0 = f[8 * j + 2 * q], f1 = f[8 * j + 2 * q + 1];
    x[4 * j] *= f0;
    x[4 * j + 1] *= f1;
    x[4 * j + 2] *= f0;
    x[4 * j + 3] *= f1;
  }
}

// Loads (store = false) or stores the f32 state [K][V] (tile column 0, row pitch V) from / to
// one transposed accumulator ST (64 x K: ST[4 j + e] = state[8 j + 2 q + e % 2][16 wq + g +
// 8 (e / 2)]); once a segment, so plain 4-byte accesses.
template <int K>
__device__ __forceinline__ void wg_state_rw_t(float (&ST)[K / 2], float* base, int V, bool store,
                                              int wq) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int j = 0; j < K / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float* p = base + static_cast<int64_t>(8 * j + 2 * q + (e & 1)) * V + 16 * wq + g +
                 8 * (e >> 1);
      if (store) {
        *p = ST[4 * j + e];
      } else {
        ST[4 * j + e] = *p;
      }
    }
}

// Sb = bf16(S) for a K x 64 state in K / 64 accumulators (wq: the warp in its warpgroup):
// element (key r, column c) at sw128_offset(r, c), one slab of K rows (the MN-major B operand).
template <int K>
__device__ __forceinline__ void wg_write_sb(const float (&S)[K / 64][32], unsigned char* Sb,
                                            int wq) {
#pragma unroll
  for (int b = 0; b < K / 64; ++b) wg_stsm_rows<64>(S[b], Sb, wq, 64 * b, 0, 1.f, 1.f);
}

// Loads (store = false) or stores the f32 state [K][V] rows at base (tile column 0, row pitch V)
// from / to the accumulators S[b][4 j + e] = state[64 b + 16 wq + g + 8 (e / 2)][8 j + 2 q + e % 2]
// (wq: the warp in its warpgroup).
template <int K>
__device__ __forceinline__ void wg_state_rw(float (&S)[K / 64][32], float* base, int V,
                                            bool store, int wq) {
  const int lane = threadIdx.x & 31, warp = wq, g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int b = 0; b < K / 64; ++b)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float2* p = reinterpret_cast<float2*>(
            base + static_cast<int64_t>(64 * b + 16 * warp + g + 8 * half) * V + 8 * j + 2 * q);
        float* s = &S[b][4 * j + 2 * half];
        if (store) {
          *p = make_float2(s[0], s[1]);
        } else {
          const float2 x = *p;
          s[0] = x.x;
          s[1] = x.y;
        }
      }
}

// Rows r < rows of a Rows x 64 bf16 swizzled slab to global rows dst + r * ld with 16-byte
// stores, by the 128 threads of one warpgroup (t: the thread's index in it).
template <int Rows>
__device__ __forceinline__ void wg_copy_slab(const unsigned char* slab, bf16* dst, int64_t ld,
                                             int rows, int t) {
#pragma unroll 2
  for (int n = 0; n < Rows * 8 / 128; ++n) {
    const int i = t + n * 128, r = i / 8, cj = i % 8;
    if (r < rows)
      *reinterpret_cast<uint4*>(dst + r * ld + 8 * cj) =
          *reinterpret_cast<const uint4*>(slab + 128 * r + 16 * (cj ^ (r % 8)));
  }
}

// A K x 64 slab of wg_write_sb to global rows of pitch V (bf16).
template <int K>
__device__ __forceinline__ void wg_copy_sb(const unsigned char* Sb, bf16* dst, int V, int t) {
  wg_copy_slab<K>(Sb, dst, V, K, t);
}

// S *= e (the decay of a chunk), before the wgmma fence of an update.
template <int K>
__device__ __forceinline__ void wg_scale_state(float (&S)[K / 64][32], float e) {
#pragma unroll
  for (int b = 0; b < K / 64; ++b) {
#pragma unroll
    for (int i = 0; i < 32; ++i) S[b][i] *= e;
    wgmma_fence_operand(S[b]);
  }
}

// Issues acc += kSign A B, a 64 x 64 product over D / 16 k-steps: A = [64][D] as D / 64 K-major
// slabs, B = [D][64] as one MN-major slab (b_lbo: its descriptor's leading byte offset). The
// caller fences before and commits / waits after.
template <int D, int kSign = 1>
__device__ __forceinline__ void wg_issue_mm64(float (&acc)[32], const unsigned char* A,
                                              const unsigned char* B, uint32_t b_lbo = 16) {
  constexpr uint32_t kSlab = kChunk * 128;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
    wgmma_m64k16_ss<64, false, true, kSign>(acc, sw128_desc(A + (ks / 4) * kSlab + 32 * (ks % 4)),
                                            sw128_desc(B + 2048 * ks, b_lbo), true);
}

// Issues product 1 of a walk, acc -= Ws Sb (acc holds u): Ws = w as K / 64 K-major slabs
// [64 tokens][K keys], Sb = bf16(S) as one MN-major slab of K rows (wg_write_sb).
template <int K>
__device__ __forceinline__ void wg_issue_product1(float (&acc)[32], const unsigned char* Ws,
                                                  const unsigned char* Sb) {
  wg_issue_mm64<K, -1>(acc, Ws, Sb, K * 128);
}

// Issues S[b] += kSign A_b^T B for the 64-key blocks b of a K x 64 state (4 k-steps over the
// chunk's tokens): A = a [64 tokens][K keys] tile as K / 64 slabs, each an MN-major A; B = a
// [64 tokens][64] slab, MN-major. The caller fences before and commits / waits after.
template <int K, int kSign = 1>
__device__ __forceinline__ void wg_issue_state_update(float (&S)[K / 64][32],
                                                      const unsigned char* A,
                                                      const unsigned char* B) {
  constexpr uint32_t kSlab = kChunk * 128;
#pragma unroll
  for (int b = 0; b < K / 64; ++b)
#pragma unroll
    for (int ks = 0; ks < kChunk / 16; ++ks)
      wgmma_m64k16_ss<64, true, true, kSign>(S[b], sw128_desc(A + b * kSlab + 2048 * ks, kSlab),
                                             sw128_desc(B + 2048 * ks, kSlab), true);
}

// d_t = r_t e^{G_C - G_t} for token t < len of a chunk (r: rstd rows, null: 1; G: its gate
// cumsum rows, GC = G of its last token), 0 beyond: the factor of v_new in the state update
// S <- e^{G_C} S + k^T diag(d) v_new of both walks.
__device__ __forceinline__ float walk_decay(int t, int len, float GC, const float* G,
                                            const float* r) {
  const bool in = t < len;  // no branch: the exponent is -inf beyond the chunk
  const float e = exp_ftz(in ? GC - G[t] : -INFINITY);
  return in && r != nullptr ? r[t] * e : e;
}

// e^{G_i - G_j} for j <= i, else 0 (no branch: the exponent is -inf above the diagonal, never
// e^{-G}); gi = G_i, G_j = sg[min(j, last)]. The one gate of Att's elements.
__device__ __forceinline__ float gate_factor(int i, int j, float gi, const float* sg,
                                             int last = kChunk - 1) {
  return exp_ftz(j <= i ? gi - sg[min(j, last)] : -INFINITY);
}

// Att = tril_incl(Gam o Q K^T) on a 64 x N wgmma accumulator holding columns col0.. of Q K^T
// (warp wq of its warpgroup: rows 16 wq + g + 8 (e / 2), columns col0 + 8 j + 2 q + e % 2 of
// att[4 j + e]): gate_factor times the product for j <= i, else 0; then times
// rs[j] when rs is given (a per-column factor). G of row i is sg[min(i, last)] (rows beyond a
// chunk repeat its last G). Every kernel that builds Att (walk_output, walk_bwd) does it
// here (walk_bwd split in two around its product's wait: wg_gate_factors, wg_gate_apply).
template <int N>
__device__ __forceinline__ void wg_gate_scores(float (&att)[N / 2], const float* sg, int wq,
                                               int col0 = 0, int last = kChunk - 1,
                                               const float* rs = nullptr) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int i = 16 * wq + g + 8 * half;
    const float gi = sg[min(i, last)];
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int jj = col0 + 8 * j + 2 * q + e;
        float& a = att[4 * j + 2 * half + e];
        const float x = gate_factor(i, jj, gi, sg, last);
        a = jj <= i ? x * a : 0.f;
        if (rs != nullptr) a *= rs[jj];
      }
  }
}

// wg_gate_scores (last = kChunk - 1) in two parts, the same operations in the same order (so the
// same bits): the factors x[4 j + 2 half + e] = e^{G_i - G_j} (j <= i) and rsv[2 j + e] = rs[j]
// (1 without rs) need only sg and rs, so a caller makes them before its product's wgmma_wait and
// applies them after it.
template <int N>
__device__ __forceinline__ void wg_gate_factors(float (&x)[N / 2], float (&rsv)[N / 4],
                                                const float* sg, int wq, int col0,
                                                const float* rs) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int i = 16 * wq + g + 8 * half;
    const float gi = sg[i];
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int jj = col0 + 8 * j + 2 * q + e;
        x[4 * j + 2 * half + e] = gate_factor(i, jj, gi, sg);
        if (half == 0) rsv[2 * j + e] = rs != nullptr ? rs[jj] : 1.f;
      }
  }
}

template <int N>
__device__ __forceinline__ void wg_gate_apply(float (&att)[N / 2], const float (&x)[N / 2],
                                              const float (&rsv)[N / 4], int wq, int col0,
                                              bool has_rs) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int i = 16 * wq + g + 8 * half;
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& a = att[4 * j + 2 * half + e];
        a = col0 + 8 * j + 2 * q + e <= i ? x[4 * j + 2 * half + e] * a : 0.f;
        if (has_rs) a *= rsv[2 * j + e];
      }
  }
}

// A 64 x N accumulator (the layout above, columns col0..) as bf16 into a swizzled slab (row r,
// column c at sw128_offset(r, c)), rows 16 wq + g times s0 and rows 16 wq + g + 8 times s1: the
// K-major A operand of Att v_new, an MN-major one for Att^T, or a [token][v] B operand.
template <int N>
__device__ __forceinline__ void wg_store_slab(const float (&x)[N / 2], unsigned char* slab,
                                              int wq, int col0 = 0, float s0 = 1.f,
                                              float s1 = 1.f) {
  wg_stsm_rows<N>(x, slab, wq, 0, col0, s0, s1);
}

}  // namespace jax_cake_gdn
