// The state walk (DESIGN.md section 1) on mma.sync: per segment, value head and 64-wide V tile,
// walk the segment's chunks in order:
//
//   h[c] = S;   v_new = u - w S;   S <- e^{G_C} S + (K e^{G_C - G})^T v_new
//
// This kernel runs the fused walk_output (kOutput, below) and the state walk of f32 k; the state
// walk of bf16 k runs on wgmma (state_walk_wg.cuh: the same operands and the same order of k16
// steps, results bitwise equal to this kernel's on the H200).
// One CTA of 4 warps per (segment, value head, V tile of 64). The state tile (K x 64, f32) lives
// in registers as S^T: warp wv owns the 16 value columns 16wv..16wv+15 of the tile, all K rows,
// as m16n8 accumulator fragments (K / 8 of them). A C fragment of S^T is a B fragment of S, so
// `w S` takes S from registers (rounded to bf16 per chunk; the f32 state is kept):
//   product 1 (per warp):  v_new[64 x 16] = u - Ws[64 x K] S[K x 16]      (A: w from smem)
//   product 2 (per warp):  S^T[16 x K] = e^{G_C} S^T + v_new^T[16 x 64] Kd[64 x K]
// v_new is rounded to bf16 once (nearest) and goes to global and to this warp's columns of a
// shared tile that feeds product 2 (only the warp itself reads them): its readers (output,
// chunk_bwd) use exactly these bf16 values as operands. w arrives in bf16 (prep rounded it, the
// value this kernel used to round it to). Loads go by cp.async while the previous chunk computes:
// w straight into its operand tile Ws once product 1 is done with it; k, u, G, rstd (and
// walk_output's q) into staging buffers, converted at the top of the chunk.
// h goes to global as bf16 (the f32 state rounded to nearest: the value chunk_bwd and output use
// as an operand), with 16-byte stores through a transpose in this warp's columns of the v_new
// tile before product 1 writes them (state_store_bf16, fwd_common.cuh; no extra shared memory).
//
// Unused chunks (after every segment's chunks) get the exit state of the last used chunk, as the
// xla scan gives; with no used chunk at all they get zeros. Empty segments: final = h0.
//
// kOutput (the fused walk_output of the light forward): the chunk output is computed in the walk,
// and neither h nor v_new is written. One CTA of V / 16 warps (V = 128: 8 warps, 256 threads;
// V = 64: 4) per (segment, value head) covers all V columns (template VT = V), so the w, k, q, G
// staging, the bf16 Q and K tiles and Att are loaded / computed once per (segment, head); warp w
// still owns the 16 state columns 16w..16w+15 exactly as above. The chunk's q streams in with
// w, k, u; per chunk:
//   Att = tril_incl(Gam o Q K^T)            warp w: rows 16 (w % 4).., columns 32 (w / 4)..
//                                           (8 warps; 4 warps: all 64 columns) via
//                                           chunk_scores_part (output.cuh), to a bf16 tile AttS
//                                           shared by all warps
//   o[:, 16w..] = scale (diag(e^G) Q S + Att v_new[:, 16w..])        (per warp, its 16 columns)
// Q S rides in product 1's loop (same B fragments from S, sign flipped), Att v_new reads the v_new
// tile product 2 reads. Every operand is rounded to bf16 exactly as the separate output kernel
// rounds h, v_new, q, k and Att, and every accumulation runs in the same order (which warp
// computes an element does not change its mma sequence), so o matches state_walk + output bit for
// bit (barring compiler contraction differences).
// Cost (ptxas 13.0, sm_90a): K = V = 128: 227 registers, 162 KB shared memory (bf16; u staging
// and v_new tile 64 x 128; k and q staging 16 KB each, Q and K tiles 17 KB each, Att 9 KB), 1 CTA
// = 8 warps per SM. f32 inputs, K = V = 128: 194 KB. K = 64: 199-202 registers, 90-130 KB, 1 CTA.
// V = 64 (4 warps, 128 threads): K = 128 237 registers, 138 / 170 KB (bf16 / f32), 1 CTA.
// The state walk itself (f32 k; 4 warps, VT = 64, bf16 h and v_new stores): K = 128 210
// registers, 94 KB, 2 CTAs per SM; K = 64 167 registers, 62 KB. No spills.
#pragma once

#include "fwd_common.cuh"
#include "output.cuh"

