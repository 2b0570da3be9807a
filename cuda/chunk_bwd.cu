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

namespace jax_cake_gdn {

ffi::Error plan_chunk_bwd(const ChunkBwdIn& in, const ChunkBwdOut& out, KernelPlan& plan) {
  const auto qd = in.q.dimensions();
  const int64_t T = qd[0], H = qd[1], K = qd[2];
  const int64_t HV = in.v.dimensions()[1], V = in.v.dimensions()[2], NC = in.chunks.count();
  const bool sum_groups = out.dQ.dimensions()[1] < HV;  // dQ, dK f32[T, H, K]
  // dS_end, h as [NC * HV * K rows, V], dvn as [NC * HV * 64 rows, V], A as [NC * HV * 64, 64]:
  // the kernel loads the 64-column boxes of one (chunk, head)
  CUtensorMap dS_end_map{}, dvn_map{}, h_map{}, A_map{}, dQ_map{}, dK_map{}, dV_map{};
  if (NC * HV > 0) {
    JCG_CHECK_MAP(make_tma_state_rows_bf16(&dS_end_map, in.dS_end.untyped_data(), NC, HV, K, V),
                  "dS_end");
    JCG_CHECK_MAP(make_tma_rows_bf16(&dvn_map, in.dvn.untyped_data(), NC * HV * kChunk, V, kChunk),
                  "dvn");
    JCG_CHECK_MAP(make_tma_state_rows_bf16(&h_map, in.h.untyped_data(), NC, HV, K, V), "h");
    JCG_CHECK_MAP(
        make_tma_rows_bf16(&A_map, in.A.untyped_data(), NC * HV * kChunk, kChunk, kChunk), "A");
  }
  if (T > 0) {  // full chunks' dQ, dK (stored, or added with sum_groups), dV rows leave by TMA
    const int64_t HQ = out.dQ.dimensions()[1];
    JCG_CHECK_MAP(make_tma_token_rows(&dQ_map, out.dQ.untyped_data(), T, HQ, K), "dQ");
    JCG_CHECK_MAP(make_tma_token_rows(&dK_map, out.dK.untyped_data(), T, HQ, K), "dK");
    JCG_CHECK_MAP(make_tma_token_rows(&dV_map, out.dV.untyped_data(), T, HV, V,
                                      out.dV.element_type() == ffi::DataType::BF16),
                  "dV");
  }
  plan.ctas = NC * HV;
  plan.items = NC * HV;
  plan.prepare = [=](cudaStream_t stream) {
    ChunkBwdOut o = out;
    if (sum_groups) {  // the kernel adds every value head's rows into them
      JCG_CHECK_CUDA(cudaMemsetAsync(o.dQ.untyped_data(), 0, o.dQ.size_bytes(), stream));
      JCG_CHECK_CUDA(cudaMemsetAsync(o.dK.untyped_data(), 0, o.dK.size_bytes(), stream));
    } else {
      JCG_CHECK_CUDA(poison_all(stream, o.dQ, o.dK));
    }
    JCG_CHECK_CUDA(poison_all(stream, o.dV, o.dg, o.dbeta));
    return ffi::Error::Success();
  };
  plan.launch = [=](cudaStream_t stream, Handoff handoff) {
    if (NC == 0 || HV == 0 || T == 0) return ffi::Error::Success();
    return dispatch(
        [&](auto t, auto kd, auto vd) {
          using In = typename decltype(t)::type;
          constexpr int KD = decltype(kd)::value, VD = decltype(vd)::value;
          ChunkBwdOut o = out;
          // behind the walk (hand-off): may start while it runs (programmatic dependent launch)
          return cuda_status(
              launch(handoff.data != nullptr && pdl_enabled(), chunk_bwd_kernel<In, KD, VD>,
                     dim3(static_cast<unsigned>(NC * HV)), kCbThreads,
                     ChunkBwdSmem<In, KD, VD>::bytes, stream, data<In>(in.q), data<In>(in.k),
                     data<In>(in.v), in.beta.typed_data(), in.G.typed_data(), A_map, h_map,
                     static_cast<const bf16*>(in.v_new.untyped_data()), dS_end_map, dvn_map,
                     data<In>(in.dout), dQ_map, dK_map, dV_map, optional_data(in.rstd_q),
                     optional_data(in.rstd_k),
                     in.chunks.start.typed_data(), in.chunks.len.typed_data(),
                     o.dQ.typed_data(), o.dK.typed_data(), data<In>(o.dV), o.dg.typed_data(),
                     o.dbeta.typed_data(), T, static_cast<int>(H), static_cast<int>(HV),
                     sum_groups, in.scale, handoff),
              "chunk_bwd_kernel");
        },
        FloatType{in.q.element_type()}, HeadDim{K}, HeadDim{V});
  };
  return ffi::Error::Success();
}

namespace {

ffi::Error chunk_bwd(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                     F32 beta, F32 G, BF16 A, BF16 h, BF16 v_new, BF16 dS_end, BF16 dvn,
                     ffi::AnyBuffer dout, F32 rstd_q, F32 rstd_k, ChunkTable chunks, Scale scale,
                     Ret<F32> dQ, Ret<F32> dK, Ret<ffi::AnyBuffer> dV, Ret<F32> dg,
                     Ret<F32> dbeta) {
  KernelPlan plan;
  JCG_RETURN_IF_ERROR(plan_chunk_bwd(
      {q, k, v, beta, G, A, h, v_new, dS_end, dvn, dout, rstd_q, rstd_k, chunks, *scale},
      {*dQ, *dK, *dV, *dg, *dbeta}, plan));
  JCG_RETURN_IF_ERROR(plan.prepare(stream));
  return plan.launch(stream, Handoff{});
}

}  // namespace
}  // namespace jax_cake_gdn

JCG_FFI_HANDLER(chunk_bwd, jax_cake_gdn::chunk_bwd)
