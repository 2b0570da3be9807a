// The chunk output (DESIGN.md section 1), one CTA of 4 warps per (chunk, value head), value heads
// of one chunk adjacent in the (1-D) grid so GVA heads share q / k through L2:
//
//   Att = tril_incl(Gam o Q K^T)                 (unscaled; written as bf16 `scores` when asked:
//                                                 the operand values walk_bwd uses)
//   o   = scale (diag(e^G) Q h + Att v_new)      -> [T, HV, V] in the output dtype
//
// q, k (normalised by rstd when given) are rounded to bf16 in shared memory; h (the state
// entering the chunk) and v_new are bf16 already (the state walk rounds them) and go straight
// into their tiles with cp.async. Warp w owns output rows 16w..16w+15: its Q fragments stay in
// registers for Q K^T and Q h; Att goes from accumulators to A fragments in registers (no shared
// round trip) for Att v_new; o is produced in 64-column panels. e^G multiplies the rows of Q h
// (never e^{-G}, which can overflow); Gam_ij = exp(G_i - G_j) is evaluated for i >= j only.
#pragma once

#include "fwd_common.cuh"

namespace jax_cake_gdn {

constexpr int kOutThreads = 128;

// Att rows 16rw..16rw+15, columns j0..j0+8NT-1: tril_incl(Gam o Q K^T), unscaled.
// qa: Q row fragments of rows 16rw.. (bf16 Q tile, normalised by rstd_q); Ks: the bf16 K tile
// (normalised by rstd_k, zero rows beyond the chunk), pitch ld; sg: G of the chunk's 64 rows
// (rows beyond the chunk repeat its last G). Each element's mma sequence (over k) and mask do not
// depend on the column split, so every split builds bit-identical scores. Shared by the output
// kernel (chunk_scores below) and the fused walk (state_walk.cuh, kOutput).
template <int KS, int NT>
__device__ __forceinline__ void chunk_scores_part(float (&att)[NT][4],
                                                  const uint32_t (&qa)[KS][4], const bf16* Ks,
                                                  int ld, const float* sg, int rw, int j0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, qd = lane & 3;
  zero_acc(att);
  mma_rt<KS, NT>(att, qa, Ks + j0 * ld, ld);
  const int i0 = 16 * rw + g, i1 = i0 + 8;
  const float gi0 = sg[i0], gi1 = sg[i1];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = (e >> 1) ? i1 : i0, j = j0 + 8 * nt + 2 * qd + (e & 1);
      const float gi = (e >> 1) ? gi1 : gi0;
      att[nt][e] = j <= i ? __expf(gi - sg[j]) * att[nt][e] : 0.f;
    }
  }
}

// Att rows 16w..16w+15 of this warp w, all 64 columns.
template <int KS>
__device__ __forceinline__ void chunk_scores(float (&att)[8][4], const uint32_t (&qa)[KS][4],
                                             const bf16* Ks, int ld, const float* sg) {
  chunk_scores_part<KS, 8>(att, qa, Ks, ld, sg, threadIdx.x >> 5, 0);
}

template <int K>
struct OutputSmem {
  static constexpr int KP = K + 8;
  static size_t vp(int V) { return static_cast<size_t>(V) + 8; }
  static size_t bytes(int V) {
    return (2 * size_t{kChunk} * KP + size_t{K} * vp(V) + size_t{kChunk} * vp(V)) * sizeof(bf16) +
           kChunk * sizeof(float);
  }
};