namespace jax_cake_gdn {

constexpr int kWalkThreads = 128;
constexpr int kWalkVT = 64;  // V columns per CTA of the state walk (4 warps x 16)

// Threads of a CTA covering VT value columns (VT / 16 warps of 32): kWalkThreads for the state
// walk (VT = kWalkVT), 2 V for walk_output (VT = V).
template <int VT>
constexpr int walk_threads() {
  return 2 * VT;
}

template <typename In, int K, bool kOutput = false, int VT = kWalkVT>
struct WalkSmem {
  static constexpr int KP = K + 8;         // bf16 pitch of Ws, Kd
  static constexpr int UP = VT + 8;        // f32 pitch of the u staging
  static constexpr int NP = VT + 8;        // bf16 pitch of the v_new tile
  static constexpr int AP = kChunk + 8;    // bf16 pitch of the Att tile (kOutput)
  static constexpr size_t kStK = size_t{kChunk} * K * sizeof(In);
  static constexpr size_t kStU = size_t{kChunk} * UP * sizeof(float);
  static constexpr size_t kStG = 2 * 2 * kChunk * sizeof(float);  // G, rstd; two chunks
  static constexpr size_t kWs = size_t{kChunk} * KP * sizeof(bf16);
  static constexpr size_t kVn = size_t{kChunk} * NP * sizeof(bf16);
  static constexpr size_t oStK = 0;
  static constexpr size_t oStU = oStK + kStK;
  static constexpr size_t oStG = oStU + kStU;
  static constexpr size_t oWs = oStG + kStG;
  static constexpr size_t oKd = oWs + kWs;
  static constexpr size_t oVn = oKd + kWs;
  // kOutput only: q staging, rstd_q staging, G of the chunk (kept past the prefetch), the bf16
  // Q and K tiles (normalised, no decay) and the bf16 Att tile.
  static constexpr size_t kStQ = kOutput ? size_t{kChunk} * K * sizeof(In) : 0;
  static constexpr size_t kRow = kOutput ? kChunk * sizeof(float) : 0;
  static constexpr size_t kQK = kOutput ? kWs : 0;
  static constexpr size_t kAtt = kOutput ? size_t{kChunk} * AP * sizeof(bf16) : 0;
  static constexpr size_t oStQ = oVn + kVn;
  static constexpr size_t oStRq = oStQ + kStQ;
  static constexpr size_t oSG = oStRq + kRow;
  static constexpr size_t oQs = oSG + kRow;
  static constexpr size_t oKs = oQs + kQK;
  static constexpr size_t oAtt = oKs + kQK;
  static constexpr size_t bytes = oAtt + kAtt;
};

// kOutput = false: qin (the q input), rstd_q and o are unused (nullptr); VT = kWalkVT.
// kOutput = true: h and v_new are unused (nullptr); o [T, HV, V] in Out; VT = V (one CTA per
// (segment, value head)).
// The state walk of bf16 k runs on wgmma (state_walk_wg.cuh); this one takes f32 k.
template <typename In, int K, bool kOutput = false, typename Out = float, int VT = kWalkVT>
__global__ void __launch_bounds__(walk_threads<VT>(), 1)
    state_walk_kernel(const In* __restrict__ k, const bf16* __restrict__ w,
                      const float* __restrict__ u, const float* __restrict__ G,
                      const float* __restrict__ h0, const float* __restrict__ rstd,  // nullable
                      const int32_t* __restrict__ cstart, const int32_t* __restrict__ clen,
                      const int32_t* __restrict__ seg_first, const int32_t* __restrict__ seg_last,
                      const int32_t* __restrict__ seg_len, bf16* __restrict__ h,
                      bf16* __restrict__ v_new, float* __restrict__ final_state,
                      int64_t num_tokens, int H, int HV, int V, int NC,
                      const In* __restrict__ qin, const float* __restrict__ rstd_q,  // nullable
                      Out* __restrict__ o, float scale) {
  static_assert(kOutput || VT == kWalkVT, "the state walk runs 64-column tiles");
  static_assert(VT == 64 || VT == 128, "4 or 8 warps");
  static_assert(kOutput || std::is_same_v<In, float>, "bf16 k: state_walk_wg_kernel");
  using Sm = WalkSmem<In, K, kOutput, VT>;
  constexpr int KP = Sm::KP, UP = Sm::UP, NP = Sm::NP, AP = Sm::AP;
  constexpr int KS = K / 16;
  constexpr int kThreads = walk_threads<VT>();
  extern __shared__ __align__(16) unsigned char smem[];
  In* stK = reinterpret_cast<In*>(smem + Sm::oStK);
  float* stU = reinterpret_cast<float*>(smem + Sm::oStU);
  float* stG0 = reinterpret_cast<float*>(smem + Sm::oStG);  // chunk c: G at stG0 + (c & 1) * 128,
                                                            // rstd 64 after it
  bf16* Ws = reinterpret_cast<bf16*>(smem + Sm::oWs);
  bf16* Kd = reinterpret_cast<bf16*>(smem + Sm::oKd);
  bf16* Vn = reinterpret_cast<bf16*>(smem + Sm::oVn);
  In* stQ = reinterpret_cast<In*>(smem + Sm::oStQ);         // kOutput only (the next 5)
  float* stRq = reinterpret_cast<float*>(smem + Sm::oStRq);
  float* sG = reinterpret_cast<float*>(smem + Sm::oSG);
  bf16* Qs = reinterpret_cast<bf16*>(smem + Sm::oQs);
  bf16* Ks = reinterpret_cast<bf16*>(smem + Sm::oKs);
  bf16* AttS = reinterpret_cast<bf16*>(smem + Sm::oAtt);

  // 1-D grid: V tiles of one (segment, head) adjacent (they read the same w, k: L2 hits), then
  // heads, then segments (segments given longest-first start first).
  const int ntiles = V / VT;  // 1 with kOutput
  const int tile = blockIdx.x % ntiles, rest = blockIdx.x / ntiles;
  const int hv = rest % HV, s = rest / HV, v0 = tile * VT;
  const int hk = hv / (HV / H);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
  const int64_t state_stride = int64_t{K} * V;  // one (.., hv) K x V state

  float S[K / 8][4];
  float* fin = final_state + (static_cast<int64_t>(s) * HV + hv) * state_stride + v0;
  state_rw<K>(S, const_cast<float*>(h0) + (static_cast<int64_t>(s) * HV + hv) * state_stride + v0,
              V, false);

  const int c_first = seg_first[s], c_last = seg_last[s];
  const bool empty = seg_len[s] <= 0 || c_first < 0 || c_last >= NC || c_last < c_first;
  if (empty) {
    state_rw<K>(S, fin, V, true);
    // No used chunk at all (no tokens): every h is the zero state, written by segment 0.
    if (!kOutput && s == 0 && NC > 0 && clen[0] <= 0) {
      for (int c = 0; c < NC; ++c)
        state_zero_bf16<K>(h + (static_cast<int64_t>(c) * HV + hv) * state_stride + v0, V);
    }
    return;
  }

  // cp.async issue for chunk c (rows beyond its length zero; the caller commits): w straight into
  // Ws; k, u, G, rstd (and q, rstd_q) into staging. (Issue loops rolled: unrolled, they cost the
  // 4-warp walk registers.)
  auto prefetch_w = [&](int c) {
    const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
    cp_async_tile<kChunk, K, kThreads, false>(Ws, KP, w + (cs.start * HV + hv) * K,
                                              int64_t{HV} * K, cs.len);
  };
  auto prefetch_k = [&](int c) {
    const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
    cp_async_tile<kChunk, K, kThreads, false>(stK, K, k + (cs.start * H + hk) * K,
                                              int64_t{H} * K, cs.len);
  };
  auto prefetch_rows = [&](int c) {
    const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
    float* stG = stG0 + (c & 1) * 2 * kChunk;
    float* stR = stG + kChunk;
    prefetch_k(c);
    if constexpr (kOutput) {
      cp_async_tile<kChunk, K, kThreads, false>(stQ, K, qin + (cs.start * H + hk) * K,
                                                int64_t{H} * K, cs.len);
      if (rstd_q != nullptr && tid < kChunk) {
        const bool ok = tid < cs.len;
        cp_async4(stRq + tid, ok ? rstd_q + (cs.start + tid) * H + hk : rstd_q, ok);
      }
    }
    cp_async_tile<kChunk, VT, kThreads, false>(stU, UP, u + (cs.start * HV + hv) * V + v0,
                                               int64_t{HV} * V, cs.len);
    if (tid < kChunk) {
      const bool ok = tid < cs.len;
      cp_async4(stG + tid, ok ? G + (cs.start + tid) * HV + hv : G, ok);
    } else if (rstd != nullptr && (kThreads <= 2 * kChunk || tid < 2 * kChunk)) {
      const int t = tid - kChunk;
      const bool ok = t < cs.len;
      cp_async4(stR + t, ok ? rstd + (cs.start + t) * H + hk : rstd, ok);
    }
  };

  // Per chunk c, commit groups (every thread commits each one, empty or not): (kOutput) the rows
  // of c + 1 once the staging is read; w (+ the rows, not kOutput) of c + 1 after product 1; the
  // top waits for everything. A tile is overwritten only after the barrier that follows its last
  // reader.
  prefetch_rows(c_first);
  prefetch_w(c_first);
  cp_async_commit();
  for (int c = c_first; c <= c_last; ++c) {
    const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
    const int len = cs.len;
    const float* stG = stG0 + (c & 1) * 2 * kChunk;
    const float* stR = stG + kChunk;
    cp_async_wait_all();
    __syncthreads();  // chunk c's w, k, u, G, rstd have landed; every warp is done with c - 1

    const float GC = len > 0 ? stG[len - 1] : 0.f;
    const float eGC = __expf(GC);
    // the Kd decay scale of row t (0 beyond len): k rstd e^{G_C - G}
    auto kd_scale = [&](int t) {
      const float r = rstd != nullptr ? stR[t] : 1.f;
      return t < len ? r * __expf(GC - stG[t]) : 0.f;
    };
    // staged k (and q) -> bf16 operand tiles
    {
      using P = TilePieces<kChunk, K, kThreads>;
      const int t0 = P::row0(), c8 = P::col();
#pragma unroll 4
      for (int j = 0; j < P::kPer; ++j) {
        const int t = t0 + j * P::kRowStep;
        float f[8];
        lds8(stK + t * K + c8, f);
        sts8_bf16(Kd + t * KP + c8, f, kd_scale(t));
        if constexpr (kOutput) {  // as output.cuh's tile loads: x rstd, zero beyond len
          sts8_bf16(Ks + t * KP + c8, f, rstd != nullptr ? stR[t] : 1.f);
          lds8(stQ + t * K + c8, f);
          sts8_bf16(Qs + t * KP + c8, f, rstd_q != nullptr ? stRq[t] : 1.f);
        }
      }
      if (kOutput && tid < kChunk) sG[tid] = stG[min(tid, max(len - 1, 0))];
    }
    // u into the product-1 accumulators: acc[mt][nv] covers rows 16mt.., columns 16wv + 8nv..
    float acc[4][2][4];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int nv = 0; nv < 2; ++nv)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float2 x = *reinterpret_cast<const float2*>(
              stU + (16 * mt + g + 8 * half) * UP + 16 * warp + 8 * nv + 2 * q);
          acc[mt][nv][2 * half] = x.x;
          acc[mt][nv][2 * half + 1] = x.y;
        }
    if constexpr (kOutput) {
      __syncthreads();  // Qs, Ks ready; staging free
      if (c < c_last) prefetch_rows(c + 1);
      cp_async_commit();
    }

