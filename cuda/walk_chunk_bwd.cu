// FFI handler of the reverse walk and the chunk gradients in one call (the kernels of
// walk_bwd.cu and chunk_bwd.cu; their checks and argument conventions):
//
//   jax_cake_gdn_walk_chunk_bwd(q, k, v, beta, w, G, A, h, v_new, do, dfinal, rstd_q, rstd_k,
//                               chunk_start, chunk_len, seg_first, seg_last, seg_len,
//                               seg_order; scale)
//       -> dS_end, dh0, dvn (walk_bwd's results), dQ, dK, dV, dg, dbeta (chunk_bwd's),
//          handoff int32[1 + NC HV] (scratch, handoff.cuh)
//
// chunk_bwd is launched behind the walk with programmatic dependent launch: its CTAs start on
// the SMs the walk's longest-first schedule leaves idle, last chunk first, each waiting for its
// item's dS_end and dvn (handoff.cuh). Each item is computed as chunk_bwd computes it alone, so
// every result is bit for bit the two calls' (dQ, dK with sum_groups: up to the order of the
// atomic adds, as there).
#include "bwd_plans.cuh"

namespace jax_cake_gdn {
namespace {

ffi::Error walk_chunk_bwd(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, F32 beta, BF16 w, F32 G, BF16 A, BF16 h, BF16 v_new,
                          ffi::AnyBuffer dout, F32 dfinal, F32 rstd_q, F32 rstd_k,
                          ChunkTable chunks, SegmentTable segs, S32 seg_order, Scale scale,
                          Ret<BF16> dS_end, Ret<F32> dh0, Ret<BF16> dvn, Ret<F32> dQ,
                          Ret<F32> dK, Ret<ffi::AnyBuffer> dV, Ret<F32> dg, Ret<F32> dbeta,
                          Ret<S32> handoff) {
  KernelPlan walk, chunk;
  JCG_RETURN_IF_ERROR(plan_walk_bwd(
      {q, k, w, G, dout, dfinal, rstd_q, rstd_k, chunks, segs, seg_order, *scale}, *dS_end, *dh0,
      *dvn, walk));
  JCG_RETURN_IF_ERROR(plan_chunk_bwd(
      {q, k, v, beta, G, A, h, v_new, *dS_end, *dvn, dout, rstd_q, rstd_k, chunks, *scale},
      {*dQ, *dK, *dV, *dg, *dbeta}, chunk));
  // Everything the two kernels need before the walk starts (the hand-off zeroed, the atomic
  // group sums too, by memsets: in the walk's producer the stores lengthened its chain): nothing
  // may run between them.
  JCG_CHECK_CUDA(cudaMemsetAsync(handoff->untyped_data(), 0, handoff->size_bytes(), stream));
  JCG_RETURN_IF_ERROR(chunk.prepare(stream));
  JCG_RETURN_IF_ERROR(walk.prepare(stream));
  const Handoff hand{handoff->typed_data(), static_cast<int>(walk.ctas), walk.tiles};
  JCG_RETURN_IF_ERROR(walk.launch(stream, hand));
  return chunk.launch(stream, hand);
}

}  // namespace
}  // namespace jax_cake_gdn

JCG_FFI_HANDLER(walk_chunk_bwd, jax_cake_gdn::walk_chunk_bwd)
