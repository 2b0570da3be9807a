// The light forward's fused walk + output on Hopper warpgroup MMA: the state walk of
// state_walk_wg.cuh with each chunk's output computed in the walk (neither h nor v_new leaves
// the chip). With r = rstd of k, rq = rstd of q (1 without L2 norm) and raw q, k:
//
//   Att_ij = [j <= i] e^{G_i - G_j} (q_i . k_j) r_j
//   o_i = scale rq_i (e^{G_i} q_i S + (Att v_new)_i)
//   S <- e^{G_C} S + k^T diag(d) v_new,   d_t = r_t e^{G_C - G_t} (0 beyond the chunk)
//
// so q and k enter the products as they are (bf16 q, k land by cp.async straight into their
// swizzled slabs, double-buffered by chunk parity and prefetched a chunk ahead; f32 q, k are
// rounded on the way) and every per-token factor is applied to an accumulator or to v_new.
// One CTA of V / 64 warpgroups per (segment, value head); warpgroup wg owns the value columns
// 64 wg..64 wg + 63 (its K x 64 state in K / 64 accumulators, its slabs Sb, Vn, Vd) and the
// columns kAttCols wg.. of Att (kAttCols = 64 / (V / 64): 32 at V = 128). Per chunk:
//   top: Sb = bf16(S); the product-1 accumulator = u; warpgroup barrier
//   product 1: v_new = u - Ws Sb;  then oacc = Q Sb, att = Q K^T (this warpgroup's columns)
//   Vn = bf16(v_new), Vd = bf16(d v_new);  Att gated (wg_gate_scores) into a slab
//   oacc = e^G oacc + Att Vn;  S = e^{G_C} S + K^T Vd;  o = scale rq oacc
// The state update is state_walk_wg.cuh's (the same operands and k16 order: the final state is
// expected bit for bit equal to it); o rounds other operands than the output kernel (which takes
// bf16(q rq), bf16(k r)), so o agrees with state_walk + output to bf16 rounding.
// Every input of chunk c + 1 (q, k, w, u, rows) is double-buffered and copied by a producer
// warpgroup (after the V / 64 compute warpgroups) while the compute warps work on chunk c: it
// issues the cp.async pieces, waits for them and fences them before it arrives at the barrier
// that opens chunk c + 1, so the compute warps issue no copies. Registers at V = 128: the CTA
// launches at 168 a thread (three warpgroups); the producer drops to 56, the compute warpgroups
// rise to 224 (setmaxnreg).
// Shared memory (K = V = 128): q, k, w slabs 2 x 16 KB each, Sb 2 x 16 KB, Vn and Vd 2 x 8 KB
// each, Att 8 KB, u 2 x 16 KB, rows 2 x 768 B, + 1 KB alignment: 203 KB, 1 CTA of 8 warps per SM.
#pragma once

#include <type_traits>

#include "state_walk_wg.cuh"

