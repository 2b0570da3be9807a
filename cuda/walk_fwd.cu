// FFI handlers of the forward walks: the state walk, the light backward's replay and the fused
// walk + output (with or without tapes), one kernel template on Hopper wgmma (walk_fwd_wg.cuh):
//
//   jax_cake_gdn_state_walk(k, w, u, G, h0, rstd_k, chunk_start, chunk_len, seg_first, seg_last,
//                           seg_len, seg_order) -> h bf16[NC, HV, K, V], v_new bf16[T, HV, V],
//                                       final f32[S, HV, K, V]
//
// k: bf16 or f32 [T, H, K]; w bf16[T, HV, K]; u bf16[T, HV, V]; G f32[T, HV]; h0 f32[S, HV, K, V];
// rstd_k f32[T, H] or f32[1]; chunk and segment tables int32 (chunks.py). K, V in {64, 128}.
// The h tape and v_new are bf16: the f32 values rounded to nearest, the operands their readers
// (output, chunk_bwd) used to round them to themselves; the walk itself carries the state in f32.
//
//   jax_cake_gdn_walk_output(q, k, v, beta, A, G, h0, rstd_q, rstd_k, chunk_start, chunk_len,
//                            seg_first, seg_last, seg_len, seg_order; scale)
//       -> o [T, HV, V] (bf16 or f32, the result type chooses), final f32[S, HV, K, V]
//
//   jax_cake_gdn_replay(k, v, beta, A, G, h0, rstd_k, chunk_start, chunk_len, seg_first,
//                       seg_last, seg_len, seg_order) -> h, v_new, w bf16[T, HV, K], final
//
// The light backward's replay: state_walk on prep's w, u, made on chip from A (as prep makes
// them, bit for bit: bf16(A diag(beta e^G rstd)) times bf16 k, bf16(A diag(beta)) times bf16 v,
// in 4 k16 steps, rounded to bf16), and w written for walk_bwd (u is not needed after the walk).
//
// The light forward's walk: o = output(state_walk(...)) with w, u made on chip from A bf16[NC,
// HV, 64, 64] (solve_a's) and h, v_new kept there. q, k, v: same dtype (v [T, HV, V]); beta
// f32[T, HV]; rstd_q f32[T, H] or f32[1]; the rest as state_walk. bf16 q, k, v and A reach the
// kernel by TMA: the handler encodes their tensor maps (tma.cuh). Launch (all three): one CTA of
// V / 64 compute warpgroups and a producer warpgroup per (segment, value head), grid S x HV
// (segment-major, the segments in seg_order: chunks.py sorts them longest first).
#include "walk_fwd_launch.cuh"

#define JCG_HANDLER_NAME "jax_cake_gdn_state_walk"

