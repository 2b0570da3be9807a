// The backward state walk (primitives/xla.py: walk_bwd) on Hopper warpgroup MMA. Per segment and
// value head (and VT-wide column tile), in REVERSE chunk order, with dS (K x VT, f32):
//
//   dS_end[c] = dS;   dv_local = scale Att^T dO;   dvn = dv_local + diag(e^{G_C - G} rk) K dS
//   dS <- e^{G_C} dS + Q^T diag(scale e^G rq) dO - w^T dvn;   dh0 = dS after the segment's first
//   chunk   (Att = diag(rq) tril_incl(Gam o Q K^T) diag(rk); rq, rk: rstd of q, k or 1)
//   dvn[c] (bf16, rows: the chunk's tokens, padding rows 0) is written for chunk_bwd.
//
// One CTA of VT / 64 compute warpgroups per (segment, head, VT columns; segments in seg_order,
// longest first), then a producer warpgroup: compute warpgroup wg owns columns 64 wg.. of the
// tile (its dS in K / 64 wgmma accumulators, its slabs Sb = bf16(dS), dOs, dOg, Dvn); Q, K, w
// and Att slabs are shared.
// The producer fills chunk c - 1's inputs into the other of two buffers while the compute warps
// work on chunk c: G, rstd_q, rstd_k by cp.async into its own rows; bf16 dO, then q, k, w by
// TMA as they are into their slabs (one thread issues the boxes; dO on one mbarrier a buffer, q,
// k, w on another, waited for after dOg is made; rows past the chunk's end zeroed after they
// land; f32: w by cp.async, q, k, dO by plain loads, 8 in flight a thread, rounded to bf16 on
// the way); then dOg = scale e^G rq dO (each thread its own pieces of the landed dO) and the
// compute warps' rows of the buffer (G, padding rows G_C; rk; rq). q, k and dO enter the other
// products as they are and their per-token factors go on accumulators (walk_output's way), so
// the producer converts one 64 x VT tile a chunk. It waits for its copies, fences them
// (fence.proxy.async) and arrives at the barrier that opens the chunk; the compute warps issue
// no copies. Per chunk, the compute warps:
//   top: Sb = bf16(dS) (and dS_end[c] from it, a TMA store)
//   Att: Qs Ks^T, warpgroup wg its 64 / (VT / 64) columns (m64n32 at VT = 128), gated with rk
//        (wg_gate_scores' operations, wg_acc.cuh: the factors made before the product's wait,
//        wg_gate_factors, applied after it, wg_gate_apply) into the Att slab times rq
//   acc = Ks Sb;  dvl = Att^T dOs (A MN-major);
//   dvn = e^{G_C - G} rk acc + scale dvl -> Dvn slab -> dvn[c] (a TMA store)
//   dS = e^{G_C} dS + Qs^T dOg - Ws^T Dvn     (A MN-major from the [token][key] slabs; the
//        Qs^T dOg half is issued with acc and runs while acc, Att, dvl and Dvn are made)
// Barriers: 0 opens a chunk (all threads); 3 (compute warps) completes Att; 1 + wg (one
// warpgroup) completes its Sb and Dvn; 4 (producer) its rows.
// Shared memory (K = V = 128): per buffer Ws, Qs, Ks 16 KB each, dOs and dOg 2 x 8 KB each;
// Att 8 KB, Sb 2 x 16 KB, Dvn 2 x 8 KB; rows 2.25 KB; 4 mbarriers; + 1 KB alignment: 219.28 KB,
// 1 CTA per SM.
// No staging: the size no longer depends on In.
// Registers at VT = 128: the CTA (384 threads) launches at 168 a thread; the producer drops to
// 56, the compute warpgroups rise to 224 (setmaxnreg; 2 x 224 + 56 = 504). VT = 64: 256 threads,
// no reallocation.
// Unused chunks (after every segment's chunks) get dS_end = 0 and dvn = 0, as the xla reverse
// scan gives.
// dS_end is bf16 (the f32 gradient rounded to nearest: chunk_bwd uses it only as a bf16 operand).
// With a hand-off buffer (handoff.cuh; walk_chunk_bwd) the walk also publishes each (chunk, head)
// once its dS_end and dvn stores are complete: the compute warpgroups' storing threads wait for
// chunk c + 1's stores at the end of chunk c, the producer publishes chunk c + 2 after the
// barrier that opens chunk c (off the compute chain), thread 0 the last two after the loop.
// kTwin (transfer_bwd, the backward twin of the units' summaries): the CTAs are (unit, head,
// tile) slots, seg_order maps a slot to its segment (-1: none, dh0 zeros), dh0 is per slot, and
// neither dS_end nor dvn is stored (Dvn stays a slab for the update).
#pragma once

