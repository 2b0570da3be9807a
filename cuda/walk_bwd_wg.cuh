// The backward state walk (primitives/xla.py: walk_bwd) on Hopper warpgroup MMA. Per segment and
// value head (and VT-wide column tile), in REVERSE chunk order, with dS (K x VT, f32):
//
//   dS_end[c] = dS;   dv_local = scale Att^T dO;   dvn = dv_local + diag(e^{G_C - G}) K dS
//   dS <- e^{G_C} dS + (Q scale e^G)^T dO - w^T dvn;   dh0 = dS after the segment's first chunk
//
// One CTA of VT / 64 warpgroups per (segment, head, VT columns): warpgroup wg owns columns
// 64 wg.. of the tile (its dS in K / 64 wgmma accumulators, its slabs Sb = bf16(dS), dOs, dOg,
// Dvn); Q, K, w and Att slabs are shared. Per chunk:
//   top: w(c) by cp.async straight into its slab; staged q, k, dO (and the saved scores) ->
//        Qs = q rstd_q, Ks = k rstd_k, dOs = scale dO, dOg = scale e^G dO, Att; Sb = bf16(dS)
//        (and dS_end[c] from it)
//   Att (kScores = false): Qs Ks^T, warpgroup wg its 64 / (VT / 64) columns (m64n32 at VT =
//        128), gated (wg_gate_scores, wg_acc.cuh) into the Att slab; with saved scores (the
//        output kernel's) copied instead
//   acc = Ks Sb;  dvl = Att^T dOs (A MN-major);  -dvn = -(e^{G_C - G} acc + dvl) -> Dvn slab
//   dS = e^{G_C} dS + Qs^T dOg + Ws^T Dvn     (A MN-major from the [token][key] slabs; the
//        Qs^T dOg half is issued with acc and runs while acc, Att, dvl and Dvn are made; with
//        saved scores dvl is issued in that batch too)
// Every operand and every accumulator's k16 steps are the former mma.sync kernel's, in the same
// order from the same start, so dS_end and dh0 are expected bit for bit equal to it. Unused
// chunks (after every segment's chunks) get dS_end = 0, as the xla reverse scan gives. dS_end is
// bf16 (the f32 gradient rounded to nearest: chunk_bwd uses it only as a bf16 operand).
#pragma once

#include "wg_acc.cuh"

