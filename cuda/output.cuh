// The chunk output (DESIGN.md section 1), one CTA of 4 warps per (chunk, value head), value heads
// of one chunk adjacent in the (1-D) grid so GVA heads share q / k through L2:
//
//   Att = diag(rq) tril_incl(Gam o Q K^T) diag(rk)  (unscaled; written as bf16 `scores` when
//                                                    asked: the operand values walk_bwd uses)
//   o   = scale (diag(rq e^G) Q h + Att v_new)      -> [T, HV, V] in the output dtype
//
// (rq, rk: rstd of q, k, 1 without the L2 norm.) q and k enter the products as they are (bf16
// ones by cp.async, f32 ones rounded to bf16 through registers) and the rstd factors go on the
// accumulators, as walk_output and walk_bwd do (walk_bwd recomputes Att bit for bit this way);
// h (the state entering the chunk) and v_new are bf16 already (the state walk rounds them) and
// go straight into their slabs with cp.async. The products run on wgmma (one warpgroup; warp w
// holds output rows 16w..16w+15); Att goes through a shared slab to Att v_new; o is produced in
// 64-column panels. e^G multiplies the rows of Q h (never e^{-G}, which can overflow); Gam_ij =
// exp(G_i - G_j) is evaluated for i >= j only (wg_gate_scores, wg_acc.cuh, shared with the walks).
#pragma once

#include "wg_acc.cuh"

namespace jax_cake_gdn {

constexpr int kOutThreads = 128;

template <int K>
struct OutputSmem {
  static constexpr size_t kSlab = size_t{kChunk} * 128;  // 64 rows x 64 bf16
  static constexpr size_t oQs = 0;                         // [64][K] as K / 64 slabs
  static constexpr size_t oKs = oQs + K / 64 * kSlab;      // [64][K] as K / 64 slabs
  static constexpr size_t oAtt = oKs + K / 64 * kSlab;     // [i][j]
  static constexpr size_t oHs = oAtt + kSlab;              // h: V / 64 slabs of K rows [key][v]
  // v_new: V / 64 slabs of 64 rows [token][v]; G, rstd_q, rstd_k of the chunk's rows; 1 KB for
  // the 1024-byte alignment
  __host__ __device__ static size_t oVs(int V) {
    return oHs + static_cast<size_t>(V) / 64 * K * 128;
  }
  __host__ __device__ static size_t oSg(int V) {
    return oVs(V) + static_cast<size_t>(V) / 64 * kSlab;
  }
  __host__ __device__ static size_t bytes(int V) {
    return oSg(V) + 3 * kChunk * sizeof(float) + 1024;
  }
};

// One warpgroup per (chunk, value head), on wgmma (wgmma.cuh): Q, K, h, v_new and Att as 128-byte
// swizzled slabs; Att = Q K^T (m64n64, K / 16 k-steps) gated by wg_gate_scores (with rk), times
// rq as it is stored; per 64-column panel p of V, o = rq e^G (Q h_p) + Att v_new_p.
// (min 1 CTA/SM in the bounds; 89 KB of shared memory at K = V = 128: 2 CTAs/SM)
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
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = align_1024(smem_raw);
  unsigned char* Qs = smem + Sm::oQs;
  unsigned char* Ks = smem + Sm::oKs;
  unsigned char* AttS = smem + Sm::oAtt;
  unsigned char* Hs = smem + Sm::oHs;
  unsigned char* Vs = smem + Sm::oVs(V);
  float* sg = reinterpret_cast<float*>(smem + Sm::oSg(V));
  float* sRq = sg + kChunk;
  float* sRk = sRq + kChunk;

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
  // h (bf16 [K][V]) and v_new by cp.async; bf16 q, k too, as they are; f32 q, k are rounded
  // through registers; the rstd rows by cp.async
  const bf16* hsrc = h + (static_cast<int64_t>(c) * HV + hv) * K * V;
  const bf16* vsrc = v_new + (cs.start * HV + hv) * V;
  if (V == 64) {
    cp_async_tile_at<K, 64, kOutThreads>(slab_at<K>(Hs), hsrc, V, K);
    cp_async_tile_at<kChunk, 64, kOutThreads>(slab_at<kChunk>(Vs), vsrc, int64_t{HV} * V, len);
  } else {
    cp_async_tile_at<K, 128, kOutThreads>(slab_at<K>(Hs), hsrc, V, K);
    cp_async_tile_at<kChunk, 128, kOutThreads>(slab_at<kChunk>(Vs), vsrc, int64_t{HV} * V, len);
  }
  constexpr bool kRaw = std::is_same_v<In, bf16>;
  if constexpr (kRaw) {
    cp_async_tile_at<kChunk, K, kOutThreads>(slab_at<kChunk>(Qs), q + qk_off, int64_t{H} * K, len);
    cp_async_tile_at<kChunk, K, kOutThreads>(slab_at<kChunk>(Ks), k + qk_off, int64_t{H} * K, len);
  }
  const RowVector rows[2] = {{sRq, rstd_q, H, hk}, {sRk, rstd_k, H, hk}};
  cp_async_row_vectors<kOutThreads>(rows, cs.start, len);
  cp_async_commit();
  if constexpr (!kRaw) {
    load_tile_bf16_at<kChunk, K, 8, kOutThreads>(slab_at<kChunk>(Qs), q + qk_off,
                                                 int64_t{H} * K, len, ScaleOne{});
    load_tile_bf16_at<kChunk, K, 8, kOutThreads>(slab_at<kChunk>(Ks), k + qk_off,
                                                 int64_t{H} * K, len, ScaleOne{});
  }
  if (tid < kChunk) sg[tid] = G[(cs.start + min(tid, len - 1)) * HV + hv];
  cp_async_wait_all();
  fence_proxy_async();
  __syncthreads();