#include "handoff.cuh"
#include "tma.cuh"
#include "wg_acc.cuh"

namespace jax_cake_gdn {

template <int K, int VT>
struct WalkBwdWgSmem {
  static constexpr int kWarpgroups = VT / 64;
  static constexpr size_t kSlab = size_t{kChunk} * 128;  // 64 rows x 64 bf16
  static constexpr size_t kTok = K / 64 * kSlab;           // [64 tokens][K] as slabs
  // One chunk's inputs (two buffers): Ws, Qs, Ks, then per warpgroup dOs and dOg
  static constexpr size_t bWs = 0;
  static constexpr size_t bQs = bWs + kTok;
  static constexpr size_t bKs = bQs + kTok;
  static constexpr size_t bDOs = bKs + kTok;
  static constexpr size_t bDOg = bDOs + kWarpgroups * kSlab;
  static constexpr size_t kBuf = bDOg + kWarpgroups * kSlab;
  static constexpr size_t oAtt = 2 * kBuf;                              // [i][j]
  static constexpr size_t oSb = oAtt + kSlab;                           // per warpgroup, K rows
  static constexpr size_t oDvn = oSb + kWarpgroups * size_t{K} * 128;   // per warpgroup
  // the compute warps' rows, 2 buffers: G of the chunk (padded G_C), rstd_k and rstd_q
  static constexpr int kRows = 3;
  static constexpr size_t oSG = oDvn + kWarpgroups * kSlab;
  static constexpr size_t oStG = oSG + 2 * kRows * kChunk * sizeof(float);  // producer: G, rq, rk
  // bf16: mbarriers, dO's one a buffer, then q, k and w's one a buffer
  static constexpr size_t oBar = oStG + 3 * kChunk * sizeof(float);
  static constexpr size_t bytes = oBar + 4 * sizeof(uint64_t) + 1024;  // + alignment
  static_assert(bytes <= 227 * 1024, "walk_bwd_wg: shared memory over the sm_90 limit");
};

// Columns per CTA: all of V, but 64 for f32 inputs at K = V = 128 (the split from before the
// producer warpgroup, when f32 staging did not fit; VT = V would fit now, not measured).
template <typename In, int K, int V>
constexpr int walk_bwd_wg_vt() {
  return std::is_same_v<In, float> && K == 128 && V == 128 ? 64 : V;
}

template <int VT>
constexpr int walk_bwd_wg_threads() {
  return 2 * VT + 128;  // VT / 64 compute warpgroups of 128, then the producer warpgroup
}

// The producer's pieces of a 64 x D chunk tile of In (TilePieces over its 128 threads); put(t, c,
// f, r) stores piece (t, columns c..c+7) from its values f[8] and r = row(t). bf16: the tile has
// landed raw in the slabs at `landed` (by TMA, rows >= len zeroed, before a producer barrier).
// f32: it is loaded here, NB 16-byte loads in flight per batch, kept raw until stored (fewer
// live registers), rows >= len zero.
template <int D, int NB, typename In, typename Row, typename Put>
__device__ __forceinline__ void walk_bwd_convert(unsigned char* landed, const In* src,
                                                 int64_t row_stride, int len, Row row, Put put) {
  using P = TilePieces<kChunk, D, 128>;
  const int t0 = P::row0(), c = P::col();
  if constexpr (sizeof(In) == 2) {
#pragma unroll 4
    for (int j = 0; j < P::kPer; ++j) {
      const int t = t0 + j * P::kRowStep;
      float f[8];
      lds8(slab_at<kChunk>(landed)(t, c), f);
      put(t, c, f, row(t));
    }
  } else {
    constexpr int kNB = NB / 2 < P::kPer ? NB / 2 : P::kPer;  // pieces (2 loads each) per batch
    static_assert(kNB >= 1 && P::kPer % kNB == 0, "tile does not split evenly");
#pragma unroll 1
    for (int b0 = 0; b0 < P::kPer; b0 += kNB) {
      float4 r[kNB][2];
      float rv[kNB];
#pragma unroll
      for (int j = 0; j < kNB; ++j) {
        const int t = t0 + (b0 + j) * P::kRowStep;
        rv[j] = row(t);
        const float4* p = reinterpret_cast<const float4*>(src + t * row_stride + c);
#pragma unroll
        for (int e = 0; e < 2; ++e)
          r[j][e] = t < len ? __ldg(p + e) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int j = 0; j < kNB; ++j) {
        const float f[8] = {r[j][0].x, r[j][0].y, r[j][0].z, r[j][0].w,
                            r[j][1].x, r[j][1].y, r[j][1].z, r[j][1].w};
        put(t0 + (b0 + j) * P::kRowStep, c, f, rv[j]);
      }
    }
  }
}

// The producer's TMA loads (bf16 inputs): q, k [T, H, K], w [T, HV, K] and dO [T, HV, V], boxes
// of 64 tokens x 64 columns of one head (make_tma_token_rows). Unused (zeros) for f32 inputs.
struct WalkBwdLoadMaps {
  CUtensorMap q, k, w, dout;
};

template <typename In, int K, int VT, bool kTwin>
__global__ void __launch_bounds__(walk_bwd_wg_threads<VT>(), 1)
    walk_bwd_wg_kernel(const In* __restrict__ q, const In* __restrict__ k,
                       const bf16* __restrict__ w, const float* __restrict__ G,
                       const In* __restrict__ dout, const float* __restrict__ dfinal,
                       const float* __restrict__ rstd_q,  // nullable
                       const float* __restrict__ rstd_k,  // nullable
                       const int32_t* __restrict__ cstart, const int32_t* __restrict__ clen,
                       const int32_t* __restrict__ seg_first,
                       const int32_t* __restrict__ seg_last,
                       const int32_t* __restrict__ seg_len,
                       const int32_t* __restrict__ seg_order, bf16* __restrict__ dS_end,
                       const __grid_constant__ CUtensorMap dS_end_map,
                       bf16* __restrict__ dvn, const __grid_constant__ CUtensorMap dvn_map,
                       float* __restrict__ dh0, const __grid_constant__ WalkBwdLoadMaps lm,
                       int64_t num_tokens, int H, int HV, int V, int NC, int num_segs, float scale,
                       Handoff handoff) {
  static_assert(K == 64 || K == 128, "K = 64 or 128");
  static_assert(VT == 64 || VT == 128, "one or two warpgroups");
  using Sm = WalkBwdWgSmem<K, VT>;
  constexpr int kCompute = 2 * VT;  // compute threads; the producer warpgroup follows them
  constexpr int kLoaders = 128;
  static_assert(walk_bwd_wg_threads<VT>() == kCompute + kLoaders, "one producer warpgroup");
  // VT = 128: three warpgroups launch at 168 registers a thread; the producer gives back to 56,
  // the compute warpgroups take 224 (2 x 224 + 56 = 504 per thread triple). VT = 64: two
  // warpgroups (up to 255 a thread), no reallocation.
  constexpr bool kRealloc = Sm::kWarpgroups == 2;
  constexpr int kComputeRegs = 224, kProducerRegs = 56;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = align_1024(smem_raw);
  auto buf = [&](int b) { return smem + b * Sm::kBuf; };
  auto sG = [&](int b) {  // G of the chunk, padding rows G_C (as xla); then rstd_k, rstd_q
    return reinterpret_cast<float*>(smem + Sm::oSG) + b * Sm::kRows * kChunk;
  };

  // This CTA's (segment, head, column tile) and chunks, worked out on each side of the role split
  // (nothing is live across it but the kernel's parameters)
  // (segments in seg_order, longest first; an entry out of range walks nothing: s_ok false)
  struct Cta {
    int hv, hk, slot, s, v0, c_first, c_last;
    bool s_ok, empty;
  };
  auto cta = [&] {
    Cta a;
    const int ntiles = V / VT;
    const int rest = static_cast<int>(blockIdx.x) / ntiles;
    a.hv = rest % HV;
    a.slot = rest / HV;
    a.s = seg_order[a.slot];
    a.v0 = static_cast<int>(blockIdx.x) % ntiles * VT;
    a.hk = a.hv / (HV / H);
    a.s_ok = a.s >= 0 && a.s < num_segs;
    a.c_first = a.s_ok ? seg_first[a.s] : 0;
    a.c_last = a.s_ok ? seg_last[a.s] : -1;
    a.empty = !a.s_ok || seg_len[a.s] <= 0 || a.c_first < 0 || a.c_last >= NC ||
              a.c_last < a.c_first;
    return a;
  };
  const int64_t state_stride = int64_t{K} * V;
  const bool publish = handoff.data != nullptr;
  if (publish) allow_dependent_launch();
  // named barrier 5: the producer's last publish before thread 0's (hand-off only)
  constexpr int kHandoffBarrier = 5;

  // The two roles never merge again after this branch (ptxas applies each register limit to its
  // own path only).
  if (threadIdx.x >= kCompute) {  // the producer warpgroup
    if constexpr (kRealloc) warpgroup_reg_dealloc<kProducerRegs>();
    const Cta a = cta();
    if (a.empty) return;
    const int hv = a.hv, hk = a.hk, v0 = a.v0, c_first = a.c_first, c_last = a.c_last;
    float* stG = reinterpret_cast<float*>(smem + Sm::oStG);  // the producer's own rows
    float* stRq = stG + kChunk;
    float* stRk = stRq + kChunk;
    const int pt = static_cast<int>(threadIdx.x) - kCompute;
    // bf16: dO, then q, k and w come by TMA, each on an mbarrier a buffer (bars[b], bars[2 +
    // b]): the producer reads only dO, so it waits for the rest once dOg is made; f32: w by
    // cp.async, the rest through registers (walk_bwd_convert)
    constexpr bool kTma = std::is_same_v<In, bf16>;
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem + Sm::oBar);
    if constexpr (kTma) {
      if (pt == 0) {
#pragma unroll
        for (int i = 0; i < 4; ++i) mbar_init(bars + i, 1);
        mbar_init_fence();
      }
      producer_sync();
    }
    auto copy_chunk = [&](int c, int b) {
      const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
      const int len = cs.len;
      unsigned char* Qs = buf(b) + Sm::bQs;
      unsigned char* Ks = buf(b) + Sm::bKs;
      unsigned char* DOs = buf(b) + Sm::bDOs;
      unsigned char* DOg = buf(b) + Sm::bDOg;
      const int64_t qk_off = (cs.start * H + hk) * K;
      const int64_t o_off = (cs.start * HV + hv) * V + v0;
      const RowVector rows[3] = {{stG, G, HV, hv}, {stRq, rstd_q, H, hk}, {stRk, rstd_k, H, hk}};
      unsigned char* Ws = buf(b) + Sm::bWs;
      cp_async_row_vectors<kLoaders>(rows, cs.start, len);
      cp_async_commit();
      if constexpr (kTma) {  // dO, q, k, w as they are into their slabs (dO scaled below)
        if (pt == 0) {
          mbar_arrive_expect_tx(bars + b, VT / 64 * static_cast<uint32_t>(Sm::kSlab));
          mbar_arrive_expect_tx(bars + 2 + b, 3 * K / 64 * static_cast<uint32_t>(Sm::kSlab));
          const int t0 = static_cast<int>(cs.start);
#pragma unroll
          for (int j = 0; j < VT / 64; ++j)
            tma_load_3d(DOs + j * Sm::kSlab, &lm.dout, v0 + 64 * j, hv, t0, bars + b);
#pragma unroll
          for (int j = 0; j < K / 64; ++j) {
            tma_load_3d(Qs + j * Sm::kSlab, &lm.q, 64 * j, hk, t0, bars + 2 + b);
            tma_load_3d(Ks + j * Sm::kSlab, &lm.k, 64 * j, hk, t0, bars + 2 + b);
            tma_load_3d(Ws + j * Sm::kSlab, &lm.w, 64 * j, hv, t0, bars + 2 + b);
          }
        }
        cp_async_wait_all();                           // the rows
        mbar_wait(bars + b, ((c_last - c) >> 1) & 1);  // dO: buffer b's (c_last - c) / 2-th use
        // rows past the chunk's end: zero, as cp.async leaves them
        if (len < kChunk) zero_slab_rows<kLoaders>(DOs, VT / 64, len, pt);
      } else {  // w straight into its slabs
        cp_async_tile_at<kChunk, K, kLoaders, 1>(slab_at<kChunk>(Ws), w + (cs.start * HV + hv) * K,
                                                 int64_t{HV} * K, len);
        cp_async_commit();
        cp_async_wait<1>();  // the rows
      }
      producer_sync();  // every thread's rows (bf16: and zeroed slab rows)
      auto rq = [&](int t) { return rstd_q != nullptr ? stRq[t] : 1.f; };
      auto rk = [&](int t) { return rstd_k != nullptr ? stRk[t] : 1.f; };
      if (pt < kChunk) {  // the compute warps' rows of buffer b (rows >= len: rstd 0, unused)
        const float GC = len > 0 ? stG[len - 1] : 0.f;
        sG(b)[pt] = pt < len ? stG[pt] : GC;
        sG(b)[kChunk + pt] = rk(pt);
        sG(b)[2 * kChunk + pt] = rq(pt);
      }
      // q, k, dO stay as they are (f32: rounded to bf16 here); the per-token factors go on
      // accumulators, except on the state update's reduction over tokens: dOg = dO scale e^G
      // rstd_q (rows >= len: zeros times these, as staged)
      constexpr int kNB = 8;  // f32: 16-byte loads in flight a thread
      if constexpr (sizeof(In) == 4) {
        auto one = [](int) { return 1.f; };
        walk_bwd_convert<K, kNB>(Qs, q + qk_off, int64_t{H} * K, len, one,
                                 [&](int t, int c8, const float (&f)[8], float) {
                                   sts8_bf16(slab_at<kChunk>(Qs)(t, c8), f, 1.f);
                                 });
        walk_bwd_convert<K, kNB>(Ks, k + qk_off, int64_t{H} * K, len, one,
                                 [&](int t, int c8, const float (&f)[8], float) {
                                   sts8_bf16(slab_at<kChunk>(Ks)(t, c8), f, 1.f);
                                 });
      }
      auto dog = [&](int t) { return scale * exp_ftz(stG[t]) * rq(t); };
      walk_bwd_convert<VT, kNB>(DOs, dout + o_off, int64_t{HV} * V, len, dog,
                                [&](int t, int c8, const float (&f)[8], float r) {
                                  if constexpr (sizeof(In) == 4)
                                    sts8_bf16(slab_at<kChunk>(DOs)(t, c8), f, 1.f);
                                  sts8_bf16(slab_at<kChunk>(DOg)(t, c8), f, r);
                                });
      if constexpr (kTma) {  // q, k, w
        mbar_wait(bars + 2 + b, ((c_last - c) >> 1) & 1);
        if (len < kChunk) {
          zero_slab_rows<kLoaders>(Qs, K / 64, len, pt);
          zero_slab_rows<kLoaders>(Ks, K / 64, len, pt);
          zero_slab_rows<kLoaders>(Ws, K / 64, len, pt);
        }
      } else {
        cp_async_wait_all();  // w
      }
      fence_proxy_async();  // for the compute warps' wgmma (async proxy) reads
    };
    // chunk c while the compute warps work on chunk c + 1 (the first: before they start)
    for (int c = c_last, b = 0; c >= c_first; --c, b ^= 1) {
      copy_chunk(c, b);
      __syncthreads();  // chunk c's inputs are in; the compute warps are done with chunk c + 1
      // chunk c + 2's stores completed before the compute warps reached this barrier
      if (publish && pt == 0 && c + 2 <= c_last) handoff_publish(handoff, (c + 2) * HV + hv);
    }
    if (publish)
      asm volatile("bar.arrive %0, %1;\n" ::"n"(kHandoffBarrier), "n"(kCompute + kLoaders)
                   : "memory");
    return;  // barrier 0 is not used after the last chunk opens
  }

