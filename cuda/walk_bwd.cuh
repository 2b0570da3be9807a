// The backward state walk (primitives/xla.py: walk_bwd). Per segment and value head (and, for
// the one instantiation whose shared memory does not allow all V columns, per 64-wide V tile),
// walk the segment's chunks in REVERSE order with the state gradient dS (K x VT, f32):
//
//   dS_end[c] = dfinal[seg] on the segment's last chunk, else dS_in[c + 1]
//   dv_local  = scale Att^T dO                          Att = Gam o (Q K^T), or the saved scores
//   dvn       = dv_local + Kd dS_end                    Kd = K e^{G_C - G}
//   dS_in     = scale (Q e^G)^T dO + e^{G_C} dS_end - w^T dvn
//   dh0[seg]  = dS_in of the first chunk (dfinal[seg] for an empty segment)
//
// One CTA of VT / 16 warps (2 VT threads, wb_threads) per (segment, value head, VT columns of
// V). The dispatch (walk_bwd.cu, walk_bwd_vt) runs VT = V, one CTA per (segment, head)
// covering all V columns (V = 128: 8 warps, 256 threads; V = 64: 4 warps, 128 threads), except
// f32 inputs at K = V = 128, whose shared memory at VT = 128 (224 / 240 KB without / with saved
// scores) is at or over the 227 KB a CTA may have: that instantiation keeps VT = 64 (two 4-warp
// CTAs per (segment, head), as v0).
// dS lives in registers as dS^T, warp wv owning value columns 16wv..16wv+15 of the CTA's VT and
// all K rows, as m16n8 accumulator fragments (K / 8 of them). A C fragment of dS^T is a B
// fragment of dS, so `Kd dS` takes dS from registers (rounded to bf16 per chunk; the f32 state is
// kept). The w, q, k, G, rstd (and scores) staging, the bf16 Q, K, W tiles and Att are loaded /
// computed once per CTA and shared by all its warps; the dO staging and the dOs, dOg, Dvn tiles
// are 64 x VT. Per chunk (all mma.sync m16n8k16, bf16 in, f32 accumulate):
//   Att (recompute mode): warp w computes rows 16 (w % 4).., columns 32 (w / 4).. (8 warps;
//       4 warps: all 64 columns) of Q K^T via chunk_scores_part (output.cuh: gated with
//       exp(G_i - G_j), i >= j only, never e^{-G}) and writes bf16 Att to a shared tile (scores
//       mode: the saved bf16 scores are copied instead);
//   dv_local[64 x 16] = Att^T dOs                       (A: Att^T by ldmatrix.trans)
//   dvn[64 x 16]      = dv_local + diag(e^{G_C - G}) (Ks dS)   (A: K from smem, B: registers)
//   dS^T[16 x K]      = e^{G_C} dS^T + dOg^T Qs - dvn^T Ws     (dOg = scale e^G dO, dOs = scale dO)
// The row factors e^G (on dO's rows) and e^{G_C - G} (on the product's rows) keep one q and one
// k tile for both uses. dvn goes, negated and as bf16, to this warp's columns of a shared tile
// (only the warp itself reads them). w, q, k, dO, G, rstd (and scores) of chunk c - 1 stream into
// staging buffers with cp.async while chunk c computes; the staging is converted to bf16 operand
// tiles at the top of each chunk.
//
// Every element is computed with the same bf16 roundings and the same mma accumulation order
// whatever VT is (which warp computes an Att element, or how many V columns a CTA covers, does not
// change its operands or its mma sequence), so VT = V gives results bitwise equal to the v0
// kernel's VT = 64 (barring compiler contraction differences), and recomputed and saved scores
// still agree bit for bit. (Checked in the PTX: the sequence of f32, bf16-convert and mma
// instructions of the VT = 64 instantiations is the v0 kernel's, and VT = 128's is VT = 64's
// without the half of the Att products and gates that the other column group's warps now do.)
//
// Cost (ptxas -v, sm_90a, nvcc 13.0, CMakeLists.txt flags, with the bf16 dS_end store; no spills,
// no stack frame, 1 barrier; dynamic shared memory without / with saved scores; 1 CTA per SM
// except K = V = 64 bf16 without scores, 2):
//   K = V = 128, bf16, VT = 128 (8 warps):  251 registers, 176 / 192 KB (bf16 w staging 16 KB, dO
//       staging 16 KB; dOs, dOg, Dvn 17 KB each; Q, K, W tiles 17 KB each; Att 9 KB): 8 warps/SM
//   K = V = 128, f32,  VT = 64  (4 warps):  167 registers, 184 / 200 KB: 4 warps per SM
//   K = 64, V = 128, VT = 128 (8 warps):    bf16 251 registers, 128 / 144 KB; f32 251, 160 / 176 KB
//   V = 64, VT = 64 (4 warps):              K = 128: bf16 168 registers, 144 / 160 KB; f32 167,
//       184 / 200 KB. K = 64: bf16 168, 96 / 112 KB; f32 162, 120 / 136 KB
// (with the f32 dS_end store: 250 at K = V = 128 bf16, 251-252 at K = 128 VT = 64 and at
// K = 64 VT = 128, 165 at K = V = 64 f32; the same CTAs per SM)
// (v0 ran every shape at VT = 64: K = V = 128 bf16 was 252 registers, 160 / 176 KB, two 4-warp
// CTAs per (segment, head), 4 warps per SM, both recomputing Att and loading w, q, k.)
//
// dS_end goes to global as bf16 (the f32 gradient rounded to nearest: the operand chunk_bwd used to
// round it to itself), with 16-byte stores through a transpose in this warp's columns of the Dvn
// tile before this chunk's -dvn is written there (state_store_bf16, fwd_common.cuh; no extra
// shared memory). The carried dS stays f32.
//
// Unused chunks (length 0, after every segment's chunks) get dS_end = 0, as the xla reverse scan
// gives (its carry starts at zero there); the last used chunk's segment writes them, or segment 0
// when no chunk is used at all.
#pragma once

