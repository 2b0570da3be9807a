// Host-side pieces the forward walks' handlers share (walk_fwd.cu, transfer.cu): their
// WalkFwdArgs, tensor maps and launch.
#pragma once

#include <algorithm>
#include <string>
#include <type_traits>

#include "handler.cuh"
#include "walk_fwd_wg.cuh"

namespace jax_cake_gdn {

// The operands every walk sets alike (the others stay null). seg_order: the segment each CTA slot
// walks (null for kTransfer, which has its own map); final_state: kTransfer's B.
template <typename In, typename Out>
inline WalkFwdArgs<In, Out> walk_args(const ffi::AnyBuffer& k, const F32& G, const F32& h0,
                                      const F32& rstd_k, const ChunkTable& chunks,
                                      const SegmentTable& segs, const int32_t* seg_order,
                                      float* final_state) {
  WalkFwdArgs<In, Out> a{};
  a.k = data<In>(k);
  a.G = G.typed_data();
  a.h0 = h0.typed_data();
  a.rstd = optional_data(rstd_k);
  a.cstart = chunks.start.typed_data();
  a.clen = chunks.len.typed_data();
  a.seg_first = segs.first.typed_data();
  a.seg_last = segs.last.typed_data();
  a.seg_len = segs.len.typed_data();
  a.seg_order = seg_order;
  a.final_state = final_state;
  a.num_tokens = k.dimensions()[0];
  a.H = static_cast<int>(k.dimensions()[1]);
  a.HV = static_cast<int>(G.dimensions()[1]);
  a.NC = static_cast<int>(chunks.count());
  return a;
}

// The tensor maps of walk mode M: the producer's TMA loads (bf16 inputs: k, and q, v, A or w, u
// as the mode reads them) and the compute warps' TMA stores (o when bf16, the tapes), these only
// when there is a chunk to store. A bf16[NC, HV, 64, 64] is mapped as [NC * HV * 64, 64]: one
// 64 x 64 box a (chunk, head).
template <WalkMode M, int K, typename In, typename Out>
inline ffi::Error walk_maps(WalkFwdArgs<In, Out>& a) {
  const int64_t T = a.num_tokens, H = a.H, HV = a.HV, NC = a.NC, V = a.VG;
  if constexpr (std::is_same_v<In, bf16>) {
    if constexpr (walk_outputs_o(M))
      JCG_CHECK_MAP(make_tma_token_rows(&a.tm_q, a.q, T, H, K, true), "q");
    JCG_CHECK_MAP(make_tma_token_rows(&a.tm_k, a.k, T, H, K, true), "k");
    if constexpr (M == WalkMode::kTapes) {
      JCG_CHECK_MAP(make_tma_token_rows(&a.tm_w, a.w, T, HV, K, true), "w");
      JCG_CHECK_MAP(make_tma_token_rows(&a.tm_u, a.u, T, HV, V, true), "u");
    } else {
      JCG_CHECK_MAP(make_tma_token_rows(&a.tm_v, a.v, T, HV, V, true), "v");
      JCG_CHECK_MAP(make_tma_rows_bf16(&a.tm_A, a.A, NC * HV * kChunk, kChunk, kChunk), "A");
    }
  }
  if (NC * HV > 0 && T > 0) {
    if constexpr (walk_outputs_o(M) && std::is_same_v<Out, bf16>)
      JCG_CHECK_MAP(make_tma_token_rows(&a.tm_o, a.o, T, HV, V, true), "o");
    if constexpr (M == WalkMode::kReplay || M == WalkMode::kOutTapes) {
      JCG_CHECK_MAP(make_tma_state_rows_bf16(&a.tm_h, a.h, NC, HV, K, V), "h");
      JCG_CHECK_MAP(make_tma_token_rows(&a.tm_wout, a.w_out, T, HV, K, true), "w");
    }
    if constexpr (M == WalkMode::kOutTapes)
      JCG_CHECK_MAP(make_tma_token_rows(&a.tm_vnew, a.v_new, T, HV, V, true), "v_new");
  }
  return ffi::Error::Success();
}

// One CTA of V / 64 compute warpgroups and a producer warpgroup per (slot, value head, column
// tile): the slots are the segments in seg_order (kTransfer: the (kind, unit) pairs of the
// launch), the tiles a.VG / V (a.VG set by the caller, as walk_maps needs it too).
// behind: with programmatic dependent launch (behind solve_a, WalkFwdArgs::a_ready).
template <WalkMode M, typename In, typename Out, int K, int V>
inline ffi::Error launch_walk(const WalkFwdArgs<In, Out>& a, int64_t slots, cudaStream_t stream,
                              bool behind = false) {
  if (a.VG != V && !(V == 64 && a.VG == 128))
    return ffi::Error::InvalidArgument("walk_fwd_wg: column tiles are two of 64 columns");
  const dim3 grid(static_cast<unsigned>(slots * a.HV * (a.VG / V)));
  // behind solve_a, each CTA asks for an SM's whole shared memory, so that none of solve_a's
  // CTAs shares its SM (they would slow the chain)
  const size_t smem = behind ? std::max(WalkFwdWgSmem<M, K, V>::bytes, kMaxSmemPerCta)
                             : WalkFwdWgSmem<M, K, V>::bytes;
  return cuda_status(launch(behind, walk_fwd_wg_kernel<M, In, Out, K, V>, grid,
                            walk_fwd_wg_threads<V>(), smem, stream, a),
                     "walk_fwd_wg_kernel");
}

// walk_maps, then launch_walk over the segments, in `tiles` CTAs a head of V columns each (v
// has V * tiles).
template <WalkMode M, int K, int V, typename In, typename Out>
inline ffi::Error run_walk(WalkFwdArgs<In, Out>& a, const SegmentTable& segs,
                           cudaStream_t stream, bool behind = false, int tiles = 1) {
  a.VG = V * tiles;
  JCG_RETURN_IF_ERROR((walk_maps<M, K>(a)));
  return launch_walk<M, In, Out, K, V>(a, segs.count(), stream, behind);
}

// Column tiles of a walk_output or replay launch of walk_ctas CTAs (a segment and value head
// each) at V columns: `asked` (1, or 2 at V = 128: the caller's ColumnTiles) or, for 0, 2 (two
// CTAs of 64 columns a head, the V = 64 kernel) at V = 128 when those CTAs would hold at most 3/8
// of the SMs (few chains: one long document, small heads), where the one-warpgroup walk's shorter
// step pays for w being made twice a head; else, or with JAX_CAKE_GDN_WALK_TILES=1 (read once per
// process), one.
inline int walk_column_tiles(int64_t walk_ctas, int64_t V, int asked) {
  static const bool one = env_is("JAX_CAKE_GDN_WALK_TILES", "1");
  if (asked == 1 || asked == 2) return V == 128 ? asked : 1;
  return !one && V == 128 && walk_ctas > 0 && 8 * walk_ctas <= 3 * int64_t{sm_count()} ? 2 : 1;
}

// run_walk in `tiles` column tiles of V / tiles (walk_column_tiles).
template <WalkMode M, int K, int V, typename In, typename Out>
inline ffi::Error run_walk_tiled(WalkFwdArgs<In, Out>& a, const SegmentTable& segs,
                                 cudaStream_t stream, int tiles, bool behind = false) {
  if constexpr (V == 128) {
    if (tiles == 2) return run_walk<M, K, 64>(a, segs, stream, behind, 2);
  }
  return run_walk<M, K, V>(a, segs, stream, behind);
}

}  // namespace jax_cake_gdn
