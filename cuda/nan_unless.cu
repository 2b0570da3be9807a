// x, or NaN everywhere: the in-place form of `where(ok, x, nan)` (primitives/xla.py nan_unless).
//
//   jax_cake_gdn_nan_unless(x [any shape] bf16/f16/f32/f64, ok int32[]) -> x, aliased to the input:
//       unchanged when ok != 0, every byte 0xFF (a NaN in every float dtype) when ok == 0.
//
// ok is read on the device (it is computed from traced cu_seqlens), so the handler never syncs
// with the host. When ok != 0 each CTA reads one int and exits: the check costs a launch, not
// the pass over x that `where` costs (x is the op's whole output).
#include "handler.cuh"

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

ffi::Error nan_unless(cudaStream_t stream, ffi::AnyBuffer x, S32 ok, Ret<ffi::AnyBuffer> out) {
  const int64_t bytes = static_cast<int64_t>(x.size_bytes());
  if (out->untyped_data() != x.untyped_data())  // aliased by the caller; copy if XLA did not
    JCG_CHECK_CUDA(cudaMemcpyAsync(out->untyped_data(), x.untyped_data(), bytes,
                                   cudaMemcpyDeviceToDevice, stream));
  if (bytes == 0) return ffi::Error::Success();
  nan_unless_kernel<<<kFillBlocks, kFillThreads, 0, stream>>>(
      static_cast<unsigned char*>(out->untyped_data()), bytes, ok.typed_data());
  JCG_CHECK_CUDA(cudaGetLastError());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cake_gdn

JCG_FFI_HANDLER(nan_unless, jax_cake_gdn::nan_unless)