  if constexpr (kRealloc) warpgroup_reg_alloc<kComputeRegs>();
  const Cta a = cta();
  const bool tid0 = threadIdx.x == 0;
  if (!a.s_ok) {  // a malformed seg_order entry: no segment to read or write
    if constexpr (kTwin) {  // a slot with nothing to summarise: zeros
      float Z[K / 64][32] = {};
      wg_state_rw<K>(Z, dh0 + (static_cast<int64_t>(a.slot) * HV + a.hv) * state_stride + a.v0 +
                            64 * (threadIdx.x / 128),
                     V, true, (threadIdx.x >> 5) & 3);
    }
    if (publish && tid0) handoff_walk_done(handoff);
    return;
  }
  const int hv = a.hv, s = a.s, v0 = a.v0, c_first = a.c_first, c_last = a.c_last;
  const bool empty = a.empty;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, qd = lane & 3;
  const int wg = warp >> 2, wq = warp & 3;  // warpgroup, warp in it
  unsigned char* Sb = smem + Sm::oSb + wg * size_t{K} * 128;
  unsigned char* Dvn = smem + Sm::oDvn + wg * Sm::kSlab;
  const int64_t state0 = (static_cast<int64_t>(s) * HV + hv) * state_stride + v0 + 64 * wg;
  float* const dh0_out =  // kTwin: the slot's row
      dh0 + (kTwin ? (static_cast<int64_t>(a.slot) * HV + hv) * state_stride + v0 + 64 * wg
                   : state0);

