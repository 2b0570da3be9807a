// FFI handlers of the WY prep family (kernels in prep.cuh):
//
//   jax_cake_gdn_prep(k, v, beta, G, rstd_k, chunk_start, chunk_len) -> A bf16[NC, HV, 64, 64],
//                                                                       w bf16[T, HV, K],
//                                                                       u bf16[T, HV, V]
//   jax_cake_gdn_solve_a(k, beta, G, rstd_k, chunk_start, chunk_len) -> A (prep's, bit for bit)
//
// A, w and u are rounded to bf16 (nearest) when written: A and w are what every reader
// (chunk_bwd, the walks) uses as mma operands; u starts the walks' f32 product-1 accumulator
// (emulated on the xla path, its rounding takes o's relative RMS against f64 from 1.7e-3 to
// 2.4e-3 at T = 4096, heads (2, 6); FLA keeps u in bf16 too). prep computes A in f32 (shared
// memory) and uses the same bf16 values for its own w and u.
//
// k, v: bf16 or f32 [T, H, K] / [T, HV, V] (same dtype); beta, G: f32[T, HV]; rstd_k: f32[T, H]
// or f32[1] (no L2 norm); chunk_start / chunk_len: int32[NC] (chunks.py). K, V in {64, 128}.
#include "handler.cuh"
#include "prep.cuh"

