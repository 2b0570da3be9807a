// Shared conventions for every FFI handler in cuda/*.cu.
//
// A kernel family lives in one cuda/<family>.cu (small compile units). That file holds the host
// side of the family's kernels and its XLA FFI handler(s): JCG_FFI_HANDLER(<name>, impl)
// (handler.cuh) defines the extern "C" symbol jax_cake_gdn_<name>, bound from impl's parameter
// list; bindings/handlers.inc lists it once so bindings/module.cc can hand XLA a capsule for it.
//
// Rules for handlers:
//   * the Python wrapper (jax_cake_gdn/primitives/cuda.py) checks every argument's shape and dtype
//     (errors name the argument) and builds the results; the handler reads its sizes from the
//     buffers;
//   * the stream is the impl's first parameter (the platform stream from the context);
//   * no allocation, no host sync (so handlers stay kCmdBufferCompatible, CUDA-graph capturable);
//   * outputs (and later scratch) go through poison() before the kernel runs;
//   * errors (launch, tensor maps, dispatch) come back as ffi::Error, prefixed with the target's
//     name (handler.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_cake_gdn {

namespace ffi = xla::ffi;

// Chunk length of the chunked GDN form (docs/design.md section 1).
inline constexpr int kChunk = 64;

// Whether the environment variable `name` is set to exactly `value` (the switches below read it
// once per process).
inline bool env_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, value) == 0;
}

// JAX_CAKE_GDN_POISON=1: outputs are filled with NaN before a kernel runs, so any element a
// kernel forgets to write shows up as non-finite in tests. All bytes 0xFF is a NaN for f32 and
// bf16 (and -1 for int32).
inline bool poison_enabled() {
  static const bool enabled = env_is("JAX_CAKE_GDN_POISON", "1");
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
