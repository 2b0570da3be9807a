// FFI handler of the chunk-parallel backward (kernel in chunk_bwd.cuh):
//
//   jax_cake_gdn_chunk_bwd(q, k, v, beta, G, A, h, v_new, dS_end, dvn, do, rstd_q, rstd_k,
//                          chunk_start, chunk_len; scale)
//       -> dQ, dK f32[T, HQ, K] (w.r.t. the normalised q / k: the caller applies the L2-norm
//          backward): HQ = HV gives them per value head (the caller sums the GVA groups), HQ = H
//          < HV has the kernel sum each group with f32 atomic adds into the zeroed outputs (the
//          order of the adds varies from run to run: not bitwise deterministic);
//          dV [T, HV, V] in v's dtype, dg f32[T, HV], dbeta f32[T, HV]
//
// q, k: bf16 or f32 [T, H, K]; v, do [T, HV, V] in q's dtype; beta, G f32[T, HV];
// A bf16[NC, HV, 64, 64] (as prep stores it); h, dS_end bf16[NC, HV, K, V] (the walks' bf16
// tapes); dvn bf16[NC, HV, 64, V] (walk_bwd's); v_new bf16[T, HV, V] (the state walk's); rstd_q,
// rstd_k f32[T, H] or f32[1] (no L2 norm); chunk table int32 (chunks.py). K, V in {64, 128}.
// Every token row is written by its chunk; unused chunks (length 0) write nothing.
#include "bwd_plans.cuh"
#include "chunk_bwd.cuh"
#include "handler.cuh"

#define JCG_HANDLER_NAME "jax_cake_gdn_chunk_bwd"

