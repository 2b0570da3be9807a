// FFI handler of the chunk output (kernel in output.cuh):
//
//   jax_cake_gdn_output(q, k, G, h, v_new, rstd_q, rstd_k, chunk_start, chunk_len; scale)
//       -> o [T, HV, V] (bf16 or f32, the result type chooses), scores bf16[NC, HV, 64, 64] or
//          bf16[1] (not wanted)
//
// q, k: bf16 or f32 [T, H, K] (same dtype); G f32[T, HV]; h bf16[NC, HV, K, V] (the state walk's
// tape); v_new bf16[T, HV, V] (the state walk's); rstd_q, rstd_k f32[T, H] or f32[1]. K, V in
// {64, 128}.
#include "fwd_args.cuh"
#include "output.cuh"

#define JCG_HANDLER_NAME "jax_cake_gdn_output"

namespace jax_cake_gdn {
namespace {

ffi::Error output_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                       ffi::Buffer<ffi::F32> G, ffi::Buffer<ffi::BF16> h,
                       ffi::Buffer<ffi::BF16> v_new, ffi::Buffer<ffi::F32> rstd_q,
                       ffi::Buffer<ffi::F32> rstd_k, ffi::Buffer<ffi::S32> chunk_start,
                       ffi::Buffer<ffi::S32> chunk_len, float scale, ffi::Result<ffi::AnyBuffer> o,
                       ffi::ResultBuffer<ffi::BF16> scores) {
  JCG_CHECK_MSG(check_q_k(q, k));
  const auto qd = q.dimensions();
  const int64_t T = qd[0], H = qd[1], K = qd[2];
  const auto vd = v_new.dimensions();
  JCG_CHECK_ARG(vd.size() == 3 && vd[0] == T,
                "v_new must be bf16[T, HV, V], got shape " + dims_str(vd));
  const int64_t HV = vd[1], V = vd[2];
  JCG_CHECK_MSG(check_heads(H, HV));
  JCG_CHECK_MSG(check_v(V));
  JCG_CHECK_MSG(check_th("G", G.dimensions(), T, HV));
  bool has_rq = false, has_rk = false;
  JCG_CHECK_MSG(check_rstd("rstd_q", rstd_q.dimensions(), T, H, has_rq));
  JCG_CHECK_MSG(check_rstd("rstd_k", rstd_k.dimensions(), T, H, has_rk));
  JCG_CHECK_MSG(check_table(chunk_start.dimensions(), chunk_len.dimensions()));
  const int64_t NC = chunk_start.dimensions()[0];
  JCG_CHECK_ARG(NC * HV < (int64_t{1} << 31), "NC * HV too large");
  JCG_CHECK_ARG(dims_are(h.dimensions(), {NC, HV, K, V}),
                "h must be bf16[NC, HV, K, V], got shape " + dims_str(h.dimensions()));
  JCG_CHECK_ARG(dims_are(o->dimensions(), {T, HV, V}),
                "o must be [T, HV, V], got shape " + dims_str(o->dimensions()));
  const ffi::DataType odt = o->element_type();
  JCG_CHECK_ARG(odt == ffi::DataType::BF16 || odt == ffi::DataType::F32,
                std::string("o must be bfloat16 or float32, got ") + dtype_name(odt));
  const bool want_scores = !is_absent(scores->dimensions());
  JCG_CHECK_ARG(!want_scores || dims_are(scores->dimensions(), {NC, HV, kChunk, kChunk}),
                "scores must be bf16[NC, HV, 64, 64] or bf16[1] (not wanted), got shape " +
                    dims_str(scores->dimensions()));

  JCG_CHECK_CUDA(poison(stream, o->untyped_data(), o->size_bytes()));
  if (want_scores) JCG_CHECK_CUDA(poison(stream, *scores));
  if (NC == 0 || HV == 0) return ffi::Error::Success();
  cudaError_t err = cudaSuccess;
  dispatch_float_type(q.element_type(), [&](auto tag) {
    using In = typename decltype(tag)::type;
    dispatch_float_type(odt, [&](auto otag) {
      using Out = typename decltype(otag)::type;
      dispatch_head_dim(K, [&](auto kdim) {
        constexpr int KD = decltype(kdim)::value;
        err = launch(output_kernel<In, Out, KD>,
                     dim3(static_cast<unsigned>(NC * HV)), kOutThreads,
                     OutputSmem<KD>::bytes(static_cast<int>(V)), stream,
                     static_cast<const In*>(q.untyped_data()),
                     static_cast<const In*>(k.untyped_data()), G.typed_data(),
                     static_cast<const bf16*>(h.untyped_data()),
                     static_cast<const bf16*>(v_new.untyped_data()),
                     has_rq ? rstd_q.typed_data() : static_cast<const float*>(nullptr),
                     has_rk ? rstd_k.typed_data() : static_cast<const float*>(nullptr),
                     chunk_start.typed_data(), chunk_len.typed_data(),
                     static_cast<Out*>(o->untyped_data()),
                     want_scores ? static_cast<bf16*>(scores->untyped_data())
                                 : static_cast<bf16*>(nullptr),
                     T, static_cast<int>(H), static_cast<int>(HV), static_cast<int>(V), scale);
      });
    });
  });
  JCG_CHECK_CUDA(err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cake_gdn

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cake_gdn_output, jax_cake_gdn::output_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // q
                                  .Arg<xla::ffi::AnyBuffer>()              // k
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // G
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // h
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // v_new
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // rstd_q
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // rstd_k
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // chunk_start
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // chunk_len
                                  .Attr<float>("scale")
                                  .Ret<xla::ffi::AnyBuffer>()              // o
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>(),  // scores
                              {xla::ffi::Traits::kCmdBufferCompatible});