namespace jax_cake_gdn {

template <typename In, int K, int V>
struct WalkOutWgSmem {
  static constexpr int kWarpgroups = V / 64;
  static constexpr size_t kSlab = size_t{kChunk} * 128;  // 64 rows x 64 bf16
  static constexpr size_t kTok = K / 64 * kSlab;           // [64 tokens][K] as slabs
  static constexpr size_t kRows = 3 * kChunk * sizeof(float);  // G, rstd, rstd_q of a chunk
  static constexpr size_t oQ = 0;                                         // 2 buffers
  static constexpr size_t oK = oQ + 2 * kTok;                             // 2 buffers
  static constexpr size_t oWs = oK + 2 * kTok;                            // 2 buffers
  static constexpr size_t oSb = oWs + 2 * kTok;                           // per warpgroup
  static constexpr size_t oVn = oSb + kWarpgroups * size_t{K} * 128;      // per warpgroup
  static constexpr size_t oVd = oVn + kWarpgroups * kSlab;                // per warpgroup
  static constexpr size_t oAtt = oVd + kWarpgroups * kSlab;               // [i][j]
  static constexpr size_t oUs = oAtt + kSlab;  // u: 2 buffers of V / 64 slabs [token][v]
  static constexpr size_t oRows = oUs + 2 * kWarpgroups * kSlab;          // 2 buffers
  static constexpr size_t bytes = oRows + 2 * kRows + 1024;  // + alignment
  static_assert(bytes <= 227 * 1024, "walk_output_wg: shared memory over the sm_90 limit");
};

template <int V>
constexpr int walk_output_wg_threads() {
  return 2 * V + 128;  // V / 64 compute warpgroups of 128, then the producer warpgroup
}

template <typename In, typename Out, int K, int V>
__global__ void __launch_bounds__(walk_output_wg_threads<V>(), 1)
    walk_output_wg_kernel(const In* __restrict__ qin, const In* __restrict__ k,
                          const bf16* __restrict__ w, const bf16* __restrict__ u,
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
  constexpr int kCompute = 2 * V;  // compute threads; the producer warpgroup follows them
  constexpr int kLoaders = 128;
  // V = 128: three warpgroups launch at 168 registers a thread (64512 in all); the producer
  // gives back to 56, the compute warpgroups take 224 (2 x 224 + 56 = 504 per thread triple).
  // V = 64: two warpgroups, no reallocation.
  constexpr bool kRealloc = Sm::kWarpgroups == 2;
  constexpr int kComputeRegs = 224, kProducerRegs = 56;
  static_assert(walk_output_wg_threads<V>() == kCompute + kLoaders, "one producer warpgroup");
  constexpr int kAttCols = 64 / Sm::kWarpgroups;  // Att columns per warpgroup
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = align_1024(smem_raw);
  unsigned char* AttS = smem + Sm::oAtt;

  const int hv = blockIdx.x % HV, s = blockIdx.x / HV;  // segments x heads (table order)
  const int hk = hv / (HV / H);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  const int wg = warp >> 2, wq = warp & 3;  // warpgroup, warp in it
  const bool producer = threadIdx.x >= kCompute;
  unsigned char* Sb = smem + Sm::oSb + wg * size_t{K} * 128;
  unsigned char* Vn = smem + Sm::oVn + wg * Sm::kSlab;
  unsigned char* Vd = smem + Sm::oVd + wg * Sm::kSlab;
  const int64_t state_stride = int64_t{K} * V;

  float S[K / 64][32];
  const int64_t state0 = (static_cast<int64_t>(s) * HV + hv) * state_stride + 64 * wg;
  float* fin = final_state + state0;
  const int c_first = seg_first[s], c_last = seg_last[s];
  const bool empty = seg_len[s] <= 0 || c_first < 0 || c_last >= NC || c_last < c_first;

  auto q_slabs = [&](int b) { return smem + Sm::oQ + b * Sm::kTok; };
  auto k_slabs = [&](int b) { return smem + Sm::oK + b * Sm::kTok; };
  auto w_slabs = [&](int b) { return smem + Sm::oWs + b * Sm::kTok; };
  auto u_slabs = [&](int b) { return smem + Sm::oUs + b * Sm::kWarpgroups * Sm::kSlab; };
  auto rows = [&](int b) { return reinterpret_cast<float*>(smem + Sm::oRows + b * Sm::kRows); };
  // the producer warpgroup's copies (kLoaders threads)
  auto prefetch_qk = [&](int c, int b) {  // q, k into their slabs; G, rstd, rstd_q into rows
    const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
    const int64_t off = (cs.start * H + hk) * K;
    if constexpr (std::is_same_v<In, bf16>) {
      cp_async_tile_at<kChunk, K, kLoaders, false>(slab_at<kChunk>(q_slabs(b)), qin + off,
                                                   int64_t{H} * K, cs.len);
      cp_async_tile_at<kChunk, K, kLoaders, false>(slab_at<kChunk>(k_slabs(b)), k + off,
                                                   int64_t{H} * K, cs.len);
    } else {  // f32: rounded to bf16 on the way (plain loads)
      load_tile_bf16_at<kChunk, K, 4, kLoaders>(slab_at<kChunk>(q_slabs(b)), qin + off,
                                                int64_t{H} * K, max(cs.len, 1), ScaleOne{});
      load_tile_bf16_at<kChunk, K, 4, kLoaders>(slab_at<kChunk>(k_slabs(b)), k + off,
                                                int64_t{H} * K, max(cs.len, 1), ScaleOne{});
    }
    float* r = rows(b);
    const RowVector vecs[3] = {
        {r, G, HV, hv}, {r + kChunk, rstd, H, hk}, {r + 2 * kChunk, rstd_q, H, hk}};
    cp_async_row_vectors<kLoaders>(vecs, cs.start, cs.len);
  };
  auto prefetch_wu = [&](int c, int b) {  // w and u straight into their slabs
    const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
    cp_async_tile_at<kChunk, K, kLoaders, false>(
        slab_at<kChunk>(w_slabs(b)), w + (cs.start * HV + hv) * K, int64_t{HV} * K, cs.len);
    cp_async_tile_at<kChunk, V, kLoaders, false>(
        slab_at<kChunk>(u_slabs(b)), u + (cs.start * HV + hv) * V, int64_t{HV} * V, cs.len);
  };

  // The two roles never merge again after this branch (ptxas applies each register limit to its
  // own path only).
  if (producer) {  // chunk c + 1 into buffer b ^ 1 while the compute warps work on chunk c
    if constexpr (kRealloc) warpgroup_reg_dealloc<kProducerRegs>();
    if (empty) return;
    auto copy_chunk = [&](int c, int b) {
      prefetch_qk(c, b);
      prefetch_wu(c, b);
      cp_async_commit();
      cp_async_wait_all();
      fence_proxy_async();  // for the compute warps' wgmma (async proxy) reads
    };
    copy_chunk(c_first, 0);
    for (int c = c_first, b = 0; c <= c_last; ++c, b ^= 1) {
      __syncthreads();  // chunk c's inputs are in; the compute warps are done with chunk c - 1
      if (c < c_last) copy_chunk(c + 1, b ^ 1);
    }
    return;  // barrier 0 is not used after the last chunk opens
  }
  if constexpr (kRealloc) warpgroup_reg_alloc<kComputeRegs>();
  wg_state_rw<K>(S, const_cast<float*>(h0) + state0, V, false, wq);
  if (empty) {
    wg_state_rw<K>(S, fin, V, true, wq);
    return;
  }

  const int i0 = 16 * wq + g, i1 = i0 + 8;  // this thread's accumulator rows
  for (int c = c_first, b = 0; c <= c_last; ++c, b ^= 1) {
    const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
    const int len = cs.len, last = max(len - 1, 0);
    __syncthreads();  // chunk c's slabs, rows, w and u have landed; chunk c - 1 is done

    const unsigned char* Qs = q_slabs(b);
    const unsigned char* Ks = k_slabs(b);
    const unsigned char* Ws = w_slabs(b);
    const unsigned char* Us = u_slabs(b);
    const float* rG = rows(b);
    const float* rR = rstd != nullptr ? rG + kChunk : nullptr;
    const float* rQ = rstd_q != nullptr ? rG + 2 * kChunk : nullptr;
    const float GC = rG[last];
    float acc[32];
    wg_load_slab64(acc, Us + wg * Sm::kSlab, wq);
    wg_write_sb<K>(S, Sb, wq);
    fence_proxy_async();
    warpgroup_sync(wg);  // Sb complete

    // product 1 (the chain) first, then Q S and this warpgroup's columns of Q K^T
    float att[kAttCols / 2], oacc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) oacc[i] = 0.f;
#pragma unroll
    for (int i = 0; i < kAttCols / 2; ++i) att[i] = 0.f;
    wgmma_fence_operand(att);
    wgmma_fence_operand(oacc);
    wgmma_fence_operand(acc);
    wgmma_fence();
    wg_issue_product1<K>(acc, Ws, Sb);
    wgmma_commit();
#pragma unroll
    for (int ks = 0; ks < K / 16; ++ks) {
      const uint32_t kk = (ks / 4) * Sm::kSlab + 32 * (ks % 4);
      wgmma_m64k16_ss<64, false, true, 1>(oacc, sw128_desc(Qs + kk),
                                          sw128_desc(Sb + 2048 * ks, K * 128), true);
    }
#pragma unroll
    for (int ks = 0; ks < K / 16; ++ks) {  // B: k rows kAttCols wg.. (K-major, 128 B a row)
      const uint32_t kk = (ks / 4) * Sm::kSlab + 32 * (ks % 4);
      wgmma_m64k16_ss<kAttCols, false, false, 1>(
          att, sw128_desc(Qs + kk), sw128_desc(Ks + kk + 128 * kAttCols * wg), true);
    }
    wgmma_commit();
    wgmma_wait<1>();
    wgmma_fence_operand(acc);
    // Vn = bf16(v_new), Vd = bf16(d v_new) (walk_decay)
    const float d0 = walk_decay(i0, len, GC, rG, rR), d1 = walk_decay(i1, len, GC, rG, rR);
    wg_store_slab<64>(acc, Vn, wq);
    wg_store_slab<64>(acc, Vd, wq, 0, d0, d1);
    wgmma_wait<0>();
    wgmma_fence_operand(att);
    wgmma_fence_operand(oacc);
    wg_gate_scores<kAttCols>(att, rG, wq, kAttCols * wg, last, rR);
    wg_store_slab<kAttCols>(att, AttS, wq, kAttCols * wg);
    fence_proxy_async();
    compute_sync<kCompute>();  // Att, Vn, Vd complete

    // o = e^G (Q S) + Att Vn;  S = e^{G_C} S + K^T Vd
    const float eg0 = __expf(rG[min(i0, last)]), eg1 = __expf(rG[min(i1, last)]);
    wg_scale_rows(oacc, eg0, eg1);
    wg_scale_state<K>(S, __expf(GC));
    wgmma_fence_operand(oacc);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kChunk / 16; ++ks)
      wgmma_m64k16_ss<64, false, true, 1>(oacc, sw128_desc(AttS + 32 * ks),
                                          sw128_desc(Vn + 2048 * ks, Sm::kSlab), true);
    wg_issue_state_update<K>(S, Ks, Vd);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(oacc);
#pragma unroll
    for (int kb = 0; kb < K / 64; ++kb) wgmma_fence_operand(S[kb]);

#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int t = half ? i1 : i0;
      if (t < len) {
        const float so = scale * (rQ != nullptr ? rQ[t] : 1.f);
        Out* op = o + ((cs.start + t) * HV + hv) * V + 64 * wg + 2 * q;
#pragma unroll
        for (int j = 0; j < 8; ++j)
          store2(op + 8 * j, so * oacc[4 * j + 2 * half], so * oacc[4 * j + 2 * half + 1]);
      }
    }
  }

  wg_state_rw<K>(S, fin, V, true, wq);
}

}  // namespace jax_cake_gdn
