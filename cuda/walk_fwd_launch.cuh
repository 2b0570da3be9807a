// Host-side pieces the forward walks' handlers share (walk_fwd.cu, transfer.cu): their
// WalkFwdArgs, TMA maps, checks and launch.
#pragma once

#include <string>

#include "handler.cuh"
#include "walk_fwd_wg.cuh"

namespace jax_cake_gdn {

// The operands both handlers set alike (the others stay null).
// seg_order: the segment table's CTA order (null for kTransfer, which has its own map).
template <typename In, typename Out>
inline WalkFwdArgs<In, Out> walk_args(const ffi::AnyBuffer& k, const ffi::Buffer<ffi::F32>& G,
                                      const ffi::Buffer<ffi::F32>& h0, const float* rstd_k,
                                      const ffi::Buffer<ffi::S32>& chunk_start,
                                      const ffi::Buffer<ffi::S32>& chunk_len,
                                      const ffi::Buffer<ffi::S32>& seg_first,
                                      const ffi::Buffer<ffi::S32>& seg_last,
                                      const ffi::Buffer<ffi::S32>& seg_len,
                                      const int32_t* seg_order, float* final_state, int64_t T,
                                      int64_t H, int64_t HV, int64_t NC) {
  WalkFwdArgs<In, Out> a{};
  a.k = static_cast<const In*>(k.untyped_data());
  a.G = G.typed_data();
  a.h0 = h0.typed_data();
  a.rstd = rstd_k;
  a.cstart = chunk_start.typed_data();
  a.clen = chunk_len.typed_data();
  a.seg_first = seg_first.typed_data();
  a.seg_last = seg_last.typed_data();
  a.seg_len = seg_len.typed_data();
  a.seg_order = seg_order;
  a.final_state = final_state;
  a.num_tokens = T;
  a.H = static_cast<int>(H);
  a.HV = static_cast<int>(HV);
  a.NC = static_cast<int>(NC);
  return a;
}

// A TMA map of a bf16 [T, heads, D] token array: 64 x 64 boxes (64 tokens of one head, 64 of
// its D columns). Returns "" or why not.
inline std::string token_map(CUtensorMap* m, const void* base, int64_t T, int64_t heads,
                             int64_t D) {
  const uint64_t dims[3] = {static_cast<uint64_t>(D), static_cast<uint64_t>(heads),
                            static_cast<uint64_t>(T)};
  const uint64_t strides[2] = {static_cast<uint64_t>(D) * 2, static_cast<uint64_t>(heads * D) * 2};
  const uint32_t box[3] = {64, 1, kChunk};
  return make_tma_bf16(m, base, 3, dims, strides, box);
}

// A TMA map of A bf16[NC, HV, 64, 64] as [NC * HV * 64, 64]: one 64 x 64 box a (chunk, head).
inline std::string a_map(CUtensorMap* m, const void* A, int64_t NC, int64_t HV) {
  return make_tma_rows_bf16(m, A, NC * HV * kChunk, kChunk, kChunk);
}

// A of the walks that make w, u from it (walk_output, replay): bf16[NC, HV, 64, 64], its rows
// addressable by a_map. Returns "" or what is wrong.
inline std::string check_a(ffi::Span<const int64_t> A, int64_t NC, int64_t HV) {
  if (!dims_are(A, {NC, HV, kChunk, kChunk}))
    return "A must be bf16[NC, HV, 64, 64], got shape " + dims_str(A);
  if (NC * HV * kChunk >= (int64_t{1} << 31)) return "NC * HV * 64 must be below 2^31";
  return {};
}

// The tensor maps of the walks that make w, u from A (bf16 inputs): k, v (token_map) and A.
// Returns "" or why not.
template <typename Out>
inline std::string from_a_maps(WalkFwdArgs<bf16, Out>& a, int64_t T, int64_t H, int64_t HV,
                               int64_t K, int64_t V, int64_t NC) {
  std::string e = token_map(&a.tm_k, a.k, T, H, K);
  if (e.empty()) e = token_map(&a.tm_v, a.v, T, HV, V);
  if (e.empty()) e = a_map(&a.tm_A, a.A, NC, HV);
  return e;
}

// The checks every walk shares: G, rstd_k, the chunk and segment tables (order: seg_order's
// dimensions), h0 [S, HV, K, V]; sets NC, S and has_rstd. Returns "" or what is wrong.
inline std::string check_walk_inputs(const ffi::Buffer<ffi::F32>& G,
                                     const ffi::Buffer<ffi::F32>& h0,
                                     const ffi::Buffer<ffi::F32>& rstd_k,
                                     const ffi::Buffer<ffi::S32>& chunk_start,
                                     const ffi::Buffer<ffi::S32>& chunk_len,
                                     const ffi::Buffer<ffi::S32>& seg_first,
                                     const ffi::Buffer<ffi::S32>& seg_last,
                                     const ffi::Buffer<ffi::S32>& seg_len,
                                     ffi::Span<const int64_t> order, int64_t T, int64_t H,
                                     int64_t HV, int64_t K, int64_t V, int64_t& NC, int64_t& S,
                                     bool& has_rstd) {
  std::string m;
  if (!(m = check_th("G", G.dimensions(), T, HV)).empty()) return m;
  if (!(m = check_rstd("rstd_k", rstd_k.dimensions(), T, H, has_rstd)).empty()) return m;
  if (!(m = check_table(chunk_start.dimensions(), chunk_len.dimensions())).empty()) return m;
  NC = chunk_start.dimensions()[0];
  if (!(m = check_segments(seg_first.dimensions(), seg_last.dimensions(), seg_len.dimensions(),
                           order))
           .empty())
    return m;
  S = seg_len.dimensions()[0];
  if (S * HV >= (int64_t{1} << 31)) return "S * HV too large";
  if (T >= (int64_t{1} << 31)) return "T must be below 2^31";
  if (!dims_are(h0.dimensions(), {S, HV, K, V}))
    return "h0 must be f32[S, HV, K, V], got shape " + dims_str(h0.dimensions());
  return {};
}

// The tapes' results: h bf16[NC, HV, K, V], v_new bf16[T, HV, V], final f32[S, HV, K, V].
inline std::string check_tapes(ffi::Span<const int64_t> h, ffi::Span<const int64_t> v_new,
                               ffi::Span<const int64_t> fin, int64_t NC, int64_t T, int64_t S,
                               int64_t HV, int64_t K, int64_t V) {
  if (!dims_are(h, {NC, HV, K, V})) return "h must be bf16[NC, HV, K, V], got shape " + dims_str(h);
  if (!dims_are(v_new, {T, HV, V}))
    return "v_new must be bf16[T, HV, V], got shape " + dims_str(v_new);
  if (!dims_are(fin, {S, HV, K, V}))
    return "final must be f32[S, HV, K, V], got shape " + dims_str(fin);
  return {};
}

// One CTA of V / 64 compute warpgroups and a producer warpgroup per (slot, value head): the
// slots are the segments in seg_order (kTransfer: the (kind, unit) pairs of the launch).
template <WalkMode M, typename In, typename Out, int K, int V>
inline cudaError_t launch_walk(const WalkFwdArgs<In, Out>& a, int64_t slots,
                               cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(slots * a.HV));
  return launch(walk_fwd_wg_kernel<M, In, Out, K, V>, grid, walk_fwd_wg_threads<V>(),
                WalkFwdWgSmem<M, K, V>::bytes, stream, a);
}

}  // namespace jax_cake_gdn
