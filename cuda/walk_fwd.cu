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
//                            seg_first, seg_last, seg_len, seg_order; scale)
//       -> o [T, HV, V] (bf16 or f32, the result type chooses), final f32[S, HV, K, V]
//   jax_cake_gdn_walk_output_tapes(the same) -> o, final, h, v_new, w (replay's, bit for bit)
//
//   jax_cake_gdn_replay(k, v, beta, A, G, h0, rstd_k, chunk_start, chunk_len, seg_first,
//                       seg_last, seg_len, seg_order) -> h, v_new, w bf16[T, HV, K], final
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
// (segment-major, the segments in seg_order: chunks.py sorts them longest first).
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

// walk_output and walk_output_tapes (tapes: h, v_new, w; none for walk_output).
ffi::Error walk_output(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       F32 beta, BF16 A, F32 G, F32 h0, F32 rstd_q, F32 rstd_k, ChunkTable chunks,
                       SegmentTable segs, S32 seg_order, Scale scale, Ret<ffi::AnyBuffer> o,
                       Ret<F32> final_state, ffi::RemainingRets tapes) {
  const bool with_tapes = tapes.size() == 3;
  if (!with_tapes && !tapes.empty())
    return ffi::Error::InvalidArgument("expected 2 or 5 results");
  bf16 *h = nullptr, *v_new = nullptr, *w = nullptr;
  JCG_CHECK_CUDA(poison_all(stream, *o, *final_state));
  if (with_tapes) {
    bf16** out[3] = {&h, &v_new, &w};
    for (size_t i = 0; i < 3; ++i) {
      auto r = tapes.get<BF16>(i);
      if (r.has_error()) return r.error();
      JCG_CHECK_CUDA(poison(stream, **r));
      *out[i] = static_cast<bf16*>((*r)->untyped_data());
    }
  }
  return dispatch(
      [&](auto in, auto out, auto kd, auto vd) {  // one CTA covers all V columns
        using In = typename decltype(in)::type;
        using Out = typename decltype(out)::type;
        constexpr int KD = decltype(kd)::value, VD = decltype(vd)::value;
        auto a = walk_args<In, Out>(k, G, h0, rstd_k, chunks, segs, seg_order.typed_data(),
                                    final_state->typed_data());
        a.q = data<In>(q);
        a.v = data<In>(v);
        a.beta = beta.typed_data();
        a.A = static_cast<const bf16*>(A.untyped_data());
        a.rstd_q = optional_data(rstd_q);
        a.o = data<Out>(*o);
        a.scale = *scale;
        if (!with_tapes) return run_walk<WalkMode::kOut, KD, VD>(a, segs, stream);
        a.h = h;
        a.v_new = v_new;
        a.w_out = w;
        return run_walk<WalkMode::kOutTapes, KD, VD>(a, segs, stream);
      },
      FloatType{q.element_type()}, FloatType{o->element_type()}, HeadDim{q.dimensions()[2]},
      HeadDim{v.dimensions()[2]});
}

ffi::Error replay(cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v, F32 beta, BF16 A,
                  F32 G, F32 h0, F32 rstd_k, ChunkTable chunks, SegmentTable segs, S32 seg_order,
                  Ret<BF16> h, Ret<BF16> v_new, Ret<BF16> w, Ret<F32> final_state) {
  JCG_CHECK_CUDA(poison_all(stream, *h, *v_new, *w, *final_state));
  return dispatch(
      [&](auto in, auto kd, auto vd) {  // one CTA covers all V columns
        using In = typename decltype(in)::type;
        auto a = walk_args<In, bf16>(k, G, h0, rstd_k, chunks, segs, seg_order.typed_data(),
                                     final_state->typed_data());
        a.v = data<In>(v);
        a.beta = beta.typed_data();
        a.A = static_cast<const bf16*>(A.untyped_data());
        a.h = static_cast<bf16*>(h->untyped_data());
        a.v_new = static_cast<bf16*>(v_new->untyped_data());
        a.w_out = static_cast<bf16*>(w->untyped_data());
        return run_walk<WalkMode::kReplay, decltype(kd)::value, decltype(vd)::value>(a, segs,
                                                                                  stream);
      },
      FloatType{k.element_type()}, HeadDim{k.dimensions()[2]}, HeadDim{v.dimensions()[2]});
}

}  // namespace
}  // namespace jax_cake_gdn

JCG_FFI_HANDLER(state_walk, jax_cake_gdn::state_walk)
JCG_FFI_HANDLER(walk_output, jax_cake_gdn::walk_output)
JCG_FFI_HANDLER(walk_output_tapes, jax_cake_gdn::walk_output)
JCG_FFI_HANDLER(replay, jax_cake_gdn::replay)