  // Att = tril_incl(Gam o Q K^T): rows 16 warp.. of this warp, all 64 columns
  float att[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) att[i] = 0.f;
  wgmma_fence_operand(att);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < K / 16; ++ks) {
    const uint32_t kk = (ks / 4) * Sm::kSlab + 32 * (ks % 4);
    wgmma_m64k16_ss<64, false, false, 1>(att, sw128_desc(Qs + kk), sw128_desc(Ks + kk), true);
  }
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operand(att);
  const int i0 = 16 * warp + g, i1 = i0 + 8;
  // rows >= len: rstd 0 (zero-filled), their q rows are zero anyway
  const float rq0 = rstd_q != nullptr ? sRq[i0] : 1.f, rq1 = rstd_q != nullptr ? sRq[i1] : 1.f;
  wg_gate_scores<64>(att, sg, warp, 0, kChunk - 1, rstd_k != nullptr ? sRk : nullptr);
  wg_store_slab<64>(att, AttS, warp, 0, rq0, rq1);
  if (scores != nullptr) {
    bf16* sp = scores + (static_cast<int64_t>(c) * HV + hv) * (kChunk * kChunk);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      store2(sp + i0 * kChunk + 8 * j + 2 * qd, rq0 * att[4 * j], rq0 * att[4 * j + 1]);
      store2(sp + i1 * kChunk + 8 * j + 2 * qd, rq1 * att[4 * j + 2], rq1 * att[4 * j + 3]);
    }
  }
  fence_proxy_async();
  __syncthreads();  // Att complete
  const float eg0 = exp_ftz(sg[i0]) * rq0, eg1 = exp_ftz(sg[i1]) * rq1;

  for (int p = 0; p < V / 64; ++p) {
    float acc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = 0.f;
    wgmma_fence_operand(acc);
    wgmma_fence();
    wg_issue_mm64<K>(acc, Qs, Hs + p * size_t{K} * 128, K * 128);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(acc);
    wg_scale_rows(acc, eg0, eg1);
    wgmma_fence_operand(acc);
    wgmma_fence();
    wg_issue_mm64<kChunk>(acc, AttS, Vs + p * Sm::kSlab, Sm::kSlab);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(acc);
    if (i0 < len) {
      Out* op = o + ((cs.start + i0) * HV + hv) * V + 64 * p + 2 * qd;
#pragma unroll
      for (int j = 0; j < 8; ++j) store2(op + 8 * j, scale * acc[4 * j], scale * acc[4 * j + 1]);
    }
    if (i1 < len) {
      Out* op = o + ((cs.start + i1) * HV + hv) * V + 64 * p + 2 * qd;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        store2(op + 8 * j, scale * acc[4 * j + 2], scale * acc[4 * j + 3]);
    }
  }
}

}  // namespace jax_cake_gdn
