// FFI handlers of the forward walks: the state walk, the light backward's replay and the fused
// walk + output (with or without tapes), one kernel template on Hopper wgmma (walk_fwd_wg.cuh):
//
//   jax_cake_gdn_state_walk(k, w, u, G, h0, rstd_k, chunk_start, chunk_len, seg_first, seg_last,
//                           seg_len, seg_order) -> h bf16[NC, HV, K, V], v_new bf16[T, HV, V],
//                                       final f32[S, HV, K, V]
//
// k: bf16 or f32 [T, H, K]; w bf16[T, HV, K]; u bf16[T, HV, V]; G f32[T, HV]; h0 f32[S, HV, K, V];
// rstd_k f32[T, H] or f32[1]; chunk and segment tables int32 (chunks.py). K, V in {64, 128}.
// The h tape and v_new are bf16: the f32 values rounded to nearest, the operands their reader
// (chunk_bwd) uses; the walk itself carries the state in f32.
//
//   jax_cake_gdn_walk_output(q, k, v, beta, A, G, h0, rstd_q, rstd_k, chunk_start, chunk_len,
//                            seg_first, seg_last, seg_len, seg_order; scale, column_tiles)
//       -> o [T, HV, V] (bf16 or f32, the result type chooses), final f32[S, HV, K, V]
//   jax_cake_gdn_walk_output_tapes(the same) -> o, final, h, v_new, w (replay's, bit for bit)
//
//   jax_cake_gdn_solve_a_walk_output(q, k, v, beta, G, h0, rstd_q, rstd_k, chunk_start,
//                                    chunk_len, seg_first, seg_last, seg_len, seg_order; scale,
//                                    column_tiles)
//       -> A (solve_a's), a_ready int32[1 + NC HV] (scratch, handoff.cuh), then walk_output's
//          results
//   jax_cake_gdn_solve_a_walk_output_tapes(the same) -> A, a_ready, walk_output_tapes' results
//
//   jax_cake_gdn_replay(k, v, beta, A, G, h0, rstd_k, chunk_start, chunk_len, seg_first,
//                       seg_last, seg_len, seg_order; column_tiles) -> h, v_new, w bf16[T, HV, K],
//                       final
//
// The light backward's replay: state_walk on prep's w, u, made on chip from A (as prep makes
// them, bit for bit: bf16(A diag(beta e^G rstd)) times bf16 k, bf16(A diag(beta)) times bf16 v,
// in 4 k16 steps, rounded to bf16), and w written for walk_bwd (u is not needed after the walk).
//
// The light forward's walk: o = xla.output(state_walk(...)) with w, u made on chip from A bf16[NC,
// HV, 64, 64] (solve_a's) and h, v_new kept there. q, k, v: same dtype (v [T, HV, V]); beta
// f32[T, HV]; rstd_q f32[T, H] or f32[1]; the rest as state_walk. bf16 q, k, v and A reach the
// kernel by TMA: the handler encodes their tensor maps (tma.cuh). Launch (all three): one CTA of
// V / 64 compute warpgroups and a producer warpgroup per (segment, value head), grid S x HV
// (segment-major, the segments in seg_order: chunks.py sorts them longest first). walk_output
// and replay with few chains (walk_column_tiles; the int32 attribute column_tiles: 0 lets it
// choose, 1 or 2 ask) split V = 128 into two CTAs of 64 columns a head, grid S x HV x 2: the
// recurrence is column-wise in V, each CTA makes the head's w itself (tile 0 stores it), and
// every output keeps its bits.
#include "solve_a_launch.cuh"
#include "walk_fwd_launch.cuh"