  const int64_t dvn_stride = int64_t{kChunk} * V;  // one (chunk, head)'s dvn rows
  // dS_end and dvn of chunks c0.. (unused ones: no tokens) are zero, this CTA's columns
  auto zero_chunks = [&](int c0) {
    const bf16 zero = __float2bfloat16_rn(0.f);
    for (int c = c0; c < NC; ++c) {
      const int64_t ch = static_cast<int64_t>(c) * HV + hv;
      for (int i = tid; i < K * VT; i += kCompute)
        dS_end[ch * state_stride + (i / VT) * V + v0 + i % VT] = zero;
      for (int i = tid; i < kChunk * VT; i += kCompute)
        dvn[ch * dvn_stride + (i / VT) * V + v0 + i % VT] = zero;
    }
  };

  float S[K / 64][32];
  wg_state_rw<K>(S, const_cast<float*>(dfinal) + state0, V, false, wq);
  if (empty) {
    wg_state_rw<K>(S, dh0_out, V, true, wq);
    // No used chunk at all (no tokens): every dS_end and dvn is zero, written by segment 0.
    if (!kTwin && s == 0 && NC > 0 && clen[0] <= 0) zero_chunks(0);
    if (publish && tid0) handoff_walk_done(handoff);
    return;
  }

  for (int c = c_last, b = 0; c >= c_first; --c, b ^= 1) {
    __syncthreads();  // chunk c's slabs and rows are in; every warp is done with chunk c + 1
    const unsigned char* Ws = buf(b) + Sm::bWs;
    const unsigned char* Qs = buf(b) + Sm::bQs;
    const unsigned char* Ks = buf(b) + Sm::bKs;
    const unsigned char* DOs = buf(b) + Sm::bDOs + wg * Sm::kSlab;
    const unsigned char* DOg = buf(b) + Sm::bDOg + wg * Sm::kSlab;
    unsigned char* AttS = smem + Sm::oAtt;
    const float* sg = sG(b);

    // G_C: the producer pads rows len.. with G_C (0 when len = 0), so row kChunk - 1 holds it
    const float GC = sg[kChunk - 1];
    wg_write_sb<K>(S, Sb, wq);
    fence_proxy_async();
    warpgroup_sync(wg);  // Sb ready (read by its own warpgroup and its TMA store only)
    const float eGC = exp_ftz(GC);
    // dS_end[c] = the carried gradient (bf16): one TMA store of Sb (its read is waited for with
    // dvn's, before the next chunk writes Sb)
    if (!kTwin && (tid & 127) == 0)
      tma_store_2d(&dS_end_map, Sb, v0 + 64 * wg, (c * HV + hv) * K);

    // acc = Ks Sb and this warpgroup's columns of Att = Qs Ks^T
    float acc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = 0.f;
    wgmma_fence_operand(acc);
    constexpr int kAttCols = 64 / Sm::kWarpgroups;  // Att columns per warpgroup
    float att[kAttCols / 2];
#pragma unroll
    for (int i = 0; i < kAttCols / 2; ++i) att[i] = 0.f;
    wgmma_fence_operand(att);
    float dvl[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) dvl[i] = 0.f;
    wgmma_fence_operand(dvl);
    wg_scale_state<K>(S, eGC);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < K / 16; ++ks) {
      const uint32_t kk = (ks / 4) * Sm::kSlab + 32 * (ks % 4);
      // B: k rows kAttCols wg.. (K-major, 128 B a row)
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
    float dec[2];  // the Dvn rows' factors, before the waits (the same operations)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int t = 16 * wq + g + 8 * half;
      dec[half] = exp_ftz(GC - sg[t]) * sg[kChunk + t];
    }
    float gx[kAttCols / 2], grs[kAttCols / 4];  // the gate's factors, before the waits
    wg_gate_factors<kAttCols>(gx, grs, sg, wq, kAttCols * wg,
                              rstd_k != nullptr ? sg + kChunk : nullptr);
    const float rq0 = sg[2 * kChunk + 16 * wq + g];
    const float rq1 = sg[2 * kChunk + 16 * wq + g + 8];
    // dvl = Att^T dOs (A: Att stored [i][j], MN-major)
    auto issue_dvl = [&] {
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kChunk / 16; ++ks)
        wgmma_m64k16_ss<64, true, true, 1>(dvl, sw128_desc(AttS + 2048 * ks, Sm::kSlab),
                                           sw128_desc(DOs + 2048 * ks, Sm::kSlab), true);
      wgmma_commit();
    };
    wgmma_wait<1>();
    wgmma_fence_operand(acc);
    wgmma_fence_operand(att);
    // the mask, Gam and rstd_k (columns), this warpgroup's columns, into the Att slab times
    // rstd_q (rows)
    wg_gate_apply<kAttCols>(att, gx, grs, wq, kAttCols * wg, rstd_k != nullptr);
    wg_store_slab<kAttCols>(att, AttS, wq, kAttCols * wg, rq0, rq1);
    fence_proxy_async();
    compute_sync<kCompute>();  // Att complete
    issue_dvl();
    wgmma_wait<0>();
    wgmma_fence_operand(dvl);
    // dvn = e^{G_C - G} rstd_k acc + scale dvl as bf16 into Dvn (rows: tokens)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int t = 16 * wq + g + 8 * half;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float x0 = dec[half] * acc[4 * j + 2 * half] + scale * dvl[4 * j + 2 * half];
        const float x1 =
            dec[half] * acc[4 * j + 2 * half + 1] + scale * dvl[4 * j + 2 * half + 1];
        *reinterpret_cast<uint32_t*>(Dvn + sw128_offset(t, 8 * j + 2 * qd)) = pack_bf16(x0, x1);
      }
    }
    fence_proxy_async();
    warpgroup_sync(wg);  // Dvn complete (read by its own warpgroup and its TMA store only)
    // dvn[c] for chunk_bwd: one TMA store of the slab (the thread waits for its read before the
    // next chunk's barrier, after which Dvn is written again)
    if (!kTwin && (tid & 127) == 0)
      tma_store_2d(&dvn_map, Dvn, v0 + 64 * wg, (c * HV + hv) * kChunk);

    // dS -= Ws^T Dvn (the second half of the state update)
