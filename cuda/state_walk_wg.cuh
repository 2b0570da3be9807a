// The state walk (DESIGN.md section 1) on Hopper warpgroup MMA: per segment, value head and
// 64-wide V tile, walk the segment's chunks in order:
//
//   h[c] = S;   v_new = u - w S;   S <- e^{G_C} S + k^T diag(d) v_new,  d_t = r_t e^{G_C - G_t}
//
// (r: rstd of k, 1 without L2 norm; k as it is, the per-token factor d on v_new: walk_decay).
// One CTA = one warpgroup (4 warps) per (segment, value head, V tile of 64), V tiles of one
// (segment, head) adjacent (they read the same w, k: L2 hits). The K x 64 f32 state lives
// in registers as K / 64 wgmma accumulators of 64 x 64 (rows: key index k, columns: value
// column v; warp w holds rows 16 w.. of each, wg_acc.cuh). Per chunk:
//   Sb = bf16(S)                       (shared, MN-major B; also the h tape, copied out with
//                                       16-byte stores while product 1 runs)
//   product 1: v_new = u - Ws Sb       (m64n64, K / 16 steps; A = w, K-major; D starts as u)
//   Vd = bf16(d v_new)                 (shared, MN-major B; v_new unscaled to global)
//   product 2: S = e^{G_C} S + k^T Vd  (per 64-row block of S: m64n64, 4 steps; A = k MN-major)
// Operand tiles are 128-byte swizzled slabs (wgmma.cuh): w and bf16 k land by cp.async straight
// into their slabs ([token][key]: K-major for w, MN-major for k); f32 k is staged and rounded
// into the k slab before product 2; u (bf16) lands in its slab and is read into product 1's
// accumulator. G, rstd go through staging. walk_output_wg.cuh computes the state with the same
// operands and k16 order (its final state is expected bit for bit equal).
// Shared memory (K = 128): w 16 KB, k 16 KB, Sb 16 KB, Vd 8 KB, u 8 KB, G / rstd 1 KB, + 1 KB
// for 1024-byte alignment: 66 KB, 3 CTAs per SM (f32 k: + 32 KB of staging, 2 CTAs).
#pragma once

#include <type_traits>

#include "wg_acc.cuh"