namespace jax_cake_gdn {

template <typename In, int K, int VT>
struct WalkBwdWgSmem {
  static constexpr int kWarpgroups = VT / 64;
  static constexpr size_t kSlab = size_t{kChunk} * 128;  // 64 rows x 64 bf16
  static constexpr size_t kTok = K / 64 * kSlab;           // [64 tokens][K] as slabs
  static constexpr size_t oWs = 0;
  static constexpr size_t oQs = oWs + kTok;
  static constexpr size_t oKs = oQs + kTok;
  static constexpr size_t oAtt = oKs + kTok;                       // [i][j]
  static constexpr size_t oSb = oAtt + kSlab;                      // per warpgroup, K rows
  static constexpr size_t oDOs = oSb + kWarpgroups * size_t{K} * 128;  // per warpgroup
  static constexpr size_t oDOg = oDOs + kWarpgroups * kSlab;
  static constexpr size_t oDvn = oDOg + kWarpgroups * kSlab;
  static constexpr size_t oStQ = oDvn + kWarpgroups * kSlab;       // In [64][K]
  static constexpr size_t oStK = oStQ + size_t{kChunk} * K * sizeof(In);
  static constexpr size_t oStO = oStK + size_t{kChunk} * K * sizeof(In);  // In [64][VT]
  static constexpr size_t oRows = oStO + size_t{kChunk} * VT * sizeof(In);  // G, rq, rk, sG
  static constexpr size_t oStA = oRows + 4 * kChunk * sizeof(float);  // saved scores bf16
  static constexpr size_t bytes_no_scores = oStA + 1024;               // + alignment
  static constexpr size_t bytes_scores = oStA + size_t{kChunk} * kChunk * 2 + 1024;
  static constexpr bool fits = bytes_scores <= 227 * 1024;
};

// Columns per CTA: all of V where that fits (every shape but f32 inputs at K = V = 128: 64).
template <typename In, int K, int V>
constexpr int walk_bwd_wg_vt() {
  return WalkBwdWgSmem<In, K, V>::fits ? V : 64;
}

template <typename In, int K, int VT, bool kScores>
__global__ void __launch_bounds__(2 * VT, 1)
    walk_bwd_wg_kernel(const In* __restrict__ q, const In* __restrict__ k,
                       const bf16* __restrict__ w, const float* __restrict__ G,
                       const In* __restrict__ dout, const float* __restrict__ dfinal,
                       const bf16* __restrict__ scores,   // kScores only
                       const float* __restrict__ rstd_q,  // nullable
                       const float* __restrict__ rstd_k,  // nullable
                       const int32_t* __restrict__ cstart, const int32_t* __restrict__ clen,
                       const int32_t* __restrict__ seg_first,
                       const int32_t* __restrict__ seg_last,
                       const int32_t* __restrict__ seg_len, bf16* __restrict__ dS_end,
                       float* __restrict__ dh0, int64_t num_tokens, int H, int HV, int V, int NC,
                       float scale) {
  static_assert(K == 64 || K == 128, "K = 64 or 128");
  static_assert(VT == 64 || VT == 128, "one or two warpgroups");
  using Sm = WalkBwdWgSmem<In, K, VT>;
  static_assert(Sm::fits, "walk_bwd_wg: shared memory over the sm_90 limit");
  constexpr int kThreads = 2 * VT;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = align_1024(smem_raw);
  unsigned char* Ws = smem + Sm::oWs;
  unsigned char* Qs = smem + Sm::oQs;
  unsigned char* Ks = smem + Sm::oKs;
  unsigned char* AttS = smem + Sm::oAtt;
  In* stQ = reinterpret_cast<In*>(smem + Sm::oStQ);
  In* stK = reinterpret_cast<In*>(smem + Sm::oStK);
  In* stO = reinterpret_cast<In*>(smem + Sm::oStO);
  float* stG = reinterpret_cast<float*>(smem + Sm::oRows);
  float* stRq = stG + kChunk;
  float* stRk = stRq + kChunk;
  float* sG = stRk + kChunk;  // G of the chunk, padding rows G_C
  bf16* stA = reinterpret_cast<bf16*>(smem + Sm::oStA);  // kScores only

  const int ntiles = V / VT;
  const int tile = blockIdx.x % ntiles, rest = blockIdx.x / ntiles;
  const int hv = rest % HV, s = rest / HV, v0 = tile * VT;
  const int hk = hv / (HV / H);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, qd = lane & 3;
  const int wg = warp >> 2, wq = warp & 3;  // warpgroup, warp in it
  unsigned char* Sb = smem + Sm::oSb + wg * size_t{K} * 128;
  unsigned char* DOs = smem + Sm::oDOs + wg * Sm::kSlab;
  unsigned char* DOg = smem + Sm::oDOg + wg * Sm::kSlab;
  unsigned char* Dvn = smem + Sm::oDvn + wg * Sm::kSlab;
  const int64_t state_stride = int64_t{K} * V;
  const int64_t state0 = (static_cast<int64_t>(s) * HV + hv) * state_stride + v0 + 64 * wg;

  float S[K / 64][32];
  wg_state_rw<K>(S, const_cast<float*>(dfinal) + state0, V, false, wq);

  const int c_first = seg_first[s], c_last = seg_last[s];
  const bool empty = seg_len[s] <= 0 || c_first < 0 || c_last >= NC || c_last < c_first;
  if (empty) {
    wg_state_rw<K>(S, dh0 + state0, V, true, wq);
    // No used chunk at all (no tokens): every dS_end is zero, written by segment 0.
    if (s == 0 && NC > 0 && clen[0] <= 0) {
      for (int c = 0; c < NC; ++c)
        for (int i = tid; i < K * VT; i += kThreads)
          dS_end[(static_cast<int64_t>(c) * HV + hv) * state_stride + (i / VT) * V + v0 +
                 i % VT] = __float2bfloat16_rn(0.f);
    }
    return;
  }

  auto prefetch_w = [&](int c) {  // straight into its slabs (after the last reader, Ws^T Dvn)
    const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
    cp_async_tile_at<kChunk, K, kThreads, false>(
        slab_at<kChunk>(Ws), w + (cs.start * HV + hv) * K, int64_t{HV} * K, cs.len);
  };
  auto prefetch_rows = [&](int c) {  // q, k, dO columns v0.., G, rstd (and scores) to staging
    const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
    cp_async_tile<kChunk, K, kThreads, false>(stQ, K, q + (cs.start * H + hk) * K,
                                              int64_t{H} * K, cs.len);
    cp_async_tile<kChunk, K, kThreads, false>(stK, K, k + (cs.start * H + hk) * K,
                                              int64_t{H} * K, cs.len);
    cp_async_tile<kChunk, VT, kThreads, false>(stO, VT, dout + (cs.start * HV + hv) * V + v0,
                                               int64_t{HV} * V, cs.len);
    if constexpr (kScores) {
      const bf16* sp = scores + (static_cast<int64_t>(c) * HV + hv) * (kChunk * kChunk);
#pragma unroll 4
      for (int idx = tid; idx < kChunk * kChunk / 8; idx += kThreads)
        cp_async16(stA + 8 * idx, sp + 8 * idx, true);
    }
    const RowVector rows[3] = {{stG, G, HV, hv}, {stRq, rstd_q, H, hk}, {stRk, rstd_k, H, hk}};
    cp_async_row_vectors<kThreads>(rows, cs.start, cs.len);
  };

  // Commit groups per chunk c: w(c) at the top (waited for before the last product); the rows of
  // c - 1 once the staging is converted. The top waits for everything.
  prefetch_rows(c_last);
  cp_async_commit();
  for (int c = c_last; c >= c_first; --c) {
    const int len = chunk_span(cstart, clen, c, num_tokens).len;
    cp_async_wait_all();
    __syncthreads();  // chunk c's staging has landed; every warp is done with chunk c + 1
    prefetch_w(c);
    cp_async_commit();

    const float GC = len > 0 ? stG[len - 1] : 0.f;
    const float eGC = __expf(GC);
    // staging -> slabs (q, k x rstd; dO x scale, and x scale e^G)
    {
      using PK = TilePieces<kChunk, K, kThreads>;
      const int tk = PK::row0(), ck = PK::col();
#pragma unroll 2
      for (int j = 0; j < PK::kPer; ++j) {
        const int t = tk + j * PK::kRowStep;
        const uint32_t off = slab_offset<kChunk>(t, ck);
        float f[8];
        lds8(stQ + t * K + ck, f);
        sts8_bf16(reinterpret_cast<bf16*>(Qs + off), f, rstd_q != nullptr ? stRq[t] : 1.f);
        lds8(stK + t * K + ck, f);
        sts8_bf16(reinterpret_cast<bf16*>(Ks + off), f, rstd_k != nullptr ? stRk[t] : 1.f);
      }
      using PO = TilePieces<kChunk, VT, kThreads>;
      const int to = PO::row0(), co = PO::col();
#pragma unroll 2
      for (int j = 0; j < PO::kPer; ++j) {
        const int t = to + j * PO::kRowStep;
        // column co of the tile: warpgroup co / 64's slabs
        const uint32_t off = (co / 64) * Sm::kSlab + sw128_offset(t, co % 64);
        float f[8];
        lds8(stO + t * VT + co, f);  // rows >= len are zero
        sts8_bf16(reinterpret_cast<bf16*>(smem + Sm::oDOs + off), f, scale);
        sts8_bf16(reinterpret_cast<bf16*>(smem + Sm::oDOg + off), f, scale * __expf(stG[t]));
      }
      if constexpr (kScores) {
        using PA = TilePieces<kChunk, kChunk, kThreads>;
        const int ta = PA::row0(), ca = PA::col();
#pragma unroll 2
        for (int j = 0; j < PA::kPer; ++j) {
          const int t = ta + j * PA::kRowStep;
          *reinterpret_cast<uint4*>(AttS + sw128_offset(t, ca)) =
              *reinterpret_cast<const uint4*>(stA + t * kChunk + ca);
        }
      }
      if (tid < kChunk) sG[tid] = tid < len ? stG[tid] : GC;  // padding rows: G = GC (as xla)
    }
    wg_write_sb<K>(S, Sb, wq);
    fence_proxy_async();
    __syncthreads();  // slabs ready; the staging is free
    if (c > c_first) prefetch_rows(c - 1);
    cp_async_commit();
    // dS_end[c] = the carried gradient (bf16)
    wg_copy_sb<K>(Sb, dS_end + (static_cast<int64_t>(c) * HV + hv) * state_stride + v0 + 64 * wg,
                  V, tid & 127);

    // acc = Ks Sb (and this warpgroup's columns of Att = Qs Ks^T when recomputed)
    float acc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = 0.f;
    wgmma_fence_operand(acc);
    constexpr int kAttCols = 64 / Sm::kWarpgroups;  // Att columns per warpgroup
    [[maybe_unused]] float att[kAttCols / 2];
    if constexpr (!kScores) {
#pragma unroll
      for (int i = 0; i < kAttCols / 2; ++i) att[i] = 0.f;
      wgmma_fence_operand(att);
    }
    float dvl[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) dvl[i] = 0.f;
    wgmma_fence_operand(dvl);
    wg_scale_state<K>(S, eGC);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < K / 16; ++ks) {
      const uint32_t kk = (ks / 4) * Sm::kSlab + 32 * (ks % 4);
      if constexpr (!kScores)  // B: k rows kAttCols wg.. (K-major, 128 B a row)
        wgmma_m64k16_ss<kAttCols, false, false, 1>(
            att, sw128_desc(Qs + kk), sw128_desc(Ks + kk + 128 * kAttCols * wg), true);
      wgmma_m64k16_ss<64, false, true, 1>(acc, sw128_desc(Ks + kk),
                                          sw128_desc(Sb + 2048 * ks, K * 128), true);
    }
    wgmma_commit();
    // The state update's first half, dS = e^{G_C} dS + Qs^T dOg, needs nothing computed in this
    // chunk: it runs while acc, Att and dvl are made (Sb already holds bf16(dS); dS was scaled
    // before the batch); Ws^T Dvn goes after. Each accumulator sees dOg's k-steps, then Dvn's,
    // as before.
    wg_issue_state_update<K>(S, Qs, DOg);
    wgmma_commit();
    // dvl = Att^T dOs (A: Att stored [i][j], MN-major); with saved scores Att is already here
    auto issue_dvl = [&] {
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kChunk / 16; ++ks)
        wgmma_m64k16_ss<64, true, true, 1>(dvl, sw128_desc(AttS + 2048 * ks, Sm::kSlab),
                                           sw128_desc(DOs + 2048 * ks, Sm::kSlab), true);
      wgmma_commit();
    };
    if constexpr (kScores) {
      issue_dvl();
      wgmma_wait<2>();  // acc (and att) done; dS's first half and dvl may still run
    } else {
      wgmma_wait<1>();
    }
    wgmma_fence_operand(acc);
    if constexpr (!kScores) {
      wgmma_fence_operand(att);
      // the mask and Gam, this warpgroup's columns, into the Att slab
      wg_gate_scores<kAttCols>(att, sG, wq, kAttCols * wg);
      wg_store_slab<kAttCols>(att, AttS, wq, kAttCols * wg);
      fence_proxy_async();
      __syncthreads();  // Att complete
      issue_dvl();
    }
    wgmma_wait<0>();
    wgmma_fence_operand(dvl);
    // -dvn = -(e^{G_C - G} acc + dvl) as bf16 into Dvn (rows: tokens)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int t = 16 * wq + g + 8 * half;
      const float dec = __expf(GC - sG[t]);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float x0 = dec * acc[4 * j + 2 * half] + dvl[4 * j + 2 * half];
        const float x1 = dec * acc[4 * j + 2 * half + 1] + dvl[4 * j + 2 * half + 1];
        *reinterpret_cast<uint32_t*>(Dvn + sw128_offset(t, 8 * j + 2 * qd)) = pack_bf16(-x0, -x1);
      }
    }
    cp_async_wait<1>();  // w(c) has landed (the rows of c - 1 may still fly)
    fence_proxy_async();
    __syncthreads();  // Dvn, Ws complete

    // dS += Ws^T Dvn (the second half of the state update)
#pragma unroll
    for (int kb = 0; kb < K / 64; ++kb) wgmma_fence_operand(S[kb]);
    wgmma_fence();
    wg_issue_state_update<K>(S, Ws, Dvn);
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int b = 0; b < K / 64; ++b) wgmma_fence_operand(S[b]);
  }

  wg_state_rw<K>(S, dh0 + state0, V, true, wq);
  // The last used chunk's segment also zeroes the unused chunks' dS_end.
  if (c_last + 1 < NC && clen[c_last + 1] <= 0) {
    for (int c = c_last + 1; c < NC; ++c)
      for (int i = tid; i < K * VT; i += kThreads)
        dS_end[(static_cast<int64_t>(c) * HV + hv) * state_stride + (i / VT) * V + v0 + i % VT] =
            __float2bfloat16_rn(0.f);
  }
}

}  // namespace jax_cake_gdn
