// FFI handlers of the WY prep family (kernels in prep.cuh):
//
//   jax_cake_gdn_solve_a(k, beta, G, rstd_k, chunk_start, chunk_len) -> A f32[NC, HV, 64, 64]
//   jax_cake_gdn_wy(k, v, beta, G, A, rstd_k, chunk_start, chunk_len) -> w f32[T, HV, K],
//                                                                        u f32[T, HV, V]
//
// k, v: bf16 or f32 [T, H, K] / [T, HV, V] (same dtype); beta, G: f32[T, HV]; rstd_k: f32[T, H]
// or f32[1] (no L2 norm); chunk_start / chunk_len: int32[NC] (chunks.py). K, V in {64, 128}.
#include "fwd_args.cuh"
#include "prep.cuh"

namespace jax_cake_gdn {
namespace {

#define JCG_HANDLER_NAME "jax_cake_gdn_solve_a"

ffi::Error solve_a_impl(cudaStream_t stream, ffi::AnyBuffer k, ffi::Buffer<ffi::F32> beta,
                        ffi::Buffer<ffi::F32> G, ffi::Buffer<ffi::F32> rstd_k,
                        ffi::Buffer<ffi::S32> chunk_start, ffi::Buffer<ffi::S32> chunk_len,
                        ffi::ResultBuffer<ffi::F32> A) {
  JCG_CHECK_MSG(check_qk("k", k));
  const auto kd = k.dimensions();
  const int64_t T = kd[0], H = kd[1], K = kd[2];
  const auto gd = G.dimensions();
  JCG_CHECK_ARG(gd.size() == 2 && gd[0] == T, "G must be f32[T, HV], got shape " + dims_str(gd));
  const int64_t HV = gd[1];
  JCG_CHECK_MSG(check_heads(H, HV));
  JCG_CHECK_MSG(check_th("beta", beta.dimensions(), T, HV));
  bool has_rstd = false;
  JCG_CHECK_MSG(check_rstd("rstd_k", rstd_k.dimensions(), T, H, has_rstd));
  JCG_CHECK_MSG(check_table(chunk_start.dimensions(), chunk_len.dimensions()));
  const int64_t NC = chunk_start.dimensions()[0];
  JCG_CHECK_ARG(NC * HV < (int64_t{1} << 31), "NC * HV too large");
  JCG_CHECK_ARG(dims_are(A->dimensions(), {NC, HV, kChunk, kChunk}),
                "A must be f32[NC, HV, 64, 64], got shape " + dims_str(A->dimensions()));

  JCG_CHECK_CUDA(poison(stream, *A));
  if (NC == 0 || HV == 0) return ffi::Error::Success();
  cudaError_t err = cudaSuccess;
  dispatch_float_type(k.element_type(), [&](auto tag) {
    using In = typename decltype(tag)::type;
    dispatch_head_dim(K, [&](auto kdim) {
      constexpr int KD = decltype(kdim)::value;
      err = launch(solve_a_kernel<In, KD>, dim3(static_cast<unsigned>(NC * HV)),
                   kPrepThreads, SolveASmem<KD>::bytes, stream,
                   static_cast<const In*>(k.untyped_data()), beta.typed_data(), G.typed_data(),
                   has_rstd ? rstd_k.typed_data() : static_cast<const float*>(nullptr),
                   chunk_start.typed_data(), chunk_len.typed_data(), A->typed_data(), T,
                   static_cast<int>(H), static_cast<int>(HV));
    });
  });
  JCG_CHECK_CUDA(err);
  return ffi::Error::Success();
}

#undef JCG_HANDLER_NAME
#define JCG_HANDLER_NAME "jax_cake_gdn_wy"

ffi::Error wy_impl(cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> G, ffi::Buffer<ffi::F32> A,
                   ffi::Buffer<ffi::F32> rstd_k, ffi::Buffer<ffi::S32> chunk_start,
                   ffi::Buffer<ffi::S32> chunk_len, ffi::ResultBuffer<ffi::F32> w,
                   ffi::ResultBuffer<ffi::F32> u) {
  JCG_CHECK_MSG(check_qk("k", k));
  const auto kd = k.dimensions();
  const int64_t T = kd[0], H = kd[1], K = kd[2];
  const auto vd = v.dimensions();
  JCG_CHECK_ARG(vd.size() == 3 && vd[0] == T, "v must be [T, HV, V], got shape " + dims_str(vd));
  JCG_CHECK_ARG(v.element_type() == k.element_type(),
                std::string("v must have k's dtype ") + dtype_name(k.element_type()) + ", got " +
                    dtype_name(v.element_type()));
  const int64_t HV = vd[1], V = vd[2];
  JCG_CHECK_MSG(check_heads(H, HV));
  JCG_CHECK_MSG(check_v(V));
  JCG_CHECK_MSG(check_th("beta", beta.dimensions(), T, HV));
  JCG_CHECK_MSG(check_th("G", G.dimensions(), T, HV));
  bool has_rstd = false;
  JCG_CHECK_MSG(check_rstd("rstd_k", rstd_k.dimensions(), T, H, has_rstd));
  JCG_CHECK_MSG(check_table(chunk_start.dimensions(), chunk_len.dimensions()));
  const int64_t NC = chunk_start.dimensions()[0];
  JCG_CHECK_ARG(NC * HV < (int64_t{1} << 31), "NC * HV too large");
  JCG_CHECK_ARG(dims_are(A.dimensions(), {NC, HV, kChunk, kChunk}),
                "A must be f32[NC, HV, 64, 64], got shape " + dims_str(A.dimensions()));
  JCG_CHECK_ARG(dims_are(w->dimensions(), {T, HV, K}),
                "w must be f32[T, HV, K], got shape " + dims_str(w->dimensions()));
  JCG_CHECK_ARG(dims_are(u->dimensions(), {T, HV, V}),
                "u must be f32[T, HV, V], got shape " + dims_str(u->dimensions()));

  JCG_CHECK_CUDA(poison(stream, *w));
  JCG_CHECK_CUDA(poison(stream, *u));
  if (NC == 0 || HV == 0 || T == 0) return ffi::Error::Success();
  cudaError_t err = cudaSuccess;
  dispatch_float_type(k.element_type(), [&](auto tag) {
    using In = typename decltype(tag)::type;
    dispatch_head_dim(K, [&](auto kdim) {
      constexpr int KD = decltype(kdim)::value;
      err = launch(wy_kernel<In, KD>, dim3(static_cast<unsigned>(NC * HV)),
                   kPrepThreads, WySmem<KD>::bytes, stream,
                   static_cast<const In*>(k.untyped_data()),
                   static_cast<const In*>(v.untyped_data()), beta.typed_data(), G.typed_data(),
                   A.typed_data(),
                   has_rstd ? rstd_k.typed_data() : static_cast<const float*>(nullptr),
                   chunk_start.typed_data(), chunk_len.typed_data(), w->typed_data(),
                   u->typed_data(), T, static_cast<int>(H), static_cast<int>(HV),
                   static_cast<int>(V));
    });
  });
  JCG_CHECK_CUDA(err);
  return ffi::Error::Success();
}

#undef JCG_HANDLER_NAME

}  // namespace
}  // namespace jax_cake_gdn

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cake_gdn_solve_a, jax_cake_gdn::solve_a_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // k
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // beta
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // G
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // rstd_k
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // chunk_start
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // chunk_len
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // A
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cake_gdn_wy, jax_cake_gdn::wy_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // k
                                  .Arg<xla::ffi::AnyBuffer>()              // v
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // beta
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // G
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // A
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // rstd_k
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // chunk_start
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // chunk_len
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // w
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // u
                              {xla::ffi::Traits::kCmdBufferCompatible});
