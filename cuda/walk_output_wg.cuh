// The light forward's fused walk + output on Hopper warpgroup MMA: the state walk of
// state_walk_wg.cuh with each chunk's output computed in the walk (neither h nor v_new leaves
// the chip):
//
//   Att = tril_incl(Gam o Q K^T)            o = scale (diag(e^G) Q S + Att v_new)
//
// One CTA of V / 64 warpgroups per (segment, value head); warpgroup wg owns the value columns
// 64 wg..64 wg + 63 (its K x 64 state in K / 64 accumulators, its slabs Sb and Vn), all share
// the w, Kd, Q, K and Att slabs. Per chunk:
//   top: staged k, q -> Kd = k rstd e^{G_C - G}, Ks = k rstd, Qs = q rstd_q (swizzled slabs,
//        every thread its pieces); Sb = bf16(S); the product-1 accumulator = u
//   Att: Qs Ks^T, 8 k-steps (every warpgroup: a wgmma under a branch is serialized by ptxas),
//        then warpgroup 0 gates it (wg_gate_scores, output.cuh) into a bf16 slab
//   product 1: v_new = u - Ws Sb;  oacc = Qs Sb       (per warpgroup, 8 k-steps each)
//   Vn = bf16(v_new);  oacc = e^G oacc + Att Vn;  S = e^{G_C} S + Kd^T Vn;  o = scale oacc
// Every operand and every k16 step is the former mma.sync walk_output's, in the same order from
// the same start, so o and the final state are expected bit for bit equal to it (the wgmma state
// walk was, on the H200).
// Shared memory (K = V = 128, bf16 q / k): w, Kd, Q, K slabs 16 KB each, Sb 2 x 16 KB, Vn
// 2 x 8 KB, Att 8 KB, u staging 32 KB, k and q staging 16 KB each, rows 1 KB, + 1 KB alignment:
// 186 KB (f32 q / k: 218 KB), 1 CTA of 8 warps per SM.
#pragma once

#include "output.cuh"
#include "state_walk_wg.cuh"