namespace jax_cake_gdn {
namespace {

ffi::Error state_walk(cudaStream_t stream, ffi::AnyBuffer k, BF16 w, BF16 u, F32 G, F32 h0,
                      F32 rstd_k, ChunkTable chunks, SegmentTable segs, S32 seg_order,
                      Ret<BF16> h, Ret<BF16> v_new, Ret<F32> final_state) {
  JCG_CHECK_CUDA(poison_all(stream, *h, *v_new, *final_state));
  return dispatch(
      [&](auto in, auto kd, auto vd) {  // one CTA covers all V columns
        using In = typename decltype(in)::type;
        auto a = walk_args<In, bf16>(k, G, h0, rstd_k, chunks, segs, seg_order.typed_data(),
                                     final_state->typed_data());
        a.w = static_cast<const bf16*>(w.untyped_data());
        a.u = static_cast<const bf16*>(u.untyped_data());
        a.h = static_cast<bf16*>(h->untyped_data());
        a.v_new = static_cast<bf16*>(v_new->untyped_data());
        return run_walk<WalkMode::kTapes, decltype(kd)::value, decltype(vd)::value>(a, segs,
                                                                                 stream);
      },
      FloatType{k.element_type()}, HeadDim{k.dimensions()[2]}, HeadDim{u.dimensions()[2]});
}

// The tapes of walk_output_tapes (h, v_new, w; none for walk_output), poisoned.
ffi::Error walk_tapes(cudaStream_t stream, ffi::RemainingRets& tapes, bf16* (&out)[3]) {
  if (tapes.size() != 3 && !tapes.empty())
    return ffi::Error::InvalidArgument("expected 2 or 5 walk results");
  for (size_t i = 0; i < tapes.size(); ++i) {
    auto r = tapes.get<BF16>(i);
    if (r.has_error()) return r.error();
    JCG_CHECK_CUDA(poison(stream, **r));
    out[i] = static_cast<bf16*>((*r)->untyped_data());
  }
  return ffi::Error::Success();
}

// The fused walk + output (with the tapes when h is given; outputs poisoned by the caller). A
// read as WalkFwdArgs::a_ready says; behind: launched behind solve_a with programmatic
// dependent launch; tiles: walk_column_tiles'.
ffi::Error launch_walk_output(cudaStream_t stream, const ffi::AnyBuffer& q,
                              const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, F32 beta, BF16 A,
                              F32 G, F32 h0, F32 rstd_q, F32 rstd_k, const ChunkTable& chunks,
                              const SegmentTable& segs, S32 seg_order, float scale, int tiles,
                              ffi::AnyBuffer o, F32 final_state, bf16* const (&tape)[3],
                              const int32_t* a_ready) {
  return dispatch(
      [&](auto in, auto out, auto kd, auto vd) {
        using In = typename decltype(in)::type;
        using Out = typename decltype(out)::type;
        constexpr int KD = decltype(kd)::value, VD = decltype(vd)::value;
        auto a = walk_args<In, Out>(k, G, h0, rstd_k, chunks, segs, seg_order.typed_data(),
                                    final_state.typed_data());
        a.q = data<In>(q);
        a.v = data<In>(v);
        a.beta = beta.typed_data();
        a.A = static_cast<const bf16*>(A.untyped_data());
        a.rstd_q = optional_data(rstd_q);
        a.o = data<Out>(o);
        a.scale = scale;
        a.a_ready = a_ready;
        const bool behind = a_ready != nullptr;
        if (tape[0] == nullptr)
          return run_walk_tiled<WalkMode::kOut, KD, VD>(a, segs, stream, tiles, behind);
        a.h = tape[0];
        a.v_new = tape[1];
        a.w_out = tape[2];
        return run_walk_tiled<WalkMode::kOutTapes, KD, VD>(a, segs, stream, tiles, behind);
      },
      FloatType{q.element_type()}, FloatType{o.element_type()}, HeadDim{q.dimensions()[2]},
      HeadDim{v.dimensions()[2]});
}

// walk_output and walk_output_tapes.
ffi::Error walk_output(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       F32 beta, BF16 A, F32 G, F32 h0, F32 rstd_q, F32 rstd_k, ChunkTable chunks,
                       SegmentTable segs, S32 seg_order, Scale scale, ColumnTiles column_tiles,
                       Ret<ffi::AnyBuffer> o, Ret<F32> final_state, ffi::RemainingRets tapes) {
  bf16* tape[3] = {nullptr, nullptr, nullptr};
  JCG_RETURN_IF_ERROR(walk_tapes(stream, tapes, tape));
  JCG_CHECK_CUDA(poison_all(stream, *o, *final_state));
  const int tiles = walk_column_tiles(segs.count() * beta.dimensions()[1], v.dimensions()[2],
                                      *column_tiles);
  return launch_walk_output(stream, q, k, v, beta, A, G, h0, rstd_q, rstd_k, chunks, segs,
                            seg_order, *scale, tiles, *o, *final_state, tape, nullptr);
}

// solve_a, then walk_output (with or without tapes) on its A. bf16 inputs whose chains (segments
// x value heads) are at most half the SMs: solve_a first on the SMs the walk's CTAs (a whole SM
// each, column tiles included) leave (launch_solve_a with a_ready) and the walk behind it, each
// chunk's A handed over by a flag (handoff.cuh); otherwise one after the other.
ffi::Error solve_a_walk_output(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                               ffi::AnyBuffer v, F32 beta, F32 G, F32 h0, F32 rstd_q,
                               F32 rstd_k, ChunkTable chunks, SegmentTable segs, S32 seg_order,
                               Scale scale, ColumnTiles column_tiles, Ret<BF16> A,
                               Ret<S32> a_ready, Ret<ffi::AnyBuffer> o, Ret<F32> final_state,
                               ffi::RemainingRets tapes) {
  bf16* tape[3] = {nullptr, nullptr, nullptr};
  JCG_RETURN_IF_ERROR(walk_tapes(stream, tapes, tape));
  JCG_CHECK_CUDA(poison_all(stream, *o, *final_state, *A));
  const int64_t chains = segs.count() * beta.dimensions()[1];
  const int tiles = walk_column_tiles(chains, v.dimensions()[2], *column_tiles);
  const int64_t walk_ctas = chains * tiles;
  const bool behind = pdl_enabled() && q.element_type() == ffi::DataType::BF16 &&
                      chunks.count() > 0 && chains > 0 && 2 * chains <= sm_count();
  int32_t* flags = nullptr;
  if (behind) {
    flags = a_ready->typed_data();
    JCG_CHECK_CUDA(cudaMemsetAsync(flags, 0, a_ready->size_bytes(), stream));
  }
  // nothing may run between the two launches: the walk's early start pairs with solve_a
  JCG_RETURN_IF_ERROR(launch_solve_a(stream, k, beta, G, rstd_k, chunks, *A, flags,
                                     static_cast<int>(walk_ctas)));
  return launch_walk_output(stream, q, k, v, beta, *A, G, h0, rstd_q, rstd_k, chunks, segs,
                            seg_order, *scale, tiles, *o, *final_state, tape, flags);
}

ffi::Error replay(cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v, F32 beta, BF16 A,
                  F32 G, F32 h0, F32 rstd_k, ChunkTable chunks, SegmentTable segs, S32 seg_order,
                  ColumnTiles column_tiles, Ret<BF16> h, Ret<BF16> v_new, Ret<BF16> w,
                  Ret<F32> final_state) {
  JCG_CHECK_CUDA(poison_all(stream, *h, *v_new, *w, *final_state));
  return dispatch(
      [&](auto in, auto kd, auto vd) {  // column tiles as walk_output's
        using In = typename decltype(in)::type;
        auto a = walk_args<In, bf16>(k, G, h0, rstd_k, chunks, segs, seg_order.typed_data(),
                                     final_state->typed_data());
        a.v = data<In>(v);
        a.beta = beta.typed_data();
        a.A = static_cast<const bf16*>(A.untyped_data());
        a.h = static_cast<bf16*>(h->untyped_data());
        a.v_new = static_cast<bf16*>(v_new->untyped_data());
        a.w_out = static_cast<bf16*>(w->untyped_data());
        constexpr int VD = decltype(vd)::value;
        return run_walk_tiled<WalkMode::kReplay, decltype(kd)::value, VD>(
            a, segs, stream, walk_column_tiles(segs.count() * a.HV, VD, *column_tiles));
      },
      FloatType{k.element_type()}, HeadDim{k.dimensions()[2]}, HeadDim{v.dimensions()[2]});
}

}  // namespace
}  // namespace jax_cake_gdn

JCG_FFI_HANDLER(state_walk, jax_cake_gdn::state_walk)
JCG_FFI_HANDLER(walk_output, jax_cake_gdn::walk_output)
JCG_FFI_HANDLER(walk_output_tapes, jax_cake_gdn::walk_output)
JCG_FFI_HANDLER(replay, jax_cake_gdn::replay)
JCG_FFI_HANDLER(solve_a_walk_output, jax_cake_gdn::solve_a_walk_output)
JCG_FFI_HANDLER(solve_a_walk_output_tapes, jax_cake_gdn::solve_a_walk_output)
