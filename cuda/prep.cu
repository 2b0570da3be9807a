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
#include <algorithm>

#include "handler.cuh"
#include "prep.cuh"
#include "solve_a_launch.cuh"

namespace jax_cake_gdn {
namespace {

// prep_kernel<In, K, kWU> over the NC x HV grid (kWU = false: v, w, u null, V unused).
template <bool kWU>
ffi::Error launch_prep(cudaStream_t stream, const ffi::AnyBuffer& k, const void* v, F32 beta,
                       F32 G, F32 rstd_k, ChunkTable chunks, BF16 A, void* w, void* u,
                       int64_t V) {
  const auto kd = k.dimensions();
  const int64_t T = kd[0], H = kd[1], K = kd[2], HV = beta.dimensions()[1], NC = chunks.count();
  if (NC == 0 || HV == 0) return ffi::Error::Success();
  return dispatch(
      [&](auto in, auto kdim) {
        using In = typename decltype(in)::type;
        constexpr int KD = decltype(kdim)::value;
        // prep_min_ctas CTAs/SM need the largest carveout.
        JCG_CHECK_CUDA(cudaFuncSetAttribute(prep_kernel<In, KD, kWU>,
                                            cudaFuncAttributePreferredSharedMemoryCarveout,
                                            cudaSharedmemCarveoutMaxShared));
        JCG_CHECK_CUDA(launch(prep_kernel<In, KD, kWU>, dim3(static_cast<unsigned>(NC * HV)),
                              kPrepThreads, PrepSmem<KD, kWU>::bytes, stream, data<In>(k),
                              static_cast<const In*>(v), beta.typed_data(), G.typed_data(),
                              optional_data(rstd_k), chunks.start.typed_data(),
                              chunks.len.typed_data(), static_cast<bf16*>(A.untyped_data()),
                              static_cast<bf16*>(w), static_cast<bf16*>(u), T,
                              static_cast<int>(H), static_cast<int>(HV), static_cast<int>(V)));
        return ffi::Error::Success();
      },
      FloatType{k.element_type()}, HeadDim{K});
}

// solve_a_ahead_kernel (bf16 k): one CTA per resident slot of every SM.
ffi::Error launch_solve_a_ahead(cudaStream_t stream, const ffi::AnyBuffer& k, F32 beta, F32 G,
                                F32 rstd_k, ChunkTable chunks, BF16 A, int32_t* a_ready,
                                int reserve) {
  const auto kd = k.dimensions();
  const int64_t T = kd[0], H = kd[1], K = kd[2], HV = beta.dimensions()[1], NC = chunks.count();
  if (k.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("solve_a ahead of the walk: k must be bf16");
  return dispatch(
      [&](auto kdim) {
        constexpr int KD = decltype(kdim)::value;
        auto kernel = solve_a_ahead_kernel<bf16, KD>;
        constexpr size_t smem = PrepSmem<KD, false>::bytes;
        JCG_CHECK_CUDA(cudaFuncSetAttribute(kernel,
                                            cudaFuncAttributePreferredSharedMemoryCarveout,
                                            cudaSharedmemCarveoutMaxShared));
        int per_sm = 0;
        JCG_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel,
                                                                     kPrepThreads, smem));
        const int ctas = sm_count() * std::max(per_sm, 1);
        JCG_CHECK_CUDA(launch(kernel, dim3(static_cast<unsigned>(ctas)), kPrepThreads, smem,
                              stream, data<bf16>(k), beta.typed_data(), G.typed_data(),
                              optional_data(rstd_k), chunks.start.typed_data(),
                              chunks.len.typed_data(), static_cast<bf16*>(A.untyped_data()), T,
                              static_cast<int>(H), static_cast<int>(HV), a_ready,
                              static_cast<int>(NC * HV), reserve));
        return ffi::Error::Success();
      },
      HeadDim{K});
}

ffi::Error prep(cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v, F32 beta, F32 G,
                F32 rstd_k, ChunkTable chunks, Ret<BF16> A, Ret<BF16> w, Ret<BF16> u) {
  JCG_CHECK_CUDA(poison_all(stream, *A, *w, *u));
  return launch_prep<true>(stream, k, v.untyped_data(), beta, G, rstd_k, chunks, *A,
                           w->untyped_data(), u->untyped_data(), v.dimensions()[2]);
}

ffi::Error solve_a(cudaStream_t stream, ffi::AnyBuffer k, F32 beta, F32 G, F32 rstd_k,
                   ChunkTable chunks, Ret<BF16> A) {
  JCG_CHECK_CUDA(poison(stream, *A));
  return launch_solve_a(stream, k, beta, G, rstd_k, chunks, *A, nullptr, 0);
}

}  // namespace

ffi::Error launch_solve_a(cudaStream_t stream, const ffi::AnyBuffer& k, F32 beta, F32 G,
                          F32 rstd_k, ChunkTable chunks, BF16 A, int32_t* a_ready, int reserve) {
  if (a_ready != nullptr)
    return launch_solve_a_ahead(stream, k, beta, G, rstd_k, chunks, A, a_ready, reserve);
  return launch_prep<false>(stream, k, nullptr, beta, G, rstd_k, chunks, A, nullptr, nullptr, 0);
}

}  // namespace jax_cake_gdn

JCG_FFI_HANDLER(prep, jax_cake_gdn::prep)
JCG_FFI_HANDLER(solve_a, jax_cake_gdn::solve_a)
