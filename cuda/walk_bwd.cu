// FFI handlers of the backward state walk and of its state-only twin (kernel in walk_bwd_wg.cuh,
// on wgmma):
//
//   jax_cake_gdn_walk_bwd(q, k, w, G, do, dfinal, rstd_q, rstd_k, chunk_start, chunk_len,
//                         seg_first, seg_last, seg_len, seg_order; scale)
//       -> dS_end bf16[NC, HV, K, V] (rounded to nearest from the f32 carried gradient: chunk_bwd
//          uses it only as a bf16 operand), dh0 f32[S, HV, K, V], dvn bf16[NC, HV, 64, V] (the
//          gradient of each chunk's v_new, rows its tokens, padding rows 0: chunk_bwd's operand)
//
// q, k: bf16 or f32 [T, H, K]; w bf16[T, HV, K]; G f32[T, HV]; do [T, HV, V] in q's dtype;
// dfinal f32[S, HV, K, V]; rstd_q, rstd_k f32[T, H] or f32[1]; chunk and segment tables int32 (chunks.py). K in
// {64, 128}, V in {64, 128}.
//
//   jax_cake_gdn_transfer_bwd(q, k, w, G, do, dfinal, rstd_q, rstd_k, chunk_start, chunk_len,
//                             seg_first, seg_last, seg_len, unit_seg; scale) -> dh0 f32[U, HV,
//                             K, V]
//
// The backward twin of the units' summaries (transfer.cu): for each unit u, the gradient of
// segment unit_seg[u]'s entry state from its exit gradient dfinal[s] (the same reverse walk, no
// dS_end or dvn stored); unit_seg[u] = -1: zeros.
#include "bwd_plans.cuh"
#include "handler.cuh"
#include "walk_bwd_wg.cuh"

#define JCG_HANDLER_NAME "jax_cake_gdn_walk_bwd"