    // o accumulators (kOutput): rows 16mt.., this warp's columns 16wv + 8nv..
    [[maybe_unused]] float oacc[4][2][4];
    if constexpr (kOutput) {
      // This warp's part of Att -> the shared bf16 tile (read by every warp after the barrier
      // below): rows 16 (warp % 4).., columns j0.. (4 warps: all 64; 8 warps: 32 each)
      {
        constexpr int kGroups = VT / 64, NTA = 8 / kGroups;  // column groups, n-tiles per warp
        const int rw = warp % 4, j0 = (warp / 4) * (8 * NTA);
        uint32_t qa[KS][4];
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) lda_rm(qa[ks], Qs + (16 * rw) * KP + 16 * ks, KP);
        float att[NTA][4];
        chunk_scores_part<KS, NTA>(att, qa, Ks, KP, sG, rw, j0);
        const int i0 = 16 * rw + g;
#pragma unroll
        for (int nt = 0; nt < NTA; ++nt) {
          *reinterpret_cast<uint32_t*>(AttS + i0 * AP + j0 + 8 * nt + 2 * q) =
              pack_bf16(att[nt][0], att[nt][1]);
          *reinterpret_cast<uint32_t*>(AttS + (i0 + 8) * AP + j0 + 8 * nt + 2 * q) =
              pack_bf16(att[nt][2], att[nt][3]);
        }
      }
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nv = 0; nv < 2; ++nv) oacc[mt][nv][0] = oacc[mt][nv][1] = oacc[mt][nv][2] =
            oacc[mt][nv][3] = 0.f;
    } else {
      // h[c] = S (the state entering the chunk), as bf16 through this warp's (free) columns of
      // the v_new tile: product 2 of chunk c - 1 read them before the barriers above, and
      // v_new is written to them below (state_store_bf16 ends with __syncwarp)
      state_store_bf16<K, NP>(S, h + (static_cast<int64_t>(c) * HV + hv) * state_stride + v0, V,
                              Vn);
    }

    // product 1: v_new = u - Ws S (and with kOutput, oacc = Q S: the same fragments of S with
    // the sign bits flipped, which is exact in bf16)
    {
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const uint32_t b00 = pack_bf16(-S[2 * ks][0], -S[2 * ks][1]);
        const uint32_t b01 = pack_bf16(-S[2 * ks + 1][0], -S[2 * ks + 1][1]);
        const uint32_t b10 = pack_bf16(-S[2 * ks][2], -S[2 * ks][3]);
        const uint32_t b11 = pack_bf16(-S[2 * ks + 1][2], -S[2 * ks + 1][3]);
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
          uint32_t a[4];
          lda_rm(a, Ws + (16 * mt) * KP + 16 * ks, KP);
          mma_bf16(acc[mt][0], a, b00, b01);
          mma_bf16(acc[mt][1], a, b10, b11);
          if constexpr (kOutput) {
            constexpr uint32_t kSign = 0x80008000u;
            lda_rm(a, Qs + (16 * mt) * KP + 16 * ks, KP);
            mma_bf16(oacc[mt][0], a, b00 ^ kSign, b01 ^ kSign);
            mma_bf16(oacc[mt][1], a, b10 ^ kSign, b11 ^ kSign);
          }
        }
      }
    }
    // v_new out (bf16, rows < len; not with kOutput) and into this warp's columns of the bf16 tile
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int nv = 0; nv < 2; ++nv)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int t = 16 * mt + g + 8 * half, vc = 16 * warp + 8 * nv + 2 * q;
          const float x0 = acc[mt][nv][2 * half], x1 = acc[mt][nv][2 * half + 1];
          if (!kOutput && t < len)
            store2(v_new + ((cs.start + t) * HV + hv) * V + v0 + vc, x0, x1);
          *reinterpret_cast<uint32_t*>(Vn + t * NP + vc) = pack_bf16(x0, x1);
        }
    __syncwarp();
    __syncthreads();  // every warp is done with Ws (kOutput: AttS holds all 64 rows)
    if (c < c_last) {
      if constexpr (!kOutput) prefetch_rows(c + 1);
      prefetch_w(c + 1);
    }
    cp_async_commit();

    if constexpr (kOutput) {
      // (the Vn columns read below are this warp's own)
      // o = scale (diag(e^G) Q S + Att v_new), in output.cuh's order
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        const float eg0 = __expf(sG[16 * mt + g]), eg1 = __expf(sG[16 * mt + g + 8]);
#pragma unroll
        for (int nv = 0; nv < 2; ++nv) {
          oacc[mt][nv][0] *= eg0;
          oacc[mt][nv][1] *= eg0;
          oacc[mt][nv][2] *= eg1;
          oacc[mt][nv][3] *= eg1;
        }
        uint32_t pa[4][4];
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) lda_rm(pa[ks], AttS + (16 * mt) * AP + 16 * ks, AP);
        mma_rm<4, 2>(oacc[mt], pa, Vn + 16 * warp, NP);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int t = 16 * mt + g + 8 * half;
          if (t < len) {
            Out* op = o + ((cs.start + t) * HV + hv) * V + v0 + 16 * warp + 2 * q;
#pragma unroll
            for (int nv = 0; nv < 2; ++nv)
              store2(op + 8 * nv, scale * oacc[mt][nv][2 * half],
                     scale * oacc[mt][nv][2 * half + 1]);
          }
        }
      }
    }

    // product 2: S^T = e^{G_C} S^T + v_new^T Kd
#pragma unroll
    for (int nt = 0; nt < K / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) S[nt][e] *= eGC;
    {
      uint32_t a[4][4];
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) lda_tr(a[ks], Vn + (16 * ks) * NP + 16 * warp, NP);
      mma_rm<4, K / 8>(S, a, Kd, KP);
    }
  }

  state_rw<K>(S, fin, V, true);
  // The last used chunk's segment also fills the unused chunks' h with its exit state.
  if (!kOutput && c_last + 1 < NC && clen[c_last + 1] <= 0) {
    for (int c = c_last + 1; c < NC; ++c)
      state_store_bf16<K, NP>(S, h + (static_cast<int64_t>(c) * HV + hv) * state_stride + v0, V,
                              Vn);
  }
}

}  // namespace jax_cake_gdn