namespace jax_cake_gdn {

constexpr int kWgThreads = 128;
constexpr int kWgVT = 64;  // V columns per CTA of the state walk

template <typename In, int K>
struct WalkWgSmem {
  static constexpr size_t kSlab = size_t{kChunk} * 128;  // 64 rows x 64 bf16
  static constexpr size_t oWs = 0;                         // K / 64 slabs [token][key]
  static constexpr size_t oKs = oWs + K / 64 * kSlab;      // K / 64 slabs [token][key]
  static constexpr size_t oSb = oKs + K / 64 * kSlab;      // one slab of K rows [key][v]
  static constexpr size_t oVd = oSb + size_t{K} * 128;     // one slab [token][v]
  static constexpr size_t oUs = oVd + kSlab;               // u: one slab [token][v]
  static constexpr size_t oStG = oUs + kSlab;
  static constexpr size_t oStK = oStG + 2 * 2 * kChunk * sizeof(float);  // G, rstd x 2 chunks
  // f32 k goes through staging (bf16 k lands in Ks itself)
  static constexpr size_t kStK = std::is_same_v<In, bf16> ? 0 : size_t{kChunk} * K * sizeof(In);
  static constexpr size_t bytes = oStK + kStK + 1024;  // the base is aligned up to 1024
};

template <typename In, int K>
__global__ void __launch_bounds__(kWgThreads, 3)
    state_walk_wg_kernel(const In* __restrict__ k, const bf16* __restrict__ w,
                         const bf16* __restrict__ u, const float* __restrict__ G,
                         const float* __restrict__ h0, const float* __restrict__ rstd,  // nullable
                         const int32_t* __restrict__ cstart, const int32_t* __restrict__ clen,
                         const int32_t* __restrict__ seg_first,
                         const int32_t* __restrict__ seg_last, const int32_t* __restrict__ seg_len,
                         bf16* __restrict__ h, bf16* __restrict__ v_new,
                         float* __restrict__ final_state, int64_t num_tokens, int H, int HV, int V,
                         int NC) {
  static_assert(K == 64 || K == 128, "K = 64 or 128");
  constexpr bool kBf16K = std::is_same_v<In, bf16>;
  using Sm = WalkWgSmem<In, K>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = align_1024(smem_raw);
  unsigned char* Ws = smem + Sm::oWs;
  unsigned char* Ks = smem + Sm::oKs;
  unsigned char* Sb = smem + Sm::oSb;
  unsigned char* Vd = smem + Sm::oVd;
  unsigned char* Us = smem + Sm::oUs;
  In* stK = reinterpret_cast<In*>(smem + Sm::oStK);  // f32 k only
  float* stG0 = reinterpret_cast<float*>(smem + Sm::oStG);  // chunk c: G at stG0 + (c & 1) * 128,
                                                            // rstd 64 after it

  const int ntiles = V / kWgVT;
  const int tile = blockIdx.x % ntiles, rest = blockIdx.x / ntiles;
  const int hv = rest % HV, s = rest / HV, v0 = tile * kWgVT;
  const int hk = hv / (HV / H);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
  const int64_t state_stride = int64_t{K} * V;

  float S[K / 64][32];
  const int64_t state0 = (static_cast<int64_t>(s) * HV + hv) * state_stride + v0;
  float* fin = final_state + state0;
  wg_state_rw<K>(S, const_cast<float*>(h0) + state0, V, false, warp);

  const int c_first = seg_first[s], c_last = seg_last[s];
  const bool empty = seg_len[s] <= 0 || c_first < 0 || c_last >= NC || c_last < c_first;
  if (empty) {
    wg_state_rw<K>(S, fin, V, true, warp);
    if (s == 0 && NC > 0 && clen[0] <= 0) {
      for (int c = 0; c < NC; ++c)
        state_zero_bf16<K>(h + (static_cast<int64_t>(c) * HV + hv) * state_stride + v0, V);
    }
    return;
  }

  // h[c] = Sb with 16-byte stores (after a barrier that follows write_sb)
  auto copy_sb_to_h = [&](int c) {
    wg_copy_sb<K>(Sb, h + (static_cast<int64_t>(c) * HV + hv) * state_stride + v0, V, tid);
  };
  // cp.async of chunk c's [64 x K] bf16 rows (zero beyond its length) into swizzled slabs
  using P = TilePieces<kChunk, K, kWgThreads>;
  auto prefetch_w = [&](int c) {
    const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
    cp_async_tile_at<kChunk, K, kWgThreads, false>(
        slab_at<kChunk>(Ws), w + (cs.start * HV + hv) * K, int64_t{HV} * K, cs.len);
  };
  auto prefetch_k = [&](int c) {
    const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
    if constexpr (kBf16K) {
      cp_async_tile_at<kChunk, K, kWgThreads, false>(
          slab_at<kChunk>(Ks), k + (cs.start * H + hk) * K, int64_t{H} * K, cs.len);
    } else {
      cp_async_tile<kChunk, K, kWgThreads, false>(stK, K, k + (cs.start * H + hk) * K,
                                                  int64_t{H} * K, cs.len);
    }
  };
  auto prefetch_rows = [&](int c) {  // u tile, G, rstd
    const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
    float* stG = stG0 + (c & 1) * 2 * kChunk;
    float* stR = stG + kChunk;
    cp_async_tile_at<kChunk, 64, kWgThreads, false>(
        slab_at<kChunk>(Us), u + (cs.start * HV + hv) * V + v0, int64_t{HV} * V, cs.len);
    const RowVector rows[2] = {{stG, G, HV, hv}, {stR, rstd, H, hk}};
    cp_async_row_vectors<kWgThreads>(rows, cs.start, cs.len);
  };

  // Commit groups per chunk c: k(c) at the top; u / G / rstd of c + 1 once the u slab is read;
  // w of c + 1 once product 1 is done. The top waits for everything; k(c) is waited for before
  // its scaling with the rows of c + 1 still in flight.
  prefetch_rows(c_first);
  prefetch_w(c_first);
  cp_async_commit();
  for (int c = c_first; c <= c_last; ++c) {
    const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
    const int len = cs.len;
    const float* stG = stG0 + (c & 1) * 2 * kChunk;
    const float* stR = stG + kChunk;
    cp_async_wait_all();
    __syncthreads();  // w, u, G, rstd of chunk c have landed; chunk c - 1 is done everywhere
    prefetch_k(c);
    cp_async_commit();

    const float GC = len > 0 ? stG[len - 1] : 0.f;
    const float eGC = __expf(GC);
    // product 1's accumulator starts as u (rows >= len are zero)
    float acc[32];
    wg_load_slab64(acc, Us, warp);
    wg_write_sb<K>(S, Sb, warp);
    fence_proxy_async();
    __syncthreads();  // Sb complete; the u slab is read
    if (c < c_last) prefetch_rows(c + 1);
    cp_async_commit();

    // product 1: v_new = u - Ws Sb
    wgmma_fence_operand(acc);
    wgmma_fence();
    wg_issue_product1<K>(acc, Ws, Sb);
    wgmma_commit();
    copy_sb_to_h(c);  // h[c] = S (bf16), while the tensor cores run
    wgmma_wait<0>();
    wgmma_fence_operand(acc);

    // v_new to global (rows < len); Vd = bf16(d v_new) (rows >= len: d = 0)
    const int i0 = 16 * warp + g, i1 = i0 + 8;
    const float d0 = walk_decay(i0, len, GC, stG, rstd != nullptr ? stR : nullptr);
    const float d1 = walk_decay(i1, len, GC, stG, rstd != nullptr ? stR : nullptr);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int t = half ? i1 : i0, vc = 8 * j + 2 * q;
        if (t < len)
          store2(v_new + ((cs.start + t) * HV + hv) * V + v0 + vc, acc[4 * j + 2 * half],
                 acc[4 * j + 2 * half + 1]);
      }
    wg_store_slab<64>(acc, Vd, warp, 0, d0, d1);
    // k(c) has landed (bf16: in Ks; f32: in staging, rounded into Ks here, each thread its own
    // pieces; rows >= len are zero from the copy)
    cp_async_wait<1>();
    if constexpr (!kBf16K) {
      const int t0 = P::row0(), col = P::col();
#pragma unroll 2
      for (int j = 0; j < P::kPer; ++j) {
        const int t = t0 + j * P::kRowStep;
        float f[8];
        lds8(stK + t * K + col, f);
        sts8_bf16(reinterpret_cast<bf16*>(Ks + slab_offset<kChunk>(t, col)), f, 1.f);
      }
    }
    fence_proxy_async();
    __syncthreads();  // Vd, k complete; every warp's product 1 is done with Ws
    if (c < c_last) prefetch_w(c + 1);
    cp_async_commit();

    // product 2: S = e^{G_C} S + k^T Vd
    wg_scale_state<K>(S, eGC);
    wgmma_fence();
    wg_issue_state_update<K>(S, Ks, Vd);
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int b = 0; b < K / 64; ++b) wgmma_fence_operand(S[b]);
  }

  wg_state_rw<K>(S, fin, V, true, warp);
  // The last used chunk's segment also fills the unused chunks' h with its exit state.
  if (c_last + 1 < NC && clen[c_last + 1] <= 0) {
    __syncthreads();  // every warp is done reading Sb
    wg_write_sb<K>(S, Sb, warp);
    __syncthreads();
    for (int c = c_last + 1; c < NC; ++c) copy_sb_to_h(c);
  }
}

}  // namespace jax_cake_gdn