namespace jax_cake_gdn {
namespace {

// k, v, beta, G, rstd_k and the chunk table of the prep and solve_a handlers; sets T, H, K,
// HV, V, NC. v == nullptr (solve_a): HV from beta, V = 0.
std::string check_prep_inputs(const ffi::AnyBuffer& k, const ffi::AnyBuffer* v,
                              const ffi::Buffer<ffi::F32>& beta, const ffi::Buffer<ffi::F32>& G,
                              const ffi::Buffer<ffi::F32>& rstd_k,
                              const ffi::Buffer<ffi::S32>& chunk_start,
                              const ffi::Buffer<ffi::S32>& chunk_len, int64_t& T, int64_t& H,
                              int64_t& K, int64_t& HV, int64_t& V, int64_t& NC, bool& has_rstd) {
  std::string m = check_qk("k", k);
  if (!m.empty()) return m;
  const auto kd = k.dimensions();
  T = kd[0], H = kd[1], K = kd[2];
  if (v != nullptr) {
    if (!(m = check_tokens_v("v", *v, "k", k.element_type(), T, HV, V)).empty()) return m;
  } else {
    const auto bd = beta.dimensions();
    if (bd.size() != 2) return "beta must be f32[T, HV], got shape " + dims_str(bd);
    HV = bd[1], V = 0;
  }
  if (!(m = check_heads(H, HV)).empty()) return m;
  if (!(m = check_th("beta", beta.dimensions(), T, HV)).empty()) return m;
  if (!(m = check_th("G", G.dimensions(), T, HV)).empty()) return m;
  if (!(m = check_rstd("rstd_k", rstd_k.dimensions(), T, H, has_rstd)).empty()) return m;
  if (!(m = check_table(chunk_start.dimensions(), chunk_len.dimensions())).empty()) return m;
  NC = chunk_start.dimensions()[0];
  if (NC * HV >= (int64_t{1} << 31)) return "NC * HV too large";
  return {};
}

std::string check_wu(ffi::Span<const int64_t> w, ffi::Span<const int64_t> u, int64_t T,
                     int64_t HV, int64_t K, int64_t V) {
  if (!dims_are(w, {T, HV, K})) return "w must be bf16[T, HV, K], got shape " + dims_str(w);
  if (!dims_are(u, {T, HV, V})) return "u must be bf16[T, HV, V], got shape " + dims_str(u);
  return {};
}

// prep_kernel<In, K, kWU> over the NC x HV grid (kWU = false: v, w, u null, V unused).
template <bool kWU>
cudaError_t launch_prep(cudaStream_t stream, const ffi::AnyBuffer& k, const void* v,
                        const ffi::Buffer<ffi::F32>& beta, const ffi::Buffer<ffi::F32>& G,
                        const ffi::Buffer<ffi::F32>& rstd_k, bool has_rstd,
                        const ffi::Buffer<ffi::S32>& chunk_start,
                        const ffi::Buffer<ffi::S32>& chunk_len, ffi::Buffer<ffi::BF16>& A,
                        void* w, void* u, int64_t T, int64_t H, int64_t K, int64_t HV, int64_t V,
                        int64_t NC) {
  cudaError_t err = cudaSuccess;
  dispatch_float_type(k.element_type(), [&](auto tag) {
    using In = typename decltype(tag)::type;
    dispatch_head_dim(K, [&](auto kdim) {
      constexpr int KD = decltype(kdim)::value;
      // prep_min_ctas CTAs/SM need the largest carveout.
      err = cudaFuncSetAttribute(prep_kernel<In, KD, kWU>,
                                 cudaFuncAttributePreferredSharedMemoryCarveout,
                                 cudaSharedmemCarveoutMaxShared);
      if (err != cudaSuccess) return;
      err = launch(prep_kernel<In, KD, kWU>, dim3(static_cast<unsigned>(NC * HV)),
                   kPrepThreads, PrepSmem<KD, kWU>::bytes, stream,
                   static_cast<const In*>(k.untyped_data()), static_cast<const In*>(v),
                   beta.typed_data(), G.typed_data(),
                   has_rstd ? rstd_k.typed_data() : static_cast<const float*>(nullptr),
                   chunk_start.typed_data(), chunk_len.typed_data(),
                   static_cast<bf16*>(A.untyped_data()), static_cast<bf16*>(w),
                   static_cast<bf16*>(u), T, static_cast<int>(H), static_cast<int>(HV),
                   static_cast<int>(V));
    });
  });
  return err;
}

#define JCG_HANDLER_NAME "jax_cake_gdn_prep"

ffi::Error prep_impl(cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v,
                     ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> G,
                     ffi::Buffer<ffi::F32> rstd_k, ffi::Buffer<ffi::S32> chunk_start,
                     ffi::Buffer<ffi::S32> chunk_len, ffi::ResultBuffer<ffi::BF16> A,
                     ffi::ResultBuffer<ffi::BF16> w, ffi::ResultBuffer<ffi::BF16> u) {
  int64_t T, H, K, HV, V, NC;
  bool has_rstd = false;
  JCG_CHECK_MSG(check_prep_inputs(k, &v, beta, G, rstd_k, chunk_start, chunk_len, T, H, K, HV,
                                  V, NC, has_rstd));
  JCG_CHECK_ARG(dims_are(A->dimensions(), {NC, HV, kChunk, kChunk}),
                "A must be bf16[NC, HV, 64, 64], got shape " + dims_str(A->dimensions()));
  JCG_CHECK_MSG(check_wu(w->dimensions(), u->dimensions(), T, HV, K, V));

  JCG_CHECK_CUDA(poison(stream, *A));
  JCG_CHECK_CUDA(poison(stream, *w));
  JCG_CHECK_CUDA(poison(stream, *u));
  if (NC == 0 || HV == 0) return ffi::Error::Success();
  JCG_CHECK_CUDA(launch_prep<true>(stream, k, v.untyped_data(), beta, G, rstd_k, has_rstd,
                                    chunk_start, chunk_len, *A, w->untyped_data(),
                                    u->untyped_data(), T, H, K, HV, V, NC));
  return ffi::Error::Success();
}

#undef JCG_HANDLER_NAME
#define JCG_HANDLER_NAME "jax_cake_gdn_solve_a"

ffi::Error solve_a_impl(cudaStream_t stream, ffi::AnyBuffer k, ffi::Buffer<ffi::F32> beta,
                        ffi::Buffer<ffi::F32> G, ffi::Buffer<ffi::F32> rstd_k,
                        ffi::Buffer<ffi::S32> chunk_start, ffi::Buffer<ffi::S32> chunk_len,
                        ffi::ResultBuffer<ffi::BF16> A) {
  int64_t T, H, K, HV, V, NC;
  bool has_rstd = false;
  JCG_CHECK_MSG(check_prep_inputs(k, nullptr, beta, G, rstd_k, chunk_start, chunk_len, T, H, K,
                                  HV, V, NC, has_rstd));
  JCG_CHECK_ARG(dims_are(A->dimensions(), {NC, HV, kChunk, kChunk}),
                "A must be bf16[NC, HV, 64, 64], got shape " + dims_str(A->dimensions()));

  JCG_CHECK_CUDA(poison(stream, *A));
  if (NC == 0 || HV == 0) return ffi::Error::Success();
  JCG_CHECK_CUDA(launch_prep<false>(stream, k, nullptr, beta, G, rstd_k, has_rstd, chunk_start,
                                     chunk_len, *A, nullptr, nullptr, T, H, K, HV, V, NC));
  return ffi::Error::Success();
}

#undef JCG_HANDLER_NAME

}  // namespace
}  // namespace jax_cake_gdn

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cake_gdn_prep, jax_cake_gdn::prep_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // k
                                  .Arg<xla::ffi::AnyBuffer>()              // v
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // beta
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // G
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // rstd_k
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // chunk_start
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // chunk_len
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // A
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // w
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>(),  // u
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cake_gdn_solve_a, jax_cake_gdn::solve_a_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // k
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // beta
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // G
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // rstd_k
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // chunk_start
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // chunk_len
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>(),  // A
                              {xla::ffi::Traits::kCmdBufferCompatible});
