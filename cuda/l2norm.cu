// L2-norm reciprocal of each q / k head row (DESIGN.md section 1):
//
//   jax_cake_gdn_l2norm_rstd(x [T, H, K] bf16 or f32) -> rstd f32[T, H] = 1 / sqrt(sum x^2 + 1e-6)
//
// One warp per row; f32 sum in a fixed order (lane-strided partial sums, then a butterfly), so it
// is deterministic. Any K.
#include "fwd_common.cuh"

#define JCG_HANDLER_NAME "jax_cake_gdn_l2norm_rstd"

namespace jax_cake_gdn {
namespace {

constexpr int kL2Threads = 256;

template <typename In>
__global__ void __launch_bounds__(kL2Threads)
    l2norm_rstd_kernel(const In* __restrict__ x, float* __restrict__ rstd, int64_t rows, int K) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kL2Threads / 32) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const In* p = x + row * K;
  float s = 0.f;
  for (int i = lane; i < K; i += 32) {
    const float v = static_cast<float>(p[i]);
    s = fmaf(v, v, s);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (lane == 0) rstd[row] = rsqrtf(s + 1e-6f);
}

ffi::Error l2norm_rstd_impl(cudaStream_t stream, ffi::AnyBuffer x,
                            ffi::ResultBuffer<ffi::F32> rstd) {
  const auto d = x.dimensions();
  JCG_CHECK_ARG(d.size() == 3, "x must be [T, H, K], got shape " + dims_str(d));
  JCG_CHECK_ARG(x.element_type() == ffi::DataType::BF16 || x.element_type() == ffi::DataType::F32,
                std::string("x must be bfloat16 or float32, got ") + dtype_name(x.element_type()));
  JCG_CHECK_ARG(rstd->dimensions().size() == 2 && rstd->dimensions()[0] == d[0] &&
                    rstd->dimensions()[1] == d[1],
                "rstd must be f32[T, H], got shape " + dims_str(rstd->dimensions()));
  JCG_CHECK_ARG(d[2] < (int64_t{1} << 30), "K too large");
  const int64_t rows = d[0] * d[1];
  JCG_CHECK_CUDA(poison(stream, *rstd));
  if (rows == 0) return ffi::Error::Success();
  JCG_CHECK_ARG(d[2] > 0, "K must be positive");
  const unsigned blocks = ceil_div(rows, kL2Threads / 32);
  cudaError_t err = cudaSuccess;
  dispatch_float_type(x.element_type(), [&](auto tag) {
    using In = typename decltype(tag)::type;
    l2norm_rstd_kernel<In><<<blocks, kL2Threads, 0, stream>>>(
        static_cast<const In*>(x.untyped_data()), rstd->typed_data(), rows, static_cast<int>(d[2]));
    err = cudaGetLastError();
  });
  JCG_CHECK_CUDA(err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cake_gdn

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cake_gdn_l2norm_rstd, jax_cake_gdn::l2norm_rstd_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()               // x
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // rstd
                              {xla::ffi::Traits::kCmdBufferCompatible});