#include "fwd_common.cuh"
#include "output.cuh"  // chunk_scores_part

namespace jax_cake_gdn {

// Threads of a walk_bwd CTA covering VT value columns (VT / 16 warps of 32).
template <int VT>
constexpr int wb_threads() {
  return 2 * VT;
}

template <typename In, int K, int VT>
struct WalkBwdSmem {
  static constexpr int KP = K + 8;       // bf16 pitch of Qs, Ks, Ws
  static constexpr int AP = kChunk + 8;  // bf16 pitch of the Att tile
  static constexpr int OP = VT + 8;      // bf16 pitch of the VT-wide tiles (dOs, dOg, Dvn)
  static constexpr size_t kStW = size_t{kChunk} * K * sizeof(bf16);
  static constexpr size_t kStQK = size_t{kChunk} * K * sizeof(In);
  static constexpr size_t kStO = size_t{kChunk} * VT * sizeof(In);
  static constexpr size_t kStG = 3 * kChunk * sizeof(float);  // G, rstd_q, rstd_k
  static constexpr size_t kBig = size_t{kChunk} * KP * sizeof(bf16);
  static constexpr size_t kAtt = size_t{kChunk} * AP * sizeof(bf16);
  static constexpr size_t kOT = size_t{kChunk} * OP * sizeof(bf16);
  static constexpr size_t kStA = size_t{kChunk} * kChunk * sizeof(bf16);  // scores staging
  static constexpr size_t oStQ = kStW;
  static constexpr size_t oStK = oStQ + kStQK;
  static constexpr size_t oStO = oStK + kStQK;
  static constexpr size_t oStG = oStO + kStO;
  static constexpr size_t oQs = oStG + kStG;
  static constexpr size_t oKs = oQs + kBig;
  static constexpr size_t oWs = oKs + kBig;
  static constexpr size_t oDOs = oWs + kBig;
  static constexpr size_t oDOg = oDOs + kOT;
  static constexpr size_t oDvn = oDOg + kOT;
  static constexpr size_t oAtt = oDvn + kOT;
  static constexpr size_t oSG = oAtt + kAtt;
  static constexpr size_t oStA = oSG + kChunk * sizeof(float);
  static constexpr size_t bytes_no_scores = oStA;
  static constexpr size_t bytes_scores = oStA + kStA;
  static constexpr bool fits = bytes_scores <= 227 * 1024;  // the sm_90 per-CTA limit
  static size_t bytes(bool has_scores) { return has_scores ? bytes_scores : bytes_no_scores; }
};

// V columns per CTA for (In, K, V): all of V (one CTA per (segment, head)) where that fits in
// shared memory, else 64 (only f32 inputs at K = V = 128).
template <typename In, int K, int V>
constexpr int walk_bwd_vt() {
  return WalkBwdSmem<In, K, V>::fits ? V : 64;
}

template <typename In, int K, int VT>
__global__ void __launch_bounds__(wb_threads<VT>())
    walk_bwd_kernel(const In* __restrict__ q, const In* __restrict__ k,
                    const bf16* __restrict__ w, const float* __restrict__ G,
                    const In* __restrict__ dout, const float* __restrict__ dfinal,
                    const bf16* __restrict__ scores,  // nullable: recompute Att
                    const float* __restrict__ rstd_q,  // nullable
                    const float* __restrict__ rstd_k,  // nullable
                    const int32_t* __restrict__ cstart, const int32_t* __restrict__ clen,
                    const int32_t* __restrict__ seg_first, const int32_t* __restrict__ seg_last,
                    const int32_t* __restrict__ seg_len, bf16* __restrict__ dS_end,
                    float* __restrict__ dh0, int64_t num_tokens, int H, int HV, int V, int NC,
                    float scale) {
  static_assert(VT == 64 || VT == 128, "4 or 8 warps");
  using Sm = WalkBwdSmem<In, K, VT>;
  static_assert(Sm::fits, "walk_bwd: shared memory over the sm_90 limit");
  constexpr int KP = Sm::KP, AP = Sm::AP, OP = Sm::OP;
  constexpr int KS = K / 16;
  constexpr int kThreads = wb_threads<VT>();
  static_assert(kThreads >= 2 * kChunk, "the G / rstd prefetch needs 2 x 64 threads");
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* stW = reinterpret_cast<bf16*>(smem);
  In* stQ = reinterpret_cast<In*>(smem + Sm::oStQ);
  In* stK = reinterpret_cast<In*>(smem + Sm::oStK);
  In* stO = reinterpret_cast<In*>(smem + Sm::oStO);
  float* stG = reinterpret_cast<float*>(smem + Sm::oStG);
  float* stRq = stG + kChunk;
  float* stRk = stRq + kChunk;
  bf16* Qs = reinterpret_cast<bf16*>(smem + Sm::oQs);
  bf16* Ks = reinterpret_cast<bf16*>(smem + Sm::oKs);
  bf16* Ws = reinterpret_cast<bf16*>(smem + Sm::oWs);
  bf16* DOs = reinterpret_cast<bf16*>(smem + Sm::oDOs);
  bf16* DOg = reinterpret_cast<bf16*>(smem + Sm::oDOg);
  bf16* Dvn = reinterpret_cast<bf16*>(smem + Sm::oDvn);
  bf16* Att = reinterpret_cast<bf16*>(smem + Sm::oAtt);
  float* sG = reinterpret_cast<float*>(smem + Sm::oSG);
  bf16* stA = reinterpret_cast<bf16*>(smem + Sm::oStA);  // only when scores != nullptr

  // 1-D grid as the forward walk: V tiles of one (segment, head) adjacent (1 tile when VT = V),
  // then heads, then segments.
  const int ntiles = V / VT;
  const int tile = blockIdx.x % ntiles, rest = blockIdx.x / ntiles;
  const int hv = rest % HV, s = rest / HV, v0 = tile * VT;
  const int hk = hv / (HV / H);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, qd = lane & 3;
  const int64_t state_stride = int64_t{K} * V;

  float S[K / 8][4];
  float* dh0p = dh0 + (static_cast<int64_t>(s) * HV + hv) * state_stride + v0;
  const float* dfin = dfinal + (static_cast<int64_t>(s) * HV + hv) * state_stride + v0;
  state_rw<K>(S, const_cast<float*>(dfin), V, false);

  const int c_first = seg_first[s], c_last = seg_last[s];
  const bool empty = seg_len[s] <= 0 || c_first < 0 || c_last >= NC || c_last < c_first;
  if (empty) {
    state_rw<K>(S, dh0p, V, true);
    // No used chunk at all (no tokens): every dS_end is zero, written by segment 0.
    if (s == 0 && NC > 0 && clen[0] <= 0) {
      for (int c = 0; c < NC; ++c)
        state_zero_bf16<K>(dS_end + (static_cast<int64_t>(c) * HV + hv) * state_stride + v0, V);
    }
    return;
  }

  // Stream chunk c's w, q, k, dO columns v0..v0+VT-1, G, rstd (and scores) into staging (zero
  // beyond its length).
  auto prefetch = [&](int c) {
    const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
    cp_async_tile<kChunk, K, kThreads, false>(stW, K, w + (cs.start * HV + hv) * K,
                                              int64_t{HV} * K, cs.len);
    cp_async_tile<kChunk, K, kThreads, false>(stQ, K, q + (cs.start * H + hk) * K,
                                              int64_t{H} * K, cs.len);
    cp_async_tile<kChunk, K, kThreads, false>(stK, K, k + (cs.start * H + hk) * K,
                                              int64_t{H} * K, cs.len);
    cp_async_tile<kChunk, VT, kThreads, false>(stO, VT, dout + (cs.start * HV + hv) * V + v0,
                                               int64_t{HV} * V, cs.len);
    if (scores != nullptr) {
      const bf16* sp = scores + (static_cast<int64_t>(c) * HV + hv) * (kChunk * kChunk);
#pragma unroll 4
      for (int idx = tid; idx < kChunk * kChunk / 8; idx += kThreads)
        cp_async16(stA + 8 * idx, sp + 8 * idx, true);
    }
    if (tid < kChunk) {
      const bool ok = tid < cs.len;
      cp_async4(stG + tid, ok ? G + (cs.start + tid) * HV + hv : G, ok);
      if (rstd_q != nullptr)
        cp_async4(stRq + tid, ok ? rstd_q + (cs.start + tid) * H + hk : rstd_q, ok);
    } else if (rstd_k != nullptr && tid < 2 * kChunk) {  // (8 warps: threads >= 128 idle here)
      const int t = tid - kChunk;
      const bool ok = t < cs.len;
      cp_async4(stRk + t, ok ? rstd_k + (cs.start + t) * H + hk : rstd_k, ok);
    }
    cp_async_commit();
  };

  prefetch(c_last);
  for (int c = c_last; c >= c_first; --c) {
    const int len = chunk_span(cstart, clen, c, num_tokens).len;
    cp_async_wait_all();
    __syncthreads();  // staging holds chunk c; every warp is done with chunk c + 1's tiles

    const float GC = len > 0 ? stG[len - 1] : 0.f;
    const float eGC = __expf(GC);
    // staging -> bf16 operand tiles
    {
      using PK = TilePieces<kChunk, K, kThreads>;
      const int tk = PK::row0(), ck = PK::col();
#pragma unroll 2
      for (int j = 0; j < PK::kPer; ++j) {
        const int t = tk + j * PK::kRowStep, c8 = ck;
        *reinterpret_cast<uint4*>(Ws + t * KP + c8) =
            *reinterpret_cast<const uint4*>(stW + t * K + c8);
        float f[8];
        lds8(stQ + t * K + c8, f);
        sts8_bf16(Qs + t * KP + c8, f, rstd_q != nullptr ? stRq[t] : 1.f);
        lds8(stK + t * K + c8, f);
        sts8_bf16(Ks + t * KP + c8, f, rstd_k != nullptr ? stRk[t] : 1.f);
      }
      using PO = TilePieces<kChunk, VT, kThreads>;
      const int to = PO::row0(), co = PO::col();
#pragma unroll 2
      for (int j = 0; j < PO::kPer; ++j) {
        const int t = to + j * PO::kRowStep, c8 = co;
        float f[8];
        lds8(stO + t * VT + c8, f);  // rows >= len are zero
        sts8_bf16(DOs + t * OP + c8, f, scale);
        sts8_bf16(DOg + t * OP + c8, f, scale * __expf(stG[t]));
      }
      if (scores != nullptr) {
        using PA = TilePieces<kChunk, kChunk, kThreads>;
        const int ta = PA::row0(), ca = PA::col();
#pragma unroll 2
        for (int j = 0; j < PA::kPer; ++j) {
          const int t = ta + j * PA::kRowStep, c8 = ca;
          *reinterpret_cast<uint4*>(Att + t * AP + c8) =
              *reinterpret_cast<const uint4*>(stA + t * kChunk + c8);
        }
      }
      if (tid < kChunk) sG[tid] = tid < len ? stG[tid] : GC;  // padding rows: G = GC (as xla)
    }
    __syncthreads();  // tiles ready; staging free
    if (c > c_first) prefetch(c - 1);

    // dS_end[c] = the carried gradient, as bf16 through this warp's (free) columns of the Dvn
    // tile: the last product of chunk c + 1 read them before the barriers above, and -dvn is
    // written to them below (state_store_bf16 ends with __syncwarp)
    state_store_bf16<K, OP>(S, dS_end + (static_cast<int64_t>(c) * HV + hv) * state_stride + v0,
                            V, Dvn);

    if (scores == nullptr) {
      // This warp's part of Att = Gam o (Q K^T), bf16 into the shared tile: rows 16 (warp % 4)..,
      // columns j0.. (4 warps: all 64; 8 warps: 32 each)
      constexpr int kGroups = VT / 64, NTA = 8 / kGroups;  // column groups, n-tiles per warp
      const int rw = warp % 4, j0 = (warp / 4) * (8 * NTA);
      uint32_t qa[KS][4];
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) lda_rm(qa[ks], Qs + (16 * rw) * KP + 16 * ks, KP);
      float att[NTA][4];
      chunk_scores_part<KS, NTA>(att, qa, Ks, KP, sG, rw, j0);
      const int i0 = 16 * rw + g, i1 = i0 + 8;
#pragma unroll
      for (int nt = 0; nt < NTA; ++nt) {
        *reinterpret_cast<uint32_t*>(Att + i0 * AP + j0 + 8 * nt + 2 * qd) =
            pack_bf16(att[nt][0], att[nt][1]);
        *reinterpret_cast<uint32_t*>(Att + i1 * AP + j0 + 8 * nt + 2 * qd) =
            pack_bf16(att[nt][2], att[nt][3]);
      }
      __syncthreads();  // Att complete
    }

    // dv_local[64 x 16] = Att^T dOs (this warp's 16 value columns)
    float dvl[4][2][4];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      zero_acc(dvl[mt]);
      uint32_t a[4][4];
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) lda_tr(a[ks], Att + (16 * ks) * AP + 16 * mt, AP);
      mma_rm<4, 2>(dvl[mt], a, DOs + 16 * warp, OP);
    }

    // dvn = dv_local + diag(e^{GC - G}) Ks dS
    {
      float acc[4][2][4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) zero_acc(acc[mt]);
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const uint32_t b00 = pack_bf16(S[2 * ks][0], S[2 * ks][1]);
        const uint32_t b01 = pack_bf16(S[2 * ks + 1][0], S[2 * ks + 1][1]);
        const uint32_t b10 = pack_bf16(S[2 * ks][2], S[2 * ks][3]);
        const uint32_t b11 = pack_bf16(S[2 * ks + 1][2], S[2 * ks + 1][3]);
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
          uint32_t a[4];
          lda_rm(a, Ks + (16 * mt) * KP + 16 * ks, KP);
          mma_bf16(acc[mt][0], a, b00, b01);
          mma_bf16(acc[mt][1], a, b10, b11);
        }
      }
      // -dvn as bf16 into this warp's columns of the Dvn tile
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int t = 16 * mt + g + 8 * half;
          const float dec = __expf(GC - sG[t]);