namespace jax_cake_gdn {

template <typename In, int K, int V>
struct WalkOutWgSmem {
  static constexpr int kWarpgroups = V / 64;
  static constexpr size_t kSlab = size_t{kChunk} * 128;  // 64 rows x 64 bf16
  static constexpr size_t kTok = K / 64 * kSlab;           // [64 tokens][K] as slabs
  static constexpr size_t oWs = 0;
  static constexpr size_t oKd = oWs + kTok;
  static constexpr size_t oQs = oKd + kTok;
  static constexpr size_t oKs = oQs + kTok;
  static constexpr size_t oSb = oKs + kTok;                               // per warpgroup
  static constexpr size_t oVn = oSb + kWarpgroups * size_t{K} * 128;      // per warpgroup
  static constexpr size_t oAtt = oVn + kWarpgroups * kSlab;               // [i][j]
  static constexpr size_t oStU = oAtt + kSlab;                            // f32 [64][V]
  static constexpr size_t oStK = oStU + size_t{kChunk} * V * sizeof(float);
  static constexpr size_t oStQ = oStK + size_t{kChunk} * K * sizeof(In);
  static constexpr size_t oRows = oStQ + size_t{kChunk} * K * sizeof(In);  // G, rstd, rstd_q, sG
  static constexpr size_t bytes = oRows + 4 * kChunk * sizeof(float) + 1024;  // + alignment
  static_assert(bytes <= 227 * 1024, "walk_output_wg: shared memory over the sm_90 limit");
};

template <int V>
constexpr int walk_output_wg_threads() {
  return 2 * V;  // V / 64 warpgroups of 128
}

template <typename In, typename Out, int K, int V>
__global__ void __launch_bounds__(walk_output_wg_threads<V>(), 1)
    walk_output_wg_kernel(const In* __restrict__ qin, const In* __restrict__ k,
                          const bf16* __restrict__ w, const float* __restrict__ u,
                          const float* __restrict__ G, const float* __restrict__ h0,
                          const float* __restrict__ rstd_q,  // nullable
                          const float* __restrict__ rstd,    // nullable
                          const int32_t* __restrict__ cstart, const int32_t* __restrict__ clen,
                          const int32_t* __restrict__ seg_first,
                          const int32_t* __restrict__ seg_last,
                          const int32_t* __restrict__ seg_len, Out* __restrict__ o,
                          float* __restrict__ final_state, int64_t num_tokens, int H, int HV,
                          int NC, float scale) {
  static_assert(K == 64 || K == 128, "K = 64 or 128");
  static_assert(V == 64 || V == 128, "V = 64 or 128");
  using Sm = WalkOutWgSmem<In, K, V>;
  constexpr int kThreads = walk_output_wg_threads<V>();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = align_1024(smem_raw);
  unsigned char* Ws = smem + Sm::oWs;
  unsigned char* Kd = smem + Sm::oKd;
  unsigned char* Qs = smem + Sm::oQs;
  unsigned char* Ks = smem + Sm::oKs;
  unsigned char* AttS = smem + Sm::oAtt;
  float* stU = reinterpret_cast<float*>(smem + Sm::oStU);
  In* stK = reinterpret_cast<In*>(smem + Sm::oStK);
  In* stQ = reinterpret_cast<In*>(smem + Sm::oStQ);
  float* stG = reinterpret_cast<float*>(smem + Sm::oRows);
  float* stR = stG + kChunk;
  float* stRq = stR + kChunk;
  float* sG = stRq + kChunk;  // G of the chunk, padding rows = G_C (the mask's and e^G's rows)

  const int hv = blockIdx.x % HV, s = blockIdx.x / HV;  // segments x heads (table order)
  const int hk = hv / (HV / H);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
  const int wg = warp >> 2, wq = warp & 3;  // warpgroup, warp in it
  unsigned char* Sb = smem + Sm::oSb + wg * size_t{K} * 128;
  unsigned char* Vn = smem + Sm::oVn + wg * Sm::kSlab;
  const int64_t state_stride = int64_t{K} * V;

  float S[K / 64][32];
  const int64_t state0 = (static_cast<int64_t>(s) * HV + hv) * state_stride + 64 * wg;
  float* fin = final_state + state0;
  wg_state_rw<K>(S, const_cast<float*>(h0) + state0, V, false, wq);

  const int c_first = seg_first[s], c_last = seg_last[s];
  const bool empty = seg_len[s] <= 0 || c_first < 0 || c_last >= NC || c_last < c_first;
  if (empty) {
    wg_state_rw<K>(S, fin, V, true, wq);
    return;
  }

  using P = TilePieces<kChunk, K, kThreads>;
  auto prefetch_w = [&](int c) {  // w straight into its swizzled slabs
    const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
    cp_async_tile_at<kChunk, K, kThreads, false>(
        slab_at<kChunk>(Ws), w + (cs.start * HV + hv) * K, int64_t{HV} * K, cs.len);
  };
  auto prefetch_rows = [&](int c) {  // k, q, u, G, rstd, rstd_q into staging
    const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
    cp_async_tile<kChunk, K, kThreads, false>(stK, K, k + (cs.start * H + hk) * K,
                                              int64_t{H} * K, cs.len);
    cp_async_tile<kChunk, K, kThreads, false>(stQ, K, qin + (cs.start * H + hk) * K,
                                              int64_t{H} * K, cs.len);
    const float* src = u + (cs.start * HV + hv) * V;
#pragma unroll 1
    for (int i = tid; i < kChunk * (V / 4); i += kThreads) {  // pieces of 4 f32
      const int t = i / (V / 4), c4 = 4 * (i % (V / 4));
      const bool ok = t < cs.len;
      cp_async16(stU + ustage_index<V>(t, c4), ok ? src + t * (int64_t{HV} * V) + c4 : src, ok);
    }
    const RowVector rows[3] = {{stG, G, HV, hv}, {stR, rstd, H, hk}, {stRq, rstd_q, H, hk}};
    cp_async_row_vectors<kThreads>(rows, cs.start, cs.len);
  };

  // Commit groups per chunk c: the rows of c + 1 once the staging is converted; w of c + 1 once
  // product 1 is done with Ws. The top waits for both.
  prefetch_rows(c_first);
  prefetch_w(c_first);
  cp_async_commit();
  for (int c = c_first; c <= c_last; ++c) {
    const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
    const int len = cs.len;
    cp_async_wait_all();
    __syncthreads();  // chunk c's staging and w have landed; chunk c - 1 is done everywhere

    const float GC = len > 0 ? stG[len - 1] : 0.f;
    const float eGC = __expf(GC);
    // staged k, q -> Kd, Ks, Qs slabs (x rstd; Kd x e^{G_C - G}, zero beyond len)
    {
      const int t0 = P::row0(), col = P::col();
#pragma unroll 2
      for (int j = 0; j < P::kPer; ++j) {
        const int t = t0 + j * P::kRowStep;
        const uint32_t off = slab_offset<kChunk>(t, col);
        float f[8];
        lds8(stK + t * K + col, f);
        const float r = rstd != nullptr ? stR[t] : 1.f;
        sts8_bf16(reinterpret_cast<bf16*>(Kd + off), f, t < len ? r * __expf(GC - stG[t]) : 0.f);
        sts8_bf16(reinterpret_cast<bf16*>(Ks + off), f, r);
        lds8(stQ + t * K + col, f);
        sts8_bf16(reinterpret_cast<bf16*>(Qs + off), f, rstd_q != nullptr ? stRq[t] : 1.f);
      }
      if (tid < kChunk) sG[tid] = stG[min(tid, max(len - 1, 0))];
    }
    float acc[32];
    wg_load_u<V>(acc, stU, 64 * wg, wq);
    wg_write_sb<K>(S, Sb, wq);
    fence_proxy_async();
    __syncthreads();  // slabs and sG ready; the staging is free
    if (c < c_last) prefetch_rows(c + 1);
    cp_async_commit();

    // Att, product 1 and Q S
    float att[32], oacc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) att[i] = oacc[i] = 0.f;
    wgmma_fence_operand(att);
    wgmma_fence_operand(oacc);
    wgmma_fence_operand(acc);
    wgmma_fence();
    // (every warpgroup computes Att: a wgmma under a branch makes ptxas serialize them all)
#pragma unroll
    for (int ks = 0; ks < K / 16; ++ks) {
      const uint32_t kk = (ks / 4) * Sm::kSlab + 32 * (ks % 4);
      wgmma_m64k16_ss<64, false, false, 1>(att, sw128_desc(Qs + kk), sw128_desc(Ks + kk), true);
    }
#pragma unroll
    for (int ks = 0; ks < K / 16; ++ks) {
      const uint32_t kk = (ks / 4) * Sm::kSlab + 32 * (ks % 4);
      const uint64_t db = sw128_desc(Sb + 2048 * ks, K * 128);
      wgmma_m64k16_ss<64, false, true, -1>(acc, sw128_desc(Ws + kk), db, true);
      wgmma_m64k16_ss<64, false, true, 1>(oacc, sw128_desc(Qs + kk), db, true);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(att);
    wgmma_fence_operand(oacc);
    wgmma_fence_operand(acc);

    if (wg == 0) {  // the mask and Gam, into the Att slab
      wg_gate_scores(att, sG, wq);
      wg_store_slab64(att, AttS, wq);
    }
    wg_store_slab64(acc, Vn, wq);
    fence_proxy_async();
    __syncthreads();  // Att and Vn complete; every warpgroup is done with Ws
    if (c < c_last) prefetch_w(c + 1);
    cp_async_commit();

    // o = e^G (Q S) + Att Vn;  S = e^{G_C} S + Kd^T Vn
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float eg = __expf(sG[16 * wq + g + 8 * half]);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        oacc[4 * j + 2 * half] *= eg;
        oacc[4 * j + 2 * half + 1] *= eg;
      }
    }
    wg_scale_state<K>(S, eGC);
    wgmma_fence_operand(oacc);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kChunk / 16; ++ks)
      wgmma_m64k16_ss<64, false, true, 1>(oacc, sw128_desc(AttS + 32 * ks),
                                          sw128_desc(Vn + 2048 * ks, Sm::kSlab), true);
    wg_issue_state_update<K>(S, Kd, Vn);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(oacc);
#pragma unroll
    for (int b = 0; b < K / 64; ++b) wgmma_fence_operand(S[b]);

#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int t = 16 * wq + g + 8 * half;
      if (t < len) {
        Out* op = o + ((cs.start + t) * HV + hv) * V + 64 * wg + 2 * q;
#pragma unroll
        for (int j = 0; j < 8; ++j)
          store2(op + 8 * j, scale * oacc[4 * j + 2 * half], scale * oacc[4 * j + 2 * half + 1]);
      }
    }
  }

  wg_state_rw<K>(S, fin, V, true, wq);
}

}  // namespace jax_cake_gdn