// (min 1 CTA/SM in the bounds: without it ptxas 13.0 caps bf16 K = 128 at 128 registers and
// spills; its 85 KB of shared memory sets 2 CTAs/SM either way)
template <typename In, typename Out, int K>
__global__ void __launch_bounds__(kOutThreads, 1)
    output_kernel(const In* __restrict__ q, const In* __restrict__ k,
                  const float* __restrict__ G, const bf16* __restrict__ h,
                  const bf16* __restrict__ v_new, const float* __restrict__ rstd_q,  // nullable
                  const float* __restrict__ rstd_k,                                   // nullable
                  const int32_t* __restrict__ cstart, const int32_t* __restrict__ clen,
                  Out* __restrict__ o, bf16* __restrict__ scores,  // scores nullable
                  int64_t num_tokens, int H, int HV, int V, float scale) {
  using Sm = OutputSmem<K>;
  constexpr int KP = Sm::KP, KS = K / 16;
  const int VP = V + 8;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Qs = reinterpret_cast<bf16*>(smem);
  bf16* Ks = Qs + kChunk * KP;
  bf16* Hs = Ks + kChunk * KP;
  bf16* Vs = Hs + K * VP;
  float* sg = reinterpret_cast<float*>(Vs + kChunk * VP);

  const int hv = blockIdx.x % HV, c = blockIdx.x / HV;  // value heads of one k head adjacent
  const int hk = hv / (HV / H);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, qd = lane & 3;
  const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
  const int len = cs.len;

  if (len == 0) {  // unused chunk: zero scores, no token rows
    if (scores != nullptr) {
      bf16* sp = scores + (static_cast<int64_t>(c) * HV + hv) * (kChunk * kChunk);
      for (int e = tid; e < kChunk * kChunk / 8; e += kOutThreads)
        reinterpret_cast<uint4*>(sp)[e] = make_uint4(0u, 0u, 0u, 0u);
    }
    return;
  }

  const int64_t qk_off = cs.start * H * K + hk * K;
  // h (bf16 [K][V], 16-byte pieces) and v_new stream in while q, k are converted
  const bf16* hsrc = h + (static_cast<int64_t>(c) * HV + hv) * K * V;
  const bf16* vsrc = v_new + (cs.start * HV + hv) * V;
  if (V == 64) {
    cp_async_tile<K, 64, kOutThreads>(Hs, VP, hsrc, V, K);
    cp_async_tile<kChunk, 64, kOutThreads>(Vs, VP, vsrc, int64_t{HV} * V, len);
  } else {
    cp_async_tile<K, 128, kOutThreads>(Hs, VP, hsrc, V, K);
    cp_async_tile<kChunk, 128, kOutThreads>(Vs, VP, vsrc, int64_t{HV} * V, len);
  }
  cp_async_commit();
  load_tile_bf16<kChunk, K, 8, kOutThreads>(Qs, KP, q + qk_off, int64_t{H} * K, len,
                                            ScaleRstd{rstd_q, cs.start, H, hk});
  load_tile_bf16<kChunk, K, 8, kOutThreads>(Ks, KP, k + qk_off, int64_t{H} * K, len,
                                            ScaleRstd{rstd_k, cs.start, H, hk});
  if (tid < kChunk) sg[tid] = G[(cs.start + min(tid, len - 1)) * HV + hv];
  cp_async_wait_all();
  __syncthreads();

  uint32_t qa[KS][4];
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) lda_rm(qa[ks], Qs + (16 * warp) * KP + 16 * ks, KP);

  // Att rows 16w.. x 64 columns
  float att[8][4];
  chunk_scores<KS>(att, qa, Ks, KP, sg);
  const int i0 = 16 * warp + g, i1 = i0 + 8;
  const float gi0 = sg[i0], gi1 = sg[i1];
  if (scores != nullptr) {
    bf16* sp = scores + (static_cast<int64_t>(c) * HV + hv) * (kChunk * kChunk);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      store2(sp + i0 * kChunk + 8 * nt + 2 * qd, att[nt][0], att[nt][1]);
      store2(sp + i1 * kChunk + 8 * nt + 2 * qd, att[nt][2], att[nt][3]);
    }
  }
  uint32_t pa[4][4];
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    pa[s][0] = pack_bf16(att[2 * s][0], att[2 * s][1]);
    pa[s][1] = pack_bf16(att[2 * s][2], att[2 * s][3]);
    pa[s][2] = pack_bf16(att[2 * s + 1][0], att[2 * s + 1][1]);
    pa[s][3] = pack_bf16(att[2 * s + 1][2], att[2 * s + 1][3]);
  }
  const float eg0 = __expf(gi0), eg1 = __expf(gi1);

  for (int p = 0; p < V / 64; ++p) {
    float acc[8][4];
    zero_acc(acc);
    mma_rm<KS, 8>(acc, qa, Hs + 64 * p, VP);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      acc[nt][0] *= eg0;
      acc[nt][1] *= eg0;
      acc[nt][2] *= eg1;
      acc[nt][3] *= eg1;
    }
    mma_rm<4, 8>(acc, pa, Vs + 64 * p, VP);
    if (i0 < len) {
      Out* op = o + ((cs.start + i0) * HV + hv) * V + 64 * p + 2 * qd;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) store2(op + 8 * nt, scale * acc[nt][0], scale * acc[nt][1]);
    }
    if (i1 < len) {
      Out* op = o + ((cs.start + i1) * HV + hv) * V + 64 * p + 2 * qd;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) store2(op + 8 * nt, scale * acc[nt][2], scale * acc[nt][3]);
    }
  }
}

}  // namespace jax_cake_gdn
