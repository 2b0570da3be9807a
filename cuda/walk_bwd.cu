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
// dfinal f32[S, HV, K, V]; rstd_q, rstd_k f32[T, H] or f32[1]; chunk and segment tables int32
// (chunks.py). K in {64, 128}, V in {64, 128}.
//
//   jax_cake_gdn_transfer_bwd(q, k, w, G, do, dfinal, rstd_q, rstd_k, chunk_start, chunk_len,
//                             seg_first, seg_last, seg_len, unit_seg; scale) -> dh0 f32[U, HV,
//                             K, V]
//
// The backward twin of the units' summaries (transfer.cu): for each unit u, the gradient of
// segment unit_seg[u]'s entry state from its exit gradient dfinal[s] (the same reverse walk, no
// dS_end or dvn stored); unit_seg[u] = -1: zeros.
#include "bwd_plans.cuh"
#include "walk_bwd_wg.cuh"

namespace jax_cake_gdn {

// The V columns per CTA the dispatch picks (walk_bwd_wg.cuh): all of V, but 64 for f32 at
// K = V = 128.
static_assert(walk_bwd_wg_vt<bf16, 128, 128>() == 128 && walk_bwd_wg_vt<bf16, 64, 128>() == 128 &&
                  walk_bwd_wg_vt<float, 64, 128>() == 128 &&
                  walk_bwd_wg_vt<float, 128, 128>() == 64 &&
                  walk_bwd_wg_vt<bf16, 128, 64>() == 64 && walk_bwd_wg_vt<float, 128, 64>() == 64,
              "walk_bwd: unexpected VT choice");

namespace {

// walk_bwd (kTwin = false) and its state-only twin, transfer_bwd (kTwin: in.slots holds each
// unit's segment, dh0 is per unit, dS_end and dvn are null and not stored).
template <bool kTwin>
ffi::Error plan_walk(const WalkBwdIn& in, const BF16* dS_end, F32 dh0, const BF16* dvn,
                     KernelPlan& plan) {
  const auto qd = in.q.dimensions();
  const int64_t T = qd[0], H = qd[1], K = qd[2];
  const int64_t HV = in.dout.dimensions()[1], V = in.dout.dimensions()[2];
  const int64_t NC = in.chunks.count(), S = in.segs.count();
  const int64_t slots = in.slots.dimensions()[0];  // the walk: S segments; the twin: U units
  const FloatType in_type{in.q.element_type()};
  int64_t vt = 0;  // the dispatch's column tile
  JCG_RETURN_IF_ERROR(dispatch(
      [&](auto t, auto kd, auto vd) {
        vt = walk_bwd_wg_vt<typename decltype(t)::type, decltype(kd)::value,
                            decltype(vd)::value>();
        return ffi::Error::Success();
      },
      in_type, HeadDim{K}, HeadDim{V}));
  CUtensorMap dvn_map{}, dS_end_map{};
  bf16* dS_end_data = kTwin ? nullptr : static_cast<bf16*>(dS_end->untyped_data());
  bf16* dvn_data = kTwin ? nullptr : static_cast<bf16*>(dvn->untyped_data());
  // dvn as [NC * HV * 64 rows, V] and dS_end as [NC * HV * K rows, V]: the kernel stores one
  // 64-column box of each a (chunk, head, warpgroup)
  if (!kTwin && NC * HV > 0) {
    JCG_CHECK_MAP(make_tma_rows_bf16(&dvn_map, dvn_data, NC * HV * kChunk, V, kChunk), "dvn");
    JCG_CHECK_MAP(make_tma_state_rows_bf16(&dS_end_map, dS_end_data, NC, HV, K, V), "dS_end");
  }
  // bf16 inputs: the producer's TMA loads (f32: unused)
  WalkBwdLoadMaps lm{};
  if (in.q.element_type() == ffi::DataType::BF16 && T > 0) {
    JCG_CHECK_MAP(make_tma_token_rows(&lm.q, in.q.untyped_data(), T, H, K, true), "q");
    JCG_CHECK_MAP(make_tma_token_rows(&lm.k, in.k.untyped_data(), T, H, K, true), "k");
    JCG_CHECK_MAP(make_tma_token_rows(&lm.w, in.w.untyped_data(), T, HV, K, true), "w");
    JCG_CHECK_MAP(make_tma_token_rows(&lm.dout, in.dout.untyped_data(), T, HV, V, true), "do");
  }
  plan.ctas = slots * HV * (V / vt);
  plan.tiles = static_cast<int>(V / vt);
  plan.items = NC * HV;
  plan.prepare = [=](cudaStream_t stream) {
    JCG_CHECK_CUDA(poison(stream, dh0));
    if (!kTwin) {
      JCG_CHECK_CUDA(poison(stream, dS_end_data, NC * HV * K * V * sizeof(bf16)));
      JCG_CHECK_CUDA(poison(stream, dvn_data, NC * HV * kChunk * V * sizeof(bf16)));
    }
    return ffi::Error::Success();
  };
  plan.launch = [=](cudaStream_t stream, Handoff handoff) {
    return dispatch(
        [&](auto t, auto kd, auto vd) {
          using In = typename decltype(t)::type;
          constexpr int KD = decltype(kd)::value;
          // VT = V (one CTA per (segment, head)), except f32 at K = V = 128: VT = 64
          constexpr int VT = walk_bwd_wg_vt<In, KD, decltype(vd)::value>();
          const dim3 grid(static_cast<unsigned>(slots * HV * (V / VT)));
          return cuda_status(
              launch(walk_bwd_wg_kernel<In, KD, VT, kTwin>, grid, walk_bwd_wg_threads<VT>(),
                     WalkBwdWgSmem<KD, VT>::bytes, stream, data<In>(in.q), data<In>(in.k),
                     static_cast<const bf16*>(in.w.untyped_data()), in.G.typed_data(),
                     data<In>(in.dout), in.dfinal.typed_data(), optional_data(in.rstd_q),
                     optional_data(in.rstd_k), in.chunks.start.typed_data(),
                     in.chunks.len.typed_data(), in.segs.first.typed_data(),
                     in.segs.last.typed_data(), in.segs.len.typed_data(),
                     in.slots.typed_data(), dS_end_data, dS_end_map, dvn_data, dvn_map,
                     dh0.typed_data(), lm, T, static_cast<int>(H), static_cast<int>(HV),
                     static_cast<int>(V), static_cast<int>(NC), static_cast<int>(S), in.scale,
                     handoff),
              "walk_bwd_wg_kernel");
        },
        in_type, HeadDim{K}, HeadDim{V});
  };
  return ffi::Error::Success();
}

// A plan run alone (no hand-off).
ffi::Error run(KernelPlan& plan, cudaStream_t stream) {
  JCG_RETURN_IF_ERROR(plan.prepare(stream));
  return plan.launch(stream, Handoff{});
}

ffi::Error walk_bwd(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, BF16 w, F32 G,
                    ffi::AnyBuffer dout, F32 dfinal, F32 rstd_q, F32 rstd_k, ChunkTable chunks,
                    SegmentTable segs, S32 seg_order, Scale scale, Ret<BF16> dS_end,
                    Ret<F32> dh0, Ret<BF16> dvn) {
  KernelPlan plan;
  JCG_RETURN_IF_ERROR(plan_walk_bwd(
      {q, k, w, G, dout, dfinal, rstd_q, rstd_k, chunks, segs, seg_order, *scale}, *dS_end, *dh0,
      *dvn, plan));
  return run(plan, stream);
}

ffi::Error transfer_bwd(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, BF16 w, F32 G,
                        ffi::AnyBuffer dout, F32 dfinal, F32 rstd_q, F32 rstd_k,
                        ChunkTable chunks, SegmentTable segs, S32 unit_seg, Scale scale,
                        Ret<F32> dh0) {
  KernelPlan plan;
  JCG_RETURN_IF_ERROR(plan_walk<true>(
      {q, k, w, G, dout, dfinal, rstd_q, rstd_k, chunks, segs, unit_seg, *scale}, nullptr, *dh0,
      nullptr, plan));
  return run(plan, stream);
}

}  // namespace

ffi::Error plan_walk_bwd(const WalkBwdIn& in, BF16 dS_end, F32 dh0, BF16 dvn, KernelPlan& plan) {
  return plan_walk<false>(in, &dS_end, dh0, &dvn, plan);
}

}  // namespace jax_cake_gdn

JCG_FFI_HANDLER(walk_bwd, jax_cake_gdn::walk_bwd)
JCG_FFI_HANDLER(transfer_bwd, jax_cake_gdn::transfer_bwd)