namespace jax_cake_gdn {

// The V columns per CTA the dispatch picks (walk_bwd_wg.cuh): all of V, but 64 for f32 at
// K = V = 128.
static_assert(walk_bwd_wg_vt<bf16, 128, 128>() == 128 && walk_bwd_wg_vt<bf16, 64, 128>() == 128 &&
                  walk_bwd_wg_vt<float, 64, 128>() == 128 &&
                  walk_bwd_wg_vt<float, 128, 128>() == 64 &&
                  walk_bwd_wg_vt<bf16, 128, 64>() == 64 && walk_bwd_wg_vt<float, 128, 64>() == 64,
              "walk_bwd: unexpected VT choice");

namespace {

// walk_bwd (kTwin = false) and its state-only twin, transfer_bwd (kTwin: seg_order holds each
// unit's segment, dh0 is per unit, dS_end and dvn are null and not stored).
template <bool kTwin>
ffi::Error plan_walk_bwd_wg(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::Buffer<ffi::BF16> w,
                            ffi::Buffer<ffi::F32> G, ffi::AnyBuffer dout,
                            ffi::Buffer<ffi::F32> dfinal, ffi::Buffer<ffi::F32> rstd_q, ffi::Buffer<ffi::F32> rstd_k,
                            ffi::Buffer<ffi::S32> chunk_start, ffi::Buffer<ffi::S32> chunk_len,
                            ffi::Buffer<ffi::S32> seg_first, ffi::Buffer<ffi::S32> seg_last,
                            ffi::Buffer<ffi::S32> seg_len, ffi::Buffer<ffi::S32> seg_order,
                            float scale, const ffi::Buffer<ffi::BF16>* dS_end,
                            ffi::Buffer<ffi::F32> dh0, const ffi::Buffer<ffi::BF16>* dvn,
                            KernelPlan& plan) {
#undef JCG_HANDLER_NAME
#define JCG_HANDLER_NAME (kTwin ? "jax_cake_gdn_transfer_bwd" : "jax_cake_gdn_walk_bwd")
  JCG_CHECK_MSG(check_q_k(q, k));
  const auto qd = q.dimensions();
  const int64_t T = qd[0], H = qd[1], K = qd[2];
  int64_t HV, V;
  JCG_CHECK_MSG(check_tokens_v("do", dout, "q", q.element_type(), T, HV, V));
  JCG_CHECK_MSG(check_heads(H, HV));
  JCG_CHECK_ARG(dims_are(w.dimensions(), {T, HV, K}),
                "w must be bf16[T, HV, K], got shape " + dims_str(w.dimensions()));
  JCG_CHECK_MSG(check_th("G", G.dimensions(), T, HV));
  bool has_rq = false, has_rk = false;
  JCG_CHECK_MSG(check_rstd("rstd_q", rstd_q.dimensions(), T, H, has_rq));
  JCG_CHECK_MSG(check_rstd("rstd_k", rstd_k.dimensions(), T, H, has_rk));
  JCG_CHECK_MSG(check_table(chunk_start.dimensions(), chunk_len.dimensions()));
  const int64_t NC = chunk_start.dimensions()[0];
  JCG_CHECK_MSG(check_segments(seg_first.dimensions(), seg_last.dimensions(),
                               seg_len.dimensions(),
                               kTwin ? seg_len.dimensions() : seg_order.dimensions()));
  const int64_t S = seg_len.dimensions()[0];
  const auto od = seg_order.dimensions();
  JCG_CHECK_ARG(od.size() == 1 && od[0] >= 1,
                std::string(kTwin ? "unit_seg" : "seg_order") + " must be int32[n], got shape " +
                    dims_str(od));
  const int64_t slots = od[0];  // the walk: S segments; the twin: U units
  JCG_CHECK_ARG(slots * HV * (V / 64) < (int64_t{1} << 31), "U * HV too large");
  JCG_CHECK_ARG(S * HV * (V / 64) < (int64_t{1} << 31), "S * HV too large");
  JCG_CHECK_ARG(dims_are(dfinal.dimensions(), {S, HV, K, V}),
                "dfinal must be f32[S, HV, K, V], got shape " + dims_str(dfinal.dimensions()));
  JCG_CHECK_ARG(dims_are(dh0.dimensions(), {slots, HV, K, V}),
                std::string("dh0 must be f32[") + (kTwin ? "U" : "S") +
                    ", HV, K, V], got shape " + dims_str(dh0.dimensions()));
  CUtensorMap dvn_map{}, dS_end_map{};
  bf16* dS_end_data = nullptr;
  bf16* dvn_data = nullptr;
  if constexpr (!kTwin) {
    JCG_CHECK_ARG(dims_are(dS_end->dimensions(), {NC, HV, K, V}),
                  "dS_end must be bf16[NC, HV, K, V], got shape " +
                      dims_str(dS_end->dimensions()));
    JCG_CHECK_ARG(dims_are(dvn->dimensions(), {NC, HV, kChunk, V}),
                  "dvn must be bf16[NC, HV, 64, V], got shape " + dims_str(dvn->dimensions()));
    JCG_CHECK_ARG(NC * HV * K < (int64_t{1} << 31), "NC * HV * K must be below 2^31");
    dS_end_data = static_cast<bf16*>(dS_end->untyped_data());
    dvn_data = static_cast<bf16*>(dvn->untyped_data());
    // dvn as [NC * HV * 64 rows, V] and dS_end as [NC * HV * K rows, V]: the kernel stores one
    // 64-column box of each a (chunk, head, warpgroup)
    if (NC * HV > 0) {
      std::string e = make_tma_rows_bf16(&dvn_map, dvn_data, NC * HV * kChunk, V, kChunk);
      if (!e.empty())
        return ffi::Error::Internal(std::string(JCG_HANDLER_NAME) + ": dvn map: " + e);
      e = make_tma_state_rows_bf16(&dS_end_map, dS_end_data, NC, HV, K, V);
      if (!e.empty())
        return ffi::Error::Internal(std::string(JCG_HANDLER_NAME) + ": dS_end map: " + e);
    }
  }

  int64_t vt = 0;  // the dispatch's column tile
  dispatch_float_type(q.element_type(), [&](auto tag) {
    dispatch_head_dim(K, [&](auto kdim) {
      dispatch_head_dim(V, [&](auto vdim) {
        vt = walk_bwd_wg_vt<typename decltype(tag)::type, decltype(kdim)::value,
                            decltype(vdim)::value>();
      });
    });
  });
  plan.ctas = slots * HV * (V / vt);
  plan.tiles = static_cast<int>(V / vt);
  plan.items = NC * HV;
  plan.prepare = [=](cudaStream_t stream, bool) {
    cudaError_t e = poison(stream, dh0);
    if (e == cudaSuccess && !kTwin) e = poison(stream, dS_end_data, NC * HV * K * V * 2);
    if (e == cudaSuccess && !kTwin) e = poison(stream, dvn_data, NC * HV * kChunk * V * 2);
    return e;
  };
  plan.launch = [=](cudaStream_t stream, Handoff handoff) {
    cudaError_t err = cudaSuccess;
    dispatch_float_type(q.element_type(), [&](auto tag) {
      using In = typename decltype(tag)::type;
      dispatch_head_dim(K, [&](auto kdim) {
        constexpr int KD = decltype(kdim)::value;
        dispatch_head_dim(V, [&](auto vdim) {
          // VT = V (one CTA per (segment, head)), except f32 at K = V = 128: VT = 64
          constexpr int VT = walk_bwd_wg_vt<In, KD, decltype(vdim)::value>();
          const dim3 grid(static_cast<unsigned>(slots * HV * (V / VT)));
          auto run = [&](auto kernel, size_t smem) {
            err = launch(kernel, grid, walk_bwd_wg_threads<VT>(), smem, stream,
                         static_cast<const In*>(q.untyped_data()),
                         static_cast<const In*>(k.untyped_data()),
                         static_cast<const bf16*>(w.untyped_data()), G.typed_data(),
                         static_cast<const In*>(dout.untyped_data()), dfinal.typed_data(),
                         has_rq ? rstd_q.typed_data() : static_cast<const float*>(nullptr),
                         has_rk ? rstd_k.typed_data() : static_cast<const float*>(nullptr),
                         chunk_start.typed_data(), chunk_len.typed_data(),
                         seg_first.typed_data(), seg_last.typed_data(), seg_len.typed_data(),
                         seg_order.typed_data(),
                         dS_end_data, dS_end_map, dvn_data, dvn_map, dh0.typed_data(), T,
                         static_cast<int>(H), static_cast<int>(HV), static_cast<int>(V),
                         static_cast<int>(NC), static_cast<int>(S), scale, handoff);
          };
          run(walk_bwd_wg_kernel<In, KD, VT, kTwin>, WalkBwdWgSmem<KD, VT>::bytes);
        });
      });
    });
    return err;
  };
  return ffi::Error::Success();
#undef JCG_HANDLER_NAME
#define JCG_HANDLER_NAME "jax_cake_gdn_walk_bwd"
}

}  // namespace

ffi::Error plan_walk_bwd(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::Buffer<ffi::BF16> w,
                         ffi::Buffer<ffi::F32> G, ffi::AnyBuffer dout,
                         ffi::Buffer<ffi::F32> dfinal, ffi::Buffer<ffi::F32> rstd_q,
                         ffi::Buffer<ffi::F32> rstd_k,
                         ffi::Buffer<ffi::S32> chunk_start, ffi::Buffer<ffi::S32> chunk_len,
                         ffi::Buffer<ffi::S32> seg_first, ffi::Buffer<ffi::S32> seg_last,
                         ffi::Buffer<ffi::S32> seg_len, ffi::Buffer<ffi::S32> seg_order,
                         float scale, ffi::Buffer<ffi::BF16> dS_end, ffi::Buffer<ffi::F32> dh0,
                         ffi::Buffer<ffi::BF16> dvn, KernelPlan& plan) {
  return plan_walk_bwd_wg<false>(q, k, w, G, dout, dfinal, rstd_q, rstd_k, chunk_start,
                                 chunk_len, seg_first, seg_last, seg_len, seg_order, scale,
                                 &dS_end, dh0, &dvn, plan);
}

namespace {

ffi::Error walk_bwd_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                         ffi::Buffer<ffi::BF16> w, ffi::Buffer<ffi::F32> G, ffi::AnyBuffer dout,
                         ffi::Buffer<ffi::F32> dfinal, ffi::Buffer<ffi::F32> rstd_q, ffi::Buffer<ffi::F32> rstd_k,
                         ffi::Buffer<ffi::S32> chunk_start, ffi::Buffer<ffi::S32> chunk_len,
                         ffi::Buffer<ffi::S32> seg_first, ffi::Buffer<ffi::S32> seg_last,
                         ffi::Buffer<ffi::S32> seg_len, ffi::Buffer<ffi::S32> seg_order,
                         float scale,
                         ffi::ResultBuffer<ffi::BF16> dS_end, ffi::ResultBuffer<ffi::F32> dh0,
                         ffi::ResultBuffer<ffi::BF16> dvn) {
  KernelPlan plan;
  ffi::Error e = plan_walk_bwd(q, k, w, G, dout, dfinal, rstd_q, rstd_k, chunk_start,
                               chunk_len, seg_first, seg_last, seg_len, seg_order, scale,
                               *dS_end, *dh0, *dvn, plan);
  if (e.failure()) return e;
  JCG_CHECK_CUDA(plan.prepare(stream, true));
  JCG_CHECK_CUDA(plan.launch(stream, Handoff{}));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cake_gdn

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cake_gdn_walk_bwd, jax_cake_gdn::walk_bwd_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // q
                                  .Arg<xla::ffi::AnyBuffer>()              // k
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // w
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // G
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
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>(),  // dvn
                              {xla::ffi::Traits::kCmdBufferCompatible});

#undef JCG_HANDLER_NAME
#define JCG_HANDLER_NAME "jax_cake_gdn_transfer_bwd"

namespace jax_cake_gdn {
namespace {

ffi::Error transfer_bwd_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                             ffi::Buffer<ffi::BF16> w, ffi::Buffer<ffi::F32> G,
                             ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> dfinal,
                             ffi::Buffer<ffi::F32> rstd_q, ffi::Buffer<ffi::F32> rstd_k,
                             ffi::Buffer<ffi::S32> chunk_start, ffi::Buffer<ffi::S32> chunk_len,
                             ffi::Buffer<ffi::S32> seg_first, ffi::Buffer<ffi::S32> seg_last,
                             ffi::Buffer<ffi::S32> seg_len, ffi::Buffer<ffi::S32> unit_seg,
                             float scale, ffi::ResultBuffer<ffi::F32> dh0) {
  KernelPlan plan;
  ffi::Error e = plan_walk_bwd_wg<true>(q, k, w, G, dout, dfinal, rstd_q, rstd_k,
                                        chunk_start, chunk_len, seg_first, seg_last, seg_len,
                                        unit_seg, scale, nullptr, *dh0, nullptr, plan);
  if (e.failure()) return e;
  JCG_CHECK_CUDA(plan.prepare(stream, true));
  JCG_CHECK_CUDA(plan.launch(stream, Handoff{}));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cake_gdn

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cake_gdn_transfer_bwd, jax_cake_gdn::transfer_bwd_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()               // q
                                  .Arg<xla::ffi::AnyBuffer>()               // k
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // w
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // G
                                  .Arg<xla::ffi::AnyBuffer>()               // do
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // dfinal
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // rstd_q
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // rstd_k
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // chunk_start
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // chunk_len
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // seg_first
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // seg_last
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // seg_len
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // unit_seg
                                  .Attr<float>("scale")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // dh0
                              {xla::ffi::Traits::kCmdBufferCompatible});