namespace jax_cake_gdn {

ffi::Error plan_chunk_bwd(ffi::AnyBuffer q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> G,
                          ffi::Buffer<ffi::BF16> A, ffi::Buffer<ffi::BF16> h,
                          ffi::Buffer<ffi::BF16> v_new, ffi::Buffer<ffi::BF16> dS_end,
                          ffi::Buffer<ffi::BF16> dvn, ffi::AnyBuffer dout,
                          ffi::Buffer<ffi::F32> rstd_q, ffi::Buffer<ffi::F32> rstd_k,
                          ffi::Buffer<ffi::S32> chunk_start, ffi::Buffer<ffi::S32> chunk_len,
                          float scale, ffi::Buffer<ffi::F32> dQ, ffi::Buffer<ffi::F32> dK,
                          ffi::AnyBuffer dV, ffi::Buffer<ffi::F32> dg,
                          ffi::Buffer<ffi::F32> dbeta, KernelPlan& plan) {
  JCG_CHECK_MSG(check_q_k(q, k));
  const auto qd = q.dimensions();
  const int64_t T = qd[0], H = qd[1], K = qd[2];
  int64_t HV, V;
  JCG_CHECK_MSG(check_tokens_v("v", v, "q", q.element_type(), T, HV, V));
  JCG_CHECK_MSG(check_heads(H, HV));
  const auto vd = v.dimensions();
  JCG_CHECK_ARG(dout.dimensions() == vd, "do must have v's shape " + dims_str(vd) + ", got " +
                                             dims_str(dout.dimensions()));
  JCG_CHECK_ARG(dout.element_type() == q.element_type(),
                std::string("do must have q's dtype ") + dtype_name(q.element_type()) + ", got " +
                    dtype_name(dout.element_type()));
  JCG_CHECK_MSG(check_th("beta", beta.dimensions(), T, HV));
  JCG_CHECK_MSG(check_th("G", G.dimensions(), T, HV));
  JCG_CHECK_ARG(dims_are(v_new.dimensions(), {T, HV, V}),
                "v_new must be bf16[T, HV, V], got shape " + dims_str(v_new.dimensions()));
  bool has_rq = false, has_rk = false;
  JCG_CHECK_MSG(check_rstd("rstd_q", rstd_q.dimensions(), T, H, has_rq));
  JCG_CHECK_MSG(check_rstd("rstd_k", rstd_k.dimensions(), T, H, has_rk));
  JCG_CHECK_MSG(check_table(chunk_start.dimensions(), chunk_len.dimensions()));
  const int64_t NC = chunk_start.dimensions()[0];
  JCG_CHECK_ARG(NC * HV < (int64_t{1} << 31), "NC * HV too large");
  JCG_CHECK_ARG(dims_are(A.dimensions(), {NC, HV, kChunk, kChunk}),
                "A must be bf16[NC, HV, 64, 64], got shape " + dims_str(A.dimensions()));
  JCG_CHECK_ARG(dims_are(h.dimensions(), {NC, HV, K, V}),
                "h must be bf16[NC, HV, K, V], got shape " + dims_str(h.dimensions()));
  JCG_CHECK_ARG(dims_are(dS_end.dimensions(), {NC, HV, K, V}),
                "dS_end must be bf16[NC, HV, K, V], got shape " + dims_str(dS_end.dimensions()));
  JCG_CHECK_ARG(dims_are(dvn.dimensions(), {NC, HV, kChunk, V}),
                "dvn must be bf16[NC, HV, 64, V], got shape " + dims_str(dvn.dimensions()));
  const int64_t HQ = dQ.dimensions().size() == 3 ? dQ.dimensions()[1] : -1;
  JCG_CHECK_ARG((HQ == HV || HQ == H) && dims_are(dQ.dimensions(), {T, HQ, K}),
                "dQ must be f32[T, HV, K] or f32[T, H, K], got shape " +
                    dims_str(dQ.dimensions()));
  JCG_CHECK_ARG(dims_are(dK.dimensions(), {T, HQ, K}),
                "dK must have dQ's shape " + dims_str(dQ.dimensions()) + ", got " +
                    dims_str(dK.dimensions()));
  const bool sum_groups = HQ < HV;
  JCG_CHECK_ARG(dims_are(dV.dimensions(), {T, HV, V}),
                "dV must be [T, HV, V], got shape " + dims_str(dV.dimensions()));
  JCG_CHECK_ARG(dV.element_type() == v.element_type(),
                std::string("dV must have v's dtype ") + dtype_name(v.element_type()) + ", got " +
                    dtype_name(dV.element_type()));
  JCG_CHECK_MSG(check_th("dg", dg.dimensions(), T, HV));
  JCG_CHECK_MSG(check_th("dbeta", dbeta.dimensions(), T, HV));

  JCG_CHECK_ARG(NC * HV * K < (int64_t{1} << 31), "NC * HV * K must be below 2^31");
  // dS_end as [NC * HV * K rows, V] and dvn as [NC * HV * 64 rows, V]: the kernel loads the
  // 64-column boxes of one (chunk, head)
  CUtensorMap dS_end_map{}, dvn_map{}, h_map{}, A_map{};
  if (NC * HV > 0) {
    std::string e = make_tma_state_rows_bf16(&dS_end_map, dS_end.untyped_data(), NC, HV, K, V);
    if (!e.empty()) return ffi::Error::Internal(JCG_HANDLER_NAME ": dS_end map: " + e);
    e = make_tma_rows_bf16(&dvn_map, dvn.untyped_data(), NC * HV * kChunk, V, kChunk);
    if (!e.empty()) return ffi::Error::Internal(JCG_HANDLER_NAME ": dvn map: " + e);
    e = make_tma_state_rows_bf16(&h_map, h.untyped_data(), NC, HV, K, V);
    if (!e.empty()) return ffi::Error::Internal(JCG_HANDLER_NAME ": h map: " + e);
    e = make_tma_rows_bf16(&A_map, A.untyped_data(), NC * HV * kChunk, kChunk, kChunk);
    if (!e.empty()) return ffi::Error::Internal(JCG_HANDLER_NAME ": A map: " + e);
  }
  plan.ctas = NC * HV;
  plan.items = NC * HV;
  if (sum_groups) {
    plan.sums_dq = dQ.typed_data();
    plan.sums_dk = dK.typed_data();
  }
  plan.prepare = [=](cudaStream_t stream, bool zero_sums) {
    cudaError_t e = cudaSuccess;
    if (sum_groups && zero_sums) {  // the kernel adds every value head's rows into them
      e = cudaMemsetAsync(dQ.untyped_data(), 0, dQ.size_bytes(), stream);
      if (e == cudaSuccess) e = cudaMemsetAsync(dK.untyped_data(), 0, dK.size_bytes(), stream);
    } else {
      e = poison(stream, dQ);
      if (e == cudaSuccess) e = poison(stream, dK);
    }
    if (e == cudaSuccess) e = poison(stream, dV.untyped_data(), dV.size_bytes());
    if (e == cudaSuccess) e = poison(stream, dg);
    if (e == cudaSuccess) e = poison(stream, dbeta);
    return e;
  };
  plan.launch = [=](cudaStream_t stream, Handoff handoff) {
    if (NC == 0 || HV == 0 || T == 0) return cudaSuccess;
    cudaError_t err = cudaSuccess;
    dispatch_float_type(q.element_type(), [&](auto tag) {
      using In = typename decltype(tag)::type;
      dispatch_head_dim(K, [&](auto kdim) {
        constexpr int KD = decltype(kdim)::value;
        dispatch_head_dim(V, [&](auto vdim) {
          constexpr int VD = decltype(vdim)::value;
          // behind the walk (hand-off): may start while it runs (programmatic dependent launch)
          err = launch(handoff.data != nullptr && pdl_enabled(), chunk_bwd_kernel<In, KD, VD>,
                       dim3(static_cast<unsigned>(NC * HV)), kCbThreads,
                       ChunkBwdSmem<In, KD, VD>::bytes, stream,
                       static_cast<const In*>(q.untyped_data()),
                       static_cast<const In*>(k.untyped_data()),
                       static_cast<const In*>(v.untyped_data()), beta.typed_data(),
                       G.typed_data(), A_map, h_map,
                       static_cast<const bf16*>(v_new.untyped_data()),
                       dS_end_map, dvn_map,
                       static_cast<const In*>(dout.untyped_data()),
                       has_rq ? rstd_q.typed_data() : static_cast<const float*>(nullptr),
                       has_rk ? rstd_k.typed_data() : static_cast<const float*>(nullptr),
                       chunk_start.typed_data(), chunk_len.typed_data(), dQ.typed_data(),
                       dK.typed_data(), static_cast<In*>(dV.untyped_data()), dg.typed_data(),
                       dbeta.typed_data(), T, static_cast<int>(H), static_cast<int>(HV),
                       sum_groups, scale, handoff);
        });
      });
    });
    return err;
  };
  return ffi::Error::Success();
}

namespace {

ffi::Error chunk_bwd_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> G,
                          ffi::Buffer<ffi::BF16> A, ffi::Buffer<ffi::BF16> h,
                          ffi::Buffer<ffi::BF16> v_new, ffi::Buffer<ffi::BF16> dS_end,
                          ffi::Buffer<ffi::BF16> dvn, ffi::AnyBuffer dout,
                          ffi::Buffer<ffi::F32> rstd_q, ffi::Buffer<ffi::F32> rstd_k,
                          ffi::Buffer<ffi::S32> chunk_start, ffi::Buffer<ffi::S32> chunk_len,
                          float scale,
                          ffi::ResultBuffer<ffi::F32> dQ, ffi::ResultBuffer<ffi::F32> dK,
                          ffi::Result<ffi::AnyBuffer> dV, ffi::ResultBuffer<ffi::F32> dg,
                          ffi::ResultBuffer<ffi::F32> dbeta) {
  KernelPlan plan;
  ffi::Error e = plan_chunk_bwd(q, k, v, beta, G, A, h, v_new, dS_end, dvn, dout, rstd_q, rstd_k,
                                chunk_start, chunk_len, scale, *dQ, *dK, *dV, *dg, *dbeta, plan);
  if (e.failure()) return e;
  JCG_CHECK_CUDA(plan.prepare(stream, true));
  JCG_CHECK_CUDA(plan.launch(stream, Handoff{}));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cake_gdn

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cake_gdn_chunk_bwd, jax_cake_gdn::chunk_bwd_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // q
                                  .Arg<xla::ffi::AnyBuffer>()              // k
                                  .Arg<xla::ffi::AnyBuffer>()              // v
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // beta
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // G
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // A
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // h
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // v_new
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // dS_end
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // dvn
                                  .Arg<xla::ffi::AnyBuffer>()              // do
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // rstd_q
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // rstd_k
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // chunk_start
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // chunk_len
                                  .Attr<float>("scale")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // dQ
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // dK
                                  .Ret<xla::ffi::AnyBuffer>()              // dV
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // dg
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // dbeta
                              {xla::ffi::Traits::kCmdBufferCompatible});