#pragma unroll
          for (int nv = 0; nv < 2; ++nv) {
            const int vc = 16 * warp + 8 * nv + 2 * qd;
            const float x0 = dec * acc[mt][nv][2 * half] + dvl[mt][nv][2 * half];
            const float x1 = dec * acc[mt][nv][2 * half + 1] + dvl[mt][nv][2 * half + 1];
            *reinterpret_cast<uint32_t*>(Dvn + t * OP + vc) = pack_bf16(-x0, -x1);
          }
        }
    }

    // dS^T = e^{GC} dS^T + dOg^T Qs - dvn^T Ws
#pragma unroll
    for (int nt = 0; nt < K / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) S[nt][e] *= eGC;
    {
      uint32_t a[4][4];
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) lda_tr(a[ks], DOg + (16 * ks) * OP + 16 * warp, OP);
      mma_rm<4, K / 8>(S, a, Qs, KP);
    }
    __syncwarp();  // this warp's Dvn columns are written
    {
      uint32_t a[4][4];
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) lda_tr(a[ks], Dvn + (16 * ks) * OP + 16 * warp, OP);
      mma_rm<4, K / 8>(S, a, Ws, KP);
    }
  }

  state_rw<K>(S, dh0p, V, true);
  // The last used chunk's segment also zeroes the unused chunks' dS_end.
  if (c_last + 1 < NC && clen[c_last + 1] <= 0) {
    for (int c = c_last + 1; c < NC; ++c)
      state_zero_bf16<K>(dS_end + (static_cast<int64_t>(c) * HV + hv) * state_stride + v0, V);
  }
}

}  // namespace jax_cake_gdn
