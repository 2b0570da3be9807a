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
#include "handoff.cuh"

#define JCG_HANDLER_NAME "jax_cake_gdn_walk_chunk_bwd"

namespace jax_cake_gdn {
namespace {

ffi::Error walk_chunk_bwd_impl(
    cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
    ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::BF16> w, ffi::Buffer<ffi::F32> G,
    ffi::Buffer<ffi::BF16> A, ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::BF16> v_new,
    ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> dfinal, ffi::Buffer<ffi::F32> rstd_q,
    ffi::Buffer<ffi::F32> rstd_k, ffi::Buffer<ffi::S32> chunk_start,
    ffi::Buffer<ffi::S32> chunk_len, ffi::Buffer<ffi::S32> seg_first,
    ffi::Buffer<ffi::S32> seg_last, ffi::Buffer<ffi::S32> seg_len,
    ffi::Buffer<ffi::S32> seg_order, float scale, ffi::ResultBuffer<ffi::BF16> dS_end,
    ffi::ResultBuffer<ffi::F32> dh0, ffi::ResultBuffer<ffi::BF16> dvn,
    ffi::ResultBuffer<ffi::F32> dQ, ffi::ResultBuffer<ffi::F32> dK,
    ffi::Result<ffi::AnyBuffer> dV, ffi::ResultBuffer<ffi::F32> dg,
    ffi::ResultBuffer<ffi::F32> dbeta, ffi::ResultBuffer<ffi::S32> handoff) {
  KernelPlan walk, chunks;
  ffi::Error e = plan_walk_bwd(q, k, w, G, dout, dfinal, rstd_q, rstd_k, chunk_start,
                               chunk_len, seg_first, seg_last, seg_len, seg_order, scale,
                               *dS_end, *dh0, *dvn, walk);
  if (e.failure()) return e;
  e = plan_chunk_bwd(q, k, v, beta, G, A, h, v_new, *dS_end, *dvn, dout, rstd_q, rstd_k,
                     chunk_start, chunk_len, scale, *dQ, *dK, *dV, *dg, *dbeta, chunks);
  if (e.failure()) return e;
  const int64_t n = handoff_ints(walk.items);
  JCG_CHECK_ARG(handoff->dimensions().size() == 1 && handoff->dimensions()[0] == n,
                "handoff must be int32[" + std::to_string(n) + "], got shape " +
                    dims_str(handoff->dimensions()));
  JCG_CHECK_ARG(walk.ctas < (int64_t{1} << 31), "too many walk CTAs");
  // Everything the two kernels need before the walk starts: nothing may run between them. The
  // atomic group sums are zeroed by the walk, not by memsets here.
  JCG_CHECK_CUDA(cudaMemsetAsync(handoff->untyped_data(), 0, handoff->size_bytes(), stream));
  JCG_CHECK_CUDA(chunks.prepare(stream, false));
  JCG_CHECK_CUDA(walk.prepare(stream, false));
  const Handoff hand{handoff->typed_data(), static_cast<int>(walk.ctas), walk.tiles,
                     chunks.sums_dq, chunks.sums_dk};
  JCG_CHECK_CUDA(walk.launch(stream, hand));
  JCG_CHECK_CUDA(chunks.launch(stream, hand));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cake_gdn

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cake_gdn_walk_chunk_bwd, jax_cake_gdn::walk_chunk_bwd_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // q
                                  .Arg<xla::ffi::AnyBuffer>()              // k
                                  .Arg<xla::ffi::AnyBuffer>()              // v
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // beta
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // w
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // G
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // A
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // h
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // v_new
                                  .Arg<xla::ffi::AnyBuffer>()              // do
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // dfinal
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // rstd_q
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // rstd_k
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // chunk_start
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // chunk_len
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // seg_first
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // seg_last
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // seg_len
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // seg_order
                                  .Attr<float>("scale")
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // dS_end
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dh0
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // dvn
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dQ
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dK
                                  .Ret<xla::ffi::AnyBuffer>()              // dV
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dg
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // dbeta
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>(),  // handoff
                              {xla::ffi::Traits::kCmdBufferCompatible});
