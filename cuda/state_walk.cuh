// The state walk (DESIGN.md section 1): per segment, value head and 64-wide V tile, walk the
// segment's chunks in order:
//
//   h[c] = S;   v_new = u - w S;   S <- e^{G_C} S + (K e^{G_C - G})^T v_new
//
// One CTA of 4 warps per (segment, value head, V tile of 64). The state tile (K x 64, f32) lives
// in registers as S^T: warp wv owns the 16 value columns 16wv..16wv+15 of the tile, all K rows,
// as m16n8 accumulator fragments (K / 8 of them). A C fragment of S^T is a B fragment of S, so
// `w S` takes S from registers (rounded to bf16 per chunk; the f32 state is kept):
//   product 1 (per warp):  v_new[64 x 16] = u - Ws[64 x K] S[K x 16]      (A: w from smem)
//   product 2 (per warp):  S^T[16 x K] = e^{G_C} S^T + v_new^T[16 x 64] Kd[64 x K]
// v_new goes to global (f32) and, as bf16, to this warp's columns of a shared tile that feeds
// product 2 (only the warp itself reads them). w, k, u, G and rstd of chunk c + 1 stream into
// staging buffers with cp.async while chunk c computes; the staging is converted to the bf16
// operand tiles (Ws, Kd) at the top of each chunk.
//
// Unused chunks (after every segment's chunks) get the exit state of the last used chunk, as the
// xla scan gives; with no used chunk at all they get zeros. Empty segments: final = h0.
#pragma once

#include "fwd_common.cuh"

