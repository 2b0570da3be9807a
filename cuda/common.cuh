// Shared conventions for every FFI handler in cuda/*.cu.
//
// A kernel family lives in one cuda/<family>.cu (small compile units). That file holds the
// __global__ kernels, a host launcher, and the XLA FFI handler symbol(s) for the family, defined
// with XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cake_gdn_<name>, ...). The handler symbol is extern "C";
// bindings/handlers.inc lists it once so bindings/module.cc can hand XLA a capsule for it.
//
// Rules for handlers:
//   * typed buffers (ffi::Buffer<ffi::F32> ...), every rank/shape checked up front with
//     JCG_CHECK_ARG (returns ffi::Error::InvalidArgument naming the argument);
//   * the stream comes from the context: .Ctx<ffi::PlatformStream<cudaStream_t>>();
//   * no allocation, no host sync (so handlers stay kCmdBufferCompatible, CUDA-graph capturable);
//   * outputs (and later scratch) go through poison() before the kernel runs;
//   * launch errors come back as ffi::Error::Internal via JCG_CHECK_LAUNCH.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_cake_gdn {

namespace ffi = xla::ffi;

// Chunk length of the chunked GDN form (DESIGN.md section 1).
inline constexpr int kChunk = 64;

// Returns InvalidArgument(msg) from the enclosing handler when `cond` is false.
#define JCG_CHECK_ARG(cond, msg)                                   \
  do {                                                             \
    if (!(cond)) {                                                 \
      return ::xla::ffi::Error::InvalidArgument(                   \
          std::string(JCG_HANDLER_NAME) + ": " + (msg));           \
    }                                                              \
  } while (0)

// Returns Internal(...) from the enclosing handler if a CUDA call failed.
#define JCG_CHECK_CUDA(expr)                                                 \
  do {                                                                       \
    cudaError_t jcg_err_ = (expr);                                           \
    if (jcg_err_ != cudaSuccess) {                                           \
      return ::xla::ffi::Error::Internal(                                    \
          std::string(JCG_HANDLER_NAME) + ": " #expr " failed: " +           \
          cudaGetErrorString(jcg_err_));                                     \
    }                                                                        \
  } while (0)

// After a <<<...>>> launch: reports a bad launch configuration or an earlier sticky error.
#define JCG_CHECK_LAUNCH() JCG_CHECK_CUDA(cudaGetLastError())

// "[a, b, c]" for error messages.
inline std::string dims_str(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

// JAX_CAKE_GDN_POISON=1 (read once per process): outputs are filled with NaN before a kernel
// runs, so any element a kernel forgets to write shows up as non-finite in tests. All bytes 0xFF
// is a NaN for f32 and bf16 (and -1 for int32).
inline bool poison_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("JAX_CAKE_GDN_POISON");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return enabled;
}

inline cudaError_t poison(cudaStream_t stream, void* data, size_t bytes) {
  if (!poison_enabled() || bytes == 0) return cudaSuccess;
  return cudaMemsetAsync(data, 0xFF, bytes, stream);
}

template <typename Buf>
inline cudaError_t poison(cudaStream_t stream, Buf& buf) {
  return poison(stream, buf.untyped_data(), buf.size_bytes());
}

inline unsigned ceil_div(int64_t a, int64_t b) { return static_cast<unsigned>((a + b - 1) / b); }

}  // namespace jax_cake_gdn
