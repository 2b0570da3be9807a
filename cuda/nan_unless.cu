// x, or NaN everywhere: the in-place form of `where(ok, x, nan)` (primitives/xla.py nan_unless).
//
//   jax_cake_gdn_nan_unless(x [any shape] bf16/f16/f32/f64, ok int32[]) -> x, aliased to the input:
//       unchanged when ok != 0, every byte 0xFF (a NaN in every float dtype) when ok == 0.
//
// ok is read on the device (it is computed from traced cu_seqlens), so the handler never syncs
// with the host. When ok != 0 each CTA reads one int and exits: the check costs a launch, not
// the pass over x that `where` costs (x is the op's whole output).
#include "common.cuh"

#define JCG_HANDLER_NAME "jax_cake_gdn_nan_unless"

namespace jax_cake_gdn {
namespace {

constexpr int kFillThreads = 256;
constexpr unsigned kFillBlocks = 264;

__global__ void __launch_bounds__(kFillThreads)
    nan_unless_kernel(unsigned char* __restrict__ x, int64_t bytes,
                      const int32_t* __restrict__ ok) {
  if (*ok != 0) return;
  const int64_t stride = int64_t{kFillThreads} * gridDim.x;
  const int64_t first = int64_t{blockIdx.x} * kFillThreads + threadIdx.x;
  // XLA buffers are at least 16-byte aligned: 16-byte words, then the tail bytes.
  const int64_t words = bytes / 16;
  uint4* xw = reinterpret_cast<uint4*>(x);
  for (int64_t i = first; i < words; i += stride) xw[i] = make_uint4(~0u, ~0u, ~0u, ~0u);
  for (int64_t i = 16 * words + first; i < bytes; i += stride) x[i] = 0xFF;
}

ffi::Error nan_unless_impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ok,
                           ffi::Result<ffi::AnyBuffer> out) {
  const ffi::DataType t = x.element_type();
  JCG_CHECK_ARG(t == ffi::DataType::BF16 || t == ffi::DataType::F16 || t == ffi::DataType::F32 ||
                    t == ffi::DataType::F64,
                "x must be bf16, f16, f32 or f64 (all bytes 0xFF is a NaN in each)");
  JCG_CHECK_ARG(ok.dimensions().size() == 0,
                "ok must be an int32 scalar, got shape " + dims_str(ok.dimensions()));
  JCG_CHECK_ARG(out->element_type() == x.element_type() && out->dimensions() == x.dimensions(),
                "output must have x's type and shape " + dims_str(x.dimensions()));
  const int64_t bytes = static_cast<int64_t>(x.size_bytes());
  if (out->untyped_data() != x.untyped_data())  // aliased by the caller; copy if XLA did not
    JCG_CHECK_CUDA(cudaMemcpyAsync(out->untyped_data(), x.untyped_data(), bytes,
                                   cudaMemcpyDeviceToDevice, stream));
  if (bytes == 0) return ffi::Error::Success();
  nan_unless_kernel<<<kFillBlocks, kFillThreads, 0, stream>>>(
      static_cast<unsigned char*>(out->untyped_data()), bytes, ok.typed_data());
  JCG_CHECK_LAUNCH();
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cake_gdn

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cake_gdn_nan_unless, jax_cake_gdn::nan_unless_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // ok
                                  .Ret<xla::ffi::AnyBuffer>(),             // x or NaN
                              {xla::ffi::Traits::kCmdBufferCompatible});
