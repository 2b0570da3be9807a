// FFI handlers of the state walk and of the fused walk + output, one kernel template on Hopper
// wgmma (walk_fwd_wg.cuh; kOut = false / true):
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
#include "fwd_args.cuh"
#include "walk_fwd_wg.cuh"

#define JCG_HANDLER_NAME "jax_cake_gdn_state_walk"

namespace jax_cake_gdn {
namespace {

// The operands both handlers set alike (the others stay null).
template <typename In, typename Out>
WalkFwdArgs<In, Out> walk_args(const ffi::AnyBuffer& k, const ffi::Buffer<ffi::F32>& G,
                               const ffi::Buffer<ffi::F32>& h0, const float* rstd_k,
                               const ffi::Buffer<ffi::S32>& chunk_start,
                               const ffi::Buffer<ffi::S32>& chunk_len,
                               const ffi::Buffer<ffi::S32>& seg_first,
                               const ffi::Buffer<ffi::S32>& seg_last,
                               const ffi::Buffer<ffi::S32>& seg_len,
                               const ffi::Buffer<ffi::S32>& seg_order, float* final_state,
                               int64_t T, int64_t H, int64_t HV, int64_t NC) {
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
  a.seg_order = seg_order.typed_data();
  a.final_state = final_state;
  a.num_tokens = T;
  a.H = static_cast<int>(H);
  a.HV = static_cast<int>(HV);
  a.NC = static_cast<int>(NC);
  return a;
}

// A TMA map of a bf16 [T, heads, D] token array: 64 x 64 boxes (64 tokens of one head, 64 of
// its D columns). Returns "" or why not.
std::string token_map(CUtensorMap* m, const void* base, int64_t T, int64_t heads, int64_t D) {
  const uint64_t dims[3] = {static_cast<uint64_t>(D), static_cast<uint64_t>(heads),
                            static_cast<uint64_t>(T)};
  const uint64_t strides[2] = {static_cast<uint64_t>(D) * 2, static_cast<uint64_t>(heads * D) * 2};
  const uint32_t box[3] = {64, 1, kChunk};
  return make_tma_bf16(m, base, 3, dims, strides, box);
}

// A TMA map of A bf16[NC, HV, 64, 64] as [NC * HV * 64, 64]: one 64 x 64 box a (chunk, head).
std::string a_map(CUtensorMap* m, const void* A, int64_t NC, int64_t HV) {
  return make_tma_rows_bf16(m, A, NC * HV * kChunk, kChunk, kChunk);
}

// A of the walks that make w, u from it (walk_output, replay): bf16[NC, HV, 64, 64], its rows
// addressable by a_map. Returns "" or what is wrong.
std::string check_a(ffi::Span<const int64_t> A, int64_t NC, int64_t HV) {
  if (!dims_are(A, {NC, HV, kChunk, kChunk}))
    return "A must be bf16[NC, HV, 64, 64], got shape " + dims_str(A);
  if (NC * HV * kChunk >= (int64_t{1} << 31)) return "NC * HV * 64 must be below 2^31";
  return {};
}

// The tensor maps of the walks that make w, u from A (bf16 inputs): k, v (token_map) and A.
// Returns "" or why not.
template <typename Out>
std::string from_a_maps(WalkFwdArgs<bf16, Out>& a, int64_t T, int64_t H, int64_t HV, int64_t K,
                        int64_t V, int64_t NC) {
  std::string e = token_map(&a.tm_k, a.k, T, H, K);
  if (e.empty()) e = token_map(&a.tm_v, a.v, T, HV, V);
  if (e.empty()) e = a_map(&a.tm_A, a.A, NC, HV);
  return e;
}

// The checks every walk shares: G, rstd_k, the chunk and segment tables, h0 [S, HV, K, V]; sets
// NC, S and has_rstd. Returns "" or what is wrong.
std::string check_walk_inputs(const ffi::Buffer<ffi::F32>& G, const ffi::Buffer<ffi::F32>& h0,
                              const ffi::Buffer<ffi::F32>& rstd_k,
                              const ffi::Buffer<ffi::S32>& chunk_start,
                              const ffi::Buffer<ffi::S32>& chunk_len,
                              const ffi::Buffer<ffi::S32>& seg_first,
                              const ffi::Buffer<ffi::S32>& seg_last,
                              const ffi::Buffer<ffi::S32>& seg_len,
                              const ffi::Buffer<ffi::S32>& seg_order, int64_t T, int64_t H,
                              int64_t HV, int64_t K, int64_t V, int64_t& NC, int64_t& S,
                              bool& has_rstd) {
  std::string m;
  if (!(m = check_th("G", G.dimensions(), T, HV)).empty()) return m;
  if (!(m = check_rstd("rstd_k", rstd_k.dimensions(), T, H, has_rstd)).empty()) return m;
  if (!(m = check_table(chunk_start.dimensions(), chunk_len.dimensions())).empty()) return m;
  NC = chunk_start.dimensions()[0];
  if (!(m = check_segments(seg_first.dimensions(), seg_last.dimensions(), seg_len.dimensions(),
                           seg_order.dimensions()))
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
std::string check_tapes(ffi::Span<const int64_t> h, ffi::Span<const int64_t> v_new,
                        ffi::Span<const int64_t> fin, int64_t NC, int64_t T, int64_t S,
                        int64_t HV, int64_t K, int64_t V) {
  if (!dims_are(h, {NC, HV, K, V})) return "h must be bf16[NC, HV, K, V], got shape " + dims_str(h);
  if (!dims_are(v_new, {T, HV, V}))
    return "v_new must be bf16[T, HV, V], got shape " + dims_str(v_new);
  if (!dims_are(fin, {S, HV, K, V}))
    return "final must be f32[S, HV, K, V], got shape " + dims_str(fin);
  return {};
}

// One CTA of V / 64 compute warpgroups and a producer warpgroup per (segment, value head), the
// segments in seg_order.
template <WalkMode M, typename In, typename Out, int K, int V>
cudaError_t launch_walk(const WalkFwdArgs<In, Out>& a, int64_t S, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(S * a.HV));
  return launch(walk_fwd_wg_kernel<M, In, Out, K, V>, grid, walk_fwd_wg_threads<V>(),
                WalkFwdWgSmem<M, K, V>::bytes, stream, a);
}

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
                                  seg_len, seg_order, T, H, HV, K, V, NC, S, has_rstd));
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
                                     seg_order, final_state->typed_data(), T, H, HV, NC);
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
                                  seg_len, seg_order, T, H, HV, K, V, NC, S, has_rk));
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
                                      seg_order, final_state->typed_data(), T, H, HV, NC);
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
                                  seg_len, seg_order, T, H, HV, K, V, NC, S, has_rstd));
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
                                     seg_order, final_state->typed_data(), T, H, HV, NC);
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