namespace jax_cake_gdn {
namespace {

ffi::Error state_walk_impl(cudaStream_t stream, ffi::AnyBuffer k, ffi::Buffer<ffi::BF16> w,
                           ffi::Buffer<ffi::BF16> u, ffi::Buffer<ffi::F32> G,
                           ffi::Buffer<ffi::F32> h0, ffi::Buffer<ffi::F32> rstd_k,
                           ffi::Buffer<ffi::S32> chunk_start, ffi::Buffer<ffi::S32> chunk_len,
                           ffi::Buffer<ffi::S32> seg_first, ffi::Buffer<ffi::S32> seg_last,
                           ffi::Buffer<ffi::S32> seg_len, ffi::Buffer<ffi::S32> seg_order,
                           ffi::ResultBuffer<ffi::BF16> h,
                           ffi::ResultBuffer<ffi::BF16> v_new,
                           ffi::ResultBuffer<ffi::F32> final_state) {
  JCG_CHECK_MSG(check_qk("k", k));
  const auto kd = k.dimensions();
  const int64_t T = kd[0], H = kd[1], K = kd[2];
  const auto ud = u.dimensions();
  JCG_CHECK_ARG(ud.size() == 3 && ud[0] == T,
                "u must be bf16[T, HV, V], got shape " + dims_str(ud));
  const int64_t HV = ud[1], V = ud[2];
  JCG_CHECK_MSG(check_heads(H, HV));
  JCG_CHECK_MSG(check_v(V));
  JCG_CHECK_ARG(dims_are(w.dimensions(), {T, HV, K}),
                "w must be bf16[T, HV, K], got shape " + dims_str(w.dimensions()));
  int64_t NC, S;
  bool has_rstd = false;
  JCG_CHECK_MSG(check_walk_inputs(G, h0, rstd_k, chunk_start, chunk_len, seg_first, seg_last,
                                  seg_len, seg_order.dimensions(), T, H, HV, K, V, NC, S,
                                  has_rstd));
  JCG_CHECK_MSG(check_tapes(h->dimensions(), v_new->dimensions(), final_state->dimensions(), NC,
                            T, S, HV, K, V));

  JCG_CHECK_CUDA(poison(stream, *h));
  JCG_CHECK_CUDA(poison(stream, *v_new));
  JCG_CHECK_CUDA(poison(stream, *final_state));
  cudaError_t err = cudaSuccess;
  std::string map_err;
  dispatch_float_type(k.element_type(), [&](auto tag) {
    using In = typename decltype(tag)::type;
    dispatch_head_dim(K, [&](auto kdim) {
      constexpr int KD = decltype(kdim)::value;
      dispatch_head_dim(V, [&](auto vdim) {  // one CTA covers all V columns
        constexpr int VT = decltype(vdim)::value;
        auto a = walk_args<In, bf16>(k, G, h0, has_rstd ? rstd_k.typed_data() : nullptr,
                                     chunk_start, chunk_len, seg_first, seg_last, seg_len,
                                     seg_order.typed_data(), final_state->typed_data(), T, H, HV,
                                     NC);
        a.w = static_cast<const bf16*>(w.untyped_data());
        a.u = static_cast<const bf16*>(u.untyped_data());
        a.h = static_cast<bf16*>(h->untyped_data());
        a.v_new = static_cast<bf16*>(v_new->untyped_data());
        if constexpr (std::is_same_v<In, bf16>) {  // the producer's TMA loads of k, w, u
          map_err = token_map(&a.tm_k, a.k, T, H, KD);
          if (map_err.empty()) map_err = token_map(&a.tm_w, a.w, T, HV, KD);
          if (map_err.empty()) map_err = token_map(&a.tm_u, a.u, T, HV, VT);
          if (!map_err.empty()) return;
        }
        err = launch_walk<WalkMode::kTapes, In, bf16, KD, VT>(a, S, stream);
      });
    });
  });
  if (!map_err.empty()) return ffi::Error::Internal(JCG_HANDLER_NAME ": " + map_err);
  JCG_CHECK_CUDA(err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cake_gdn

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cake_gdn_state_walk, jax_cake_gdn::state_walk_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // k
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // w
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // u
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // G
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // h0
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // rstd_k
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // chunk_start
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // chunk_len
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // seg_first
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // seg_last
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // seg_len
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // seg_order
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // h
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // v_new
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // final
                              {xla::ffi::Traits::kCmdBufferCompatible});

#undef JCG_HANDLER_NAME
#define JCG_HANDLER_NAME "jax_cake_gdn_walk_output"

namespace jax_cake_gdn {
namespace {

// The tensor maps of walk_output's TMA loads: q, then from_a_maps. Returns "" or why not.
template <typename Out>
std::string walk_output_maps(WalkFwdArgs<bf16, Out>& a, int64_t T, int64_t H, int64_t HV,
                             int64_t K, int64_t V, int64_t NC) {
  std::string e = token_map(&a.tm_q, a.q, T, H, K);
  return e.empty() ? from_a_maps(a, T, H, HV, K, V, NC) : e;
}

// walk_output and walk_output_tapes (tapes: h, v_new, w, each null for walk_output).
ffi::Error walk_output_run(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                           ffi::AnyBuffer v, ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::BF16> A,
                           ffi::Buffer<ffi::F32> G, ffi::Buffer<ffi::F32> h0,
                           ffi::Buffer<ffi::F32> rstd_q, ffi::Buffer<ffi::F32> rstd_k,
                           ffi::Buffer<ffi::S32> chunk_start, ffi::Buffer<ffi::S32> chunk_len,
                           ffi::Buffer<ffi::S32> seg_first, ffi::Buffer<ffi::S32> seg_last,
                           ffi::Buffer<ffi::S32> seg_len, ffi::Buffer<ffi::S32> seg_order,
                           float scale, ffi::Result<ffi::AnyBuffer> o,
                           ffi::ResultBuffer<ffi::F32> final_state,
                           ffi::ResultBuffer<ffi::BF16>* h, ffi::ResultBuffer<ffi::BF16>* v_new,
                           ffi::ResultBuffer<ffi::BF16>* w) {
  const bool tapes = h != nullptr;
  JCG_CHECK_MSG(check_q_k(q, k));
  const auto qd = q.dimensions();
  const int64_t T = qd[0], H = qd[1], K = qd[2];
  int64_t HV, V;
  JCG_CHECK_MSG(check_tokens_v("v", v, "q", q.element_type(), T, HV, V));
  JCG_CHECK_MSG(check_heads(H, HV));
  JCG_CHECK_MSG(check_th("beta", beta.dimensions(), T, HV));
  bool has_rq = false, has_rk = false;
  JCG_CHECK_MSG(check_rstd("rstd_q", rstd_q.dimensions(), T, H, has_rq));
  int64_t NC, S;
  JCG_CHECK_MSG(check_walk_inputs(G, h0, rstd_k, chunk_start, chunk_len, seg_first, seg_last,
                                  seg_len, seg_order.dimensions(), T, H, HV, K, V, NC, S,
                                  has_rk));
  JCG_CHECK_MSG(check_a(A.dimensions(), NC, HV));
  JCG_CHECK_ARG(dims_are(o->dimensions(), {T, HV, V}),
                "o must be [T, HV, V], got shape " + dims_str(o->dimensions()));
  const ffi::DataType odt = o->element_type();
  JCG_CHECK_ARG(odt == ffi::DataType::BF16 || odt == ffi::DataType::F32,
                std::string("o must be bfloat16 or float32, got ") + dtype_name(odt));
  JCG_CHECK_ARG(dims_are(final_state->dimensions(), {S, HV, K, V}),
                "final must be f32[S, HV, K, V], got shape " + dims_str(final_state->dimensions()));
  if (tapes) {
    JCG_CHECK_MSG(check_tapes((*h)->dimensions(), (*v_new)->dimensions(),
                              final_state->dimensions(), NC, T, S, HV, K, V));
    JCG_CHECK_ARG(dims_are((*w)->dimensions(), {T, HV, K}),
                  "w must be bf16[T, HV, K], got shape " + dims_str((*w)->dimensions()));
  }

  JCG_CHECK_CUDA(poison(stream, o->untyped_data(), o->size_bytes()));
  JCG_CHECK_CUDA(poison(stream, *final_state));
  if (tapes) {
    JCG_CHECK_CUDA(poison(stream, **h));
    JCG_CHECK_CUDA(poison(stream, **v_new));
    JCG_CHECK_CUDA(poison(stream, **w));
  }
  cudaError_t err = cudaSuccess;
  std::string map_err;
  dispatch_float_type(q.element_type(), [&](auto tag) {
    using In = typename decltype(tag)::type;
    dispatch_float_type(odt, [&](auto otag) {
      using Out = typename decltype(otag)::type;
      dispatch_head_dim(K, [&](auto kdim) {
        constexpr int KD = decltype(kdim)::value;
        dispatch_head_dim(V, [&](auto vdim) {  // one CTA covers all V columns
          constexpr int VT = decltype(vdim)::value;
          auto a = walk_args<In, Out>(k, G, h0, has_rk ? rstd_k.typed_data() : nullptr,
                                      chunk_start, chunk_len, seg_first, seg_last, seg_len,
                                      seg_order.typed_data(), final_state->typed_data(), T, H,
                                      HV, NC);
          a.q = static_cast<const In*>(q.untyped_data());
          a.v = static_cast<const In*>(v.untyped_data());
          a.beta = beta.typed_data();
          a.A = static_cast<const bf16*>(A.untyped_data());
          a.rstd_q = has_rq ? rstd_q.typed_data() : nullptr;
          a.o = static_cast<Out*>(o->untyped_data());
          a.scale = scale;
          const bool stores = NC * HV > 0 && T > 0;  // the compute warps' TMA stores
          if constexpr (std::is_same_v<Out, bf16>) {
            if (stores) map_err = token_map(&a.tm_o, a.o, T, HV, VT);
            if (!map_err.empty()) return;
          }
          if (tapes) {
            a.h = static_cast<bf16*>((*h)->untyped_data());
            a.v_new = static_cast<bf16*>((*v_new)->untyped_data());
            a.w_out = static_cast<bf16*>((*w)->untyped_data());
            if (stores) {
              map_err = make_tma_state_rows_bf16(&a.tm_h, a.h, NC, HV, KD, VT);
              if (map_err.empty()) map_err = token_map(&a.tm_wout, a.w_out, T, HV, KD);
              if (map_err.empty()) map_err = token_map(&a.tm_vnew, a.v_new, T, HV, VT);
              if (!map_err.empty()) return;
            }
          }
          if constexpr (std::is_same_v<In, bf16>) {
            map_err = walk_output_maps(a, T, H, HV, KD, VT, NC);
            if (!map_err.empty()) return;
          }
          err = tapes ? launch_walk<WalkMode::kOutTapes, In, Out, KD, VT>(a, S, stream)
                      : launch_walk<WalkMode::kOut, In, Out, KD, VT>(a, S, stream);
        });
      });
    });
  });
  if (!map_err.empty()) return ffi::Error::Internal(JCG_HANDLER_NAME ": " + map_err);
  JCG_CHECK_CUDA(err);
  return ffi::Error::Success();
}

ffi::Error walk_output_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::BF16> A,
                            ffi::Buffer<ffi::F32> G, ffi::Buffer<ffi::F32> h0,
                            ffi::Buffer<ffi::F32> rstd_q, ffi::Buffer<ffi::F32> rstd_k,
                            ffi::Buffer<ffi::S32> chunk_start, ffi::Buffer<ffi::S32> chunk_len,
                            ffi::Buffer<ffi::S32> seg_first, ffi::Buffer<ffi::S32> seg_last,
                            ffi::Buffer<ffi::S32> seg_len, ffi::Buffer<ffi::S32> seg_order,
                            float scale, ffi::Result<ffi::AnyBuffer> o,
                            ffi::ResultBuffer<ffi::F32> final_state) {
  return walk_output_run(stream, q, k, v, beta, A, G, h0, rstd_q, rstd_k, chunk_start, chunk_len,
                         seg_first, seg_last, seg_len, seg_order, scale, o, final_state, nullptr,
                         nullptr, nullptr);
}

ffi::Error walk_output_tapes_impl(
    cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
    ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::BF16> A, ffi::Buffer<ffi::F32> G,
    ffi::Buffer<ffi::F32> h0, ffi::Buffer<ffi::F32> rstd_q, ffi::Buffer<ffi::F32> rstd_k,
    ffi::Buffer<ffi::S32> chunk_start, ffi::Buffer<ffi::S32> chunk_len,
    ffi::Buffer<ffi::S32> seg_first, ffi::Buffer<ffi::S32> seg_last,
    ffi::Buffer<ffi::S32> seg_len, ffi::Buffer<ffi::S32> seg_order, float scale,
    ffi::Result<ffi::AnyBuffer> o, ffi::ResultBuffer<ffi::F32> final_state,
    ffi::ResultBuffer<ffi::BF16> h, ffi::ResultBuffer<ffi::BF16> v_new,
    ffi::ResultBuffer<ffi::BF16> w) {
  return walk_output_run(stream, q, k, v, beta, A, G, h0, rstd_q, rstd_k, chunk_start, chunk_len,
                         seg_first, seg_last, seg_len, seg_order, scale, o, final_state, &h,
                         &v_new, &w);
}

}  // namespace
}  // namespace jax_cake_gdn

namespace jax_cake_gdn {
namespace {

// The arguments of both walk_output handlers, and their first two results (o, final).
auto walk_output_binding() {
  return xla::ffi::Ffi::Bind()
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
      .Arg<xla::ffi::AnyBuffer>()               // q
      .Arg<xla::ffi::AnyBuffer>()               // k
      .Arg<xla::ffi::AnyBuffer>()               // v
      .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // beta
      .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // A
      .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // G
      .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // h0
      .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // rstd_q
      .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // rstd_k
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // chunk_start
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // chunk_len
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // seg_first
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // seg_last
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // seg_len
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // seg_order
      .Attr<float>("scale")
      .Ret<xla::ffi::AnyBuffer>()               // o
      .Ret<xla::ffi::Buffer<xla::ffi::F32>>();  // final
}

}  // namespace
}  // namespace jax_cake_gdn

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cake_gdn_walk_output, jax_cake_gdn::walk_output_impl,
                              jax_cake_gdn::walk_output_binding(),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cake_gdn_walk_output_tapes,
                              jax_cake_gdn::walk_output_tapes_impl,
                              jax_cake_gdn::walk_output_binding()
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()   // h
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()   // v_new
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>(),  // w
                              {xla::ffi::Traits::kCmdBufferCompatible});

#undef JCG_HANDLER_NAME
#define JCG_HANDLER_NAME "jax_cake_gdn_replay"

namespace jax_cake_gdn {
namespace {

ffi::Error replay_impl(cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::BF16> A,
                       ffi::Buffer<ffi::F32> G, ffi::Buffer<ffi::F32> h0,
                       ffi::Buffer<ffi::F32> rstd_k, ffi::Buffer<ffi::S32> chunk_start,
                       ffi::Buffer<ffi::S32> chunk_len, ffi::Buffer<ffi::S32> seg_first,
                       ffi::Buffer<ffi::S32> seg_last, ffi::Buffer<ffi::S32> seg_len,
                       ffi::Buffer<ffi::S32> seg_order, ffi::ResultBuffer<ffi::BF16> h,
                       ffi::ResultBuffer<ffi::BF16> v_new, ffi::ResultBuffer<ffi::BF16> w,
                       ffi::ResultBuffer<ffi::F32> final_state) {
  JCG_CHECK_MSG(check_qk("k", k));
  const auto kd = k.dimensions();
  const int64_t T = kd[0], H = kd[1], K = kd[2];
  int64_t HV, V;
  JCG_CHECK_MSG(check_tokens_v("v", v, "k", k.element_type(), T, HV, V));
  JCG_CHECK_MSG(check_heads(H, HV));
  JCG_CHECK_MSG(check_th("beta", beta.dimensions(), T, HV));
  int64_t NC, S;
  bool has_rstd = false;
  JCG_CHECK_MSG(check_walk_inputs(G, h0, rstd_k, chunk_start, chunk_len, seg_first, seg_last,
                                  seg_len, seg_order.dimensions(), T, H, HV, K, V, NC, S,
                                  has_rstd));
  JCG_CHECK_MSG(check_a(A.dimensions(), NC, HV));
  JCG_CHECK_MSG(check_tapes(h->dimensions(), v_new->dimensions(), final_state->dimensions(), NC,
                            T, S, HV, K, V));
  JCG_CHECK_ARG(dims_are(w->dimensions(), {T, HV, K}),
                "w must be bf16[T, HV, K], got shape " + dims_str(w->dimensions()));

  JCG_CHECK_CUDA(poison(stream, *h));
  JCG_CHECK_CUDA(poison(stream, *v_new));
  JCG_CHECK_CUDA(poison(stream, *w));
  JCG_CHECK_CUDA(poison(stream, *final_state));
  cudaError_t err = cudaSuccess;
  std::string map_err;
  dispatch_float_type(k.element_type(), [&](auto tag) {
    using In = typename decltype(tag)::type;
    dispatch_head_dim(K, [&](auto kdim) {
      constexpr int KD = decltype(kdim)::value;
      dispatch_head_dim(V, [&](auto vdim) {  // one CTA covers all V columns
        constexpr int VT = decltype(vdim)::value;
        auto a = walk_args<In, bf16>(k, G, h0, has_rstd ? rstd_k.typed_data() : nullptr,
                                     chunk_start, chunk_len, seg_first, seg_last, seg_len,
                                     seg_order.typed_data(), final_state->typed_data(), T, H, HV,
                                     NC);
        a.v = static_cast<const In*>(v.untyped_data());
        a.beta = beta.typed_data();
        a.A = static_cast<const bf16*>(A.untyped_data());
        a.h = static_cast<bf16*>(h->untyped_data());
        a.v_new = static_cast<bf16*>(v_new->untyped_data());
        a.w_out = static_cast<bf16*>(w->untyped_data());
        if (NC * HV > 0 && T > 0) {  // the compute warps' TMA stores of h and w
          map_err = make_tma_state_rows_bf16(&a.tm_h, a.h, NC, HV, KD, VT);
          if (map_err.empty()) map_err = token_map(&a.tm_wout, a.w_out, T, HV, KD);
          if (!map_err.empty()) return;
        }
        if constexpr (std::is_same_v<In, bf16>) {  // the producer's TMA loads of k, v, A
          map_err = from_a_maps(a, T, H, HV, KD, VT, NC);
          if (!map_err.empty()) return;
        }
        err = launch_walk<WalkMode::kReplay, In, bf16, KD, VT>(a, S, stream);
      });
    });
  });
  if (!map_err.empty()) return ffi::Error::Internal(JCG_HANDLER_NAME ": " + map_err);
  JCG_CHECK_CUDA(err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cake_gdn

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cake_gdn_replay, jax_cake_gdn::replay_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // k
                                  .Arg<xla::ffi::AnyBuffer>()              // v
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // beta
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // A
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // G
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // h0
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // rstd_k
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // chunk_start
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // chunk_len
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // seg_first
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // seg_last
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // seg_len
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // seg_order
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // h
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // v_new
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // w
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // final
                              {xla::ffi::Traits::kCmdBufferCompatible});