#pragma unroll
    for (int kb = 0; kb < K / 64; ++kb) wgmma_fence_operand(S[kb]);
    wgmma_fence();
    wg_issue_state_update<K, -1>(S, Ws, Dvn);
    wgmma_commit();
    // chunk c + 1's stores complete (published after the next barrier), while the update runs
    if (publish && (tid & 127) == 0) bulk_stores_complete_but<2>();
    wgmma_wait<0>();
    if ((tid & 127) == 0) tma_store_wait_read();  // Sb and Dvn may be written again
#pragma unroll
    for (int kb = 0; kb < K / 64; ++kb) wgmma_fence_operand(S[kb]);
  }

  wg_state_rw<K>(S, dh0_out, V, true, wq);
  if ((tid & 127) == 0) tma_store_wait();
  if (publish) {  // the last two chunks, once the producer has published the rest
    if ((tid & 127) == 0) bulk_stores_complete_but<0>();
    asm volatile("bar.sync %0, %1;\n" ::"n"(kHandoffBarrier), "n"(kCompute + kLoaders)
                 : "memory");
    if (tid0) {
      if (c_first + 1 <= c_last) handoff_publish(handoff, (c_first + 1) * HV + hv);
      handoff_publish(handoff, c_first * HV + hv);
      handoff_walk_done(handoff);
    }
  }
  // The last used chunk's segment also zeroes the unused chunks' dS_end and dvn.
  if (!kTwin && c_last + 1 < NC && clen[c_last + 1] <= 0) zero_chunks(c_last + 1);
}

}  // namespace jax_cake_gdn