namespace jax_cake_gdn {

constexpr int kWalkThreads = 128;
constexpr int kWalkVT = 64;  // V columns per CTA (4 warps x 16)

template <typename In, int K>
struct WalkSmem {
  static constexpr int KP = K + 8;         // bf16 pitch of Ws, Kd
  static constexpr int UP = kWalkVT + 8;   // f32 pitch of the u staging
  static constexpr int NP = kWalkVT + 8;   // bf16 pitch of the v_new tile
  static constexpr size_t kStW = size_t{kChunk} * K * sizeof(float);
  static constexpr size_t kStK = size_t{kChunk} * K * sizeof(In);
  static constexpr size_t kStU = size_t{kChunk} * UP * sizeof(float);
  static constexpr size_t kStG = 2 * kChunk * sizeof(float);  // G, rstd
  static constexpr size_t kWs = size_t{kChunk} * KP * sizeof(bf16);
  static constexpr size_t kVn = size_t{kChunk} * NP * sizeof(bf16);
  static constexpr size_t oStK = kStW;
  static constexpr size_t oStU = oStK + kStK;
  static constexpr size_t oStG = oStU + kStU;
  static constexpr size_t oWs = oStG + kStG;
  static constexpr size_t oKd = oWs + kWs;
  static constexpr size_t oVn = oKd + kWs;
  static constexpr size_t bytes = oVn + kVn;
};

// S^T fragment element (nt, e) of warp wv: value column v (in the tile) and key row k.
// v = 16 wv + g + 8 (e / 2), k = 8 nt + 2 q + (e % 2).
template <int K>
__device__ __forceinline__ void state_rw(float (&S)[K / 8][4], float* base, int V, bool store) {
  // base points at state[k = 0][v = tile column 0]; row pitch V.
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

template <typename In, int K>
__global__ void __launch_bounds__(kWalkThreads)
    state_walk_kernel(const In* __restrict__ k, const float* __restrict__ w,
                      const float* __restrict__ u, const float* __restrict__ G,
                      const float* __restrict__ h0, const float* __restrict__ rstd,  // nullable
                      const int32_t* __restrict__ cstart, const int32_t* __restrict__ clen,
                      const int32_t* __restrict__ seg_first, const int32_t* __restrict__ seg_last,
                      const int32_t* __restrict__ seg_len, float* __restrict__ h,
                      float* __restrict__ v_new, float* __restrict__ final_state,
                      int64_t num_tokens, int H, int HV, int V, int NC) {
  using Sm = WalkSmem<In, K>;
  constexpr int KP = Sm::KP, UP = Sm::UP, NP = Sm::NP;
  constexpr int KS = K / 16;
  extern __shared__ __align__(16) unsigned char smem[];
  float* stW = reinterpret_cast<float*>(smem);
  In* stK = reinterpret_cast<In*>(smem + Sm::oStK);
  float* stU = reinterpret_cast<float*>(smem + Sm::oStU);
  float* stG = reinterpret_cast<float*>(smem + Sm::oStG);
  float* stR = stG + kChunk;
  bf16* Ws = reinterpret_cast<bf16*>(smem + Sm::oWs);
  bf16* Kd = reinterpret_cast<bf16*>(smem + Sm::oKd);
  bf16* Vn = reinterpret_cast<bf16*>(smem + Sm::oVn);

  // 1-D grid: V tiles of one (segment, head) adjacent (they read the same w, k: L2 hits), then
  // heads, then segments (segments given longest-first start first).
  const int ntiles = V / kWalkVT;
  const int tile = blockIdx.x % ntiles, rest = blockIdx.x / ntiles;
  const int hv = rest % HV, s = rest / HV, v0 = tile * kWalkVT;
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
    if (s == 0 && NC > 0 && clen[0] <= 0) {
      for (int c = 0; c < NC; ++c) {
        float* hp = h + (static_cast<int64_t>(c) * HV + hv) * state_stride + v0;
#pragma unroll
        for (int nt = 0; nt < K / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            hp[static_cast<int64_t>(8 * nt + 2 * q + (e & 1)) * V + 16 * warp + g +
               8 * (e >> 1)] = 0.f;
      }
    }
    return;
  }

  // Stream chunk c's w, k, u tile, G and rstd into the staging buffers (zero beyond its length).
  auto prefetch = [&](int c) {
    const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
    constexpr int kWv = K / 4;  // 16-byte pieces per w row
#pragma unroll 4
    for (int idx = tid; idx < kChunk * kWv; idx += kWalkThreads) {
      const int t = idx / kWv, c4 = (idx % kWv) * 4;
      const bool ok = t < cs.len;
      const float* src = ok ? w + ((cs.start + t) * HV + hv) * K + c4 : w;
      cp_async16(stW + t * K + c4, src, ok);
    }
    constexpr int kEl = 16 / sizeof(In);  // elements per 16-byte piece
    constexpr int kKv = K / kEl;
#pragma unroll 4
    for (int idx = tid; idx < kChunk * kKv; idx += kWalkThreads) {
      const int t = idx / kKv, ce = (idx % kKv) * kEl;
      const bool ok = t < cs.len;
      const In* src = ok ? k + ((cs.start + t) * H + hk) * K + ce : k;
      cp_async16(stK + t * K + ce, src, ok);
    }
    constexpr int kUv = kWalkVT / 4;
#pragma unroll 4
    for (int idx = tid; idx < kChunk * kUv; idx += kWalkThreads) {
      const int t = idx / kUv, c4 = (idx % kUv) * 4;
      const bool ok = t < cs.len;
      const float* src = ok ? u + ((cs.start + t) * HV + hv) * V + v0 + c4 : u;
      cp_async16(stU + t * UP + c4, src, ok);
    }
    if (tid < kChunk) {
      const bool ok = tid < cs.len;
      cp_async4(stG + tid, ok ? G + (cs.start + tid) * HV + hv : G, ok);
    } else if (rstd != nullptr) {
      const int t = tid - kChunk;
      const bool ok = t < cs.len;
      cp_async4(stR + t, ok ? rstd + (cs.start + t) * H + hk : rstd, ok);
    }
    cp_async_commit();
  };

  prefetch(c_first);
  for (int c = c_first; c <= c_last; ++c) {
    const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
    const int len = cs.len;
    cp_async_wait_all();
    __syncthreads();  // staging holds chunk c; every warp is done with chunk c - 1's tiles

    const float GC = len > 0 ? stG[len - 1] : 0.f;
    const float eGC = __expf(GC);
    // staging -> bf16 operand tiles
    {
      constexpr int kV8 = K / 8;
#pragma unroll 4
      for (int idx = tid; idx < kChunk * kV8; idx += kWalkThreads) {
        const int t = idx / kV8, c8 = (idx % kV8) * 8;
        float f[8];
        lds8(stW + t * K + c8, f);
        sts8_bf16(Ws + t * KP + c8, f, 1.f);
        lds8(stK + t * K + c8, f);
        const float r = rstd != nullptr ? stR[t] : 1.f;
        sts8_bf16(Kd + t * KP + c8, f, t < len ? r * __expf(GC - stG[t]) : 0.f);
      }
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
    __syncthreads();  // tiles ready; staging free
    if (c < c_last) prefetch(c + 1);

    // h[c] = S (the state entering the chunk)
    state_rw<K>(S, h + (static_cast<int64_t>(c) * HV + hv) * state_stride + v0, V, true);

    // product 1: v_new = u - Ws S
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
        }
      }
    }
    // v_new out (f32, rows < len) and into this warp's columns of the bf16 tile
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int nv = 0; nv < 2; ++nv)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int t = 16 * mt + g + 8 * half, vc = 16 * warp + 8 * nv + 2 * q;
          const float x0 = acc[mt][nv][2 * half], x1 = acc[mt][nv][2 * half + 1];
          if (t < len) store2(v_new + ((cs.start + t) * HV + hv) * V + v0 + vc, x0, x1);
          *reinterpret_cast<uint32_t*>(Vn + t * NP + vc) = pack_bf16(x0, x1);
        }
    __syncwarp();

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
  if (c_last + 1 < NC && clen[c_last + 1] <= 0) {
    for (int c = c_last + 1; c < NC; ++c)
      state_rw<K>(S, h + (static_cast<int64_t>(c) * HV + hv) * state_stride + v0, V, true);
  }
}

}  // namespace jax_cake_gdn
