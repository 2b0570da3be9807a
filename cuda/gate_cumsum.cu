// Chunk-local inclusive cumsum of the log gate (the G of DESIGN.md section 1).
//
//   g:           f32[T, HV]
//   chunk_start: int32[NC]   first token of chunk c
//   chunk_len:   int32[NC]   0 <= chunk_len <= 64; chunks cover every token exactly once
//                            (chunks of length 0 are unused padding and cover nothing)
//   G:           f32[T, HV]  G[chunk_start[c] + t, h] = sum_{s <= t} g[chunk_start[c] + s, h]
//
// One block per (chunk, group of heads); one thread per (chunk, head) adds its chunk's gates in
// token order, so the f32 sum is sequential and deterministic. Threads of a block read
// consecutive heads of the same token row: coalesced. Chunk tables are read on the device only
// (they may be traced values), so the handler never syncs with the host.
#include "common.cuh"

#define JCG_HANDLER_NAME "jax_cake_gdn_gate_cumsum"

namespace jax_cake_gdn {
namespace {

template <int kMaxLen>
__global__ void gate_cumsum_kernel(const float* __restrict__ g,
                                   const int32_t* __restrict__ chunk_start,
                                   const int32_t* __restrict__ chunk_len, float* __restrict__ out,
                                   int64_t num_tokens, int num_heads) {
  const int c = blockIdx.x;
  const int h = blockIdx.y * blockDim.x + threadIdx.x;
  if (h >= num_heads) return;
  const int64_t start = chunk_start[c];
  // Clamp to the buffer so a malformed table cannot write out of bounds (the result is then
  // wrong, and poison makes that visible, but memory stays intact).
  int64_t len = min(static_cast<int64_t>(chunk_len[c]), static_cast<int64_t>(kMaxLen));
  if (start < 0 || start >= num_tokens) return;
  len = min(len, num_tokens - start);

  const float* src = g + start * num_heads + h;
  float* dst = out + start * num_heads + h;
  float acc = 0.f;
  for (int t = 0; t < len; ++t) {
    acc += src[static_cast<int64_t>(t) * num_heads];
    dst[static_cast<int64_t>(t) * num_heads] = acc;
  }
}

ffi::Error gate_cumsum_impl(cudaStream_t stream, ffi::Buffer<ffi::F32> g,
                            ffi::Buffer<ffi::S32> chunk_start, ffi::Buffer<ffi::S32> chunk_len,
                            ffi::ResultBuffer<ffi::F32> out) {
  const auto gd = g.dimensions();
  JCG_CHECK_ARG(gd.size() == 2, "g must be f32[T, HV], got shape " + dims_str(gd));
  JCG_CHECK_ARG(chunk_start.dimensions().size() == 1,
                "chunk_start must be int32[NC], got shape " + dims_str(chunk_start.dimensions()));
  JCG_CHECK_ARG(chunk_len.dimensions() == chunk_start.dimensions(),
                "chunk_len must match chunk_start, got shapes " + dims_str(chunk_len.dimensions()) +
                    " and " + dims_str(chunk_start.dimensions()));
  JCG_CHECK_ARG(out->dimensions() == gd, "output must have g's shape " + dims_str(gd) + ", got " +
                                             dims_str(out->dimensions()));
  const int64_t num_tokens = gd[0];
  const int64_t num_heads = gd[1];
  const int64_t num_chunks = chunk_start.dimensions()[0];
  JCG_CHECK_ARG(num_heads <= (1 << 20), "HV too large: " + std::to_string(num_heads));
  JCG_CHECK_ARG(num_chunks < (int64_t{1} << 31), "too many chunks: " + std::to_string(num_chunks));

  JCG_CHECK_CUDA(poison(stream, *out));
  if (num_tokens == 0 || num_heads == 0 || num_chunks == 0) return ffi::Error::Success();

  const int threads = num_heads >= 128 ? 128 : static_cast<int>((num_heads + 31) / 32 * 32);
  const dim3 grid(static_cast<unsigned>(num_chunks), ceil_div(num_heads, threads));
  gate_cumsum_kernel<kChunk><<<grid, threads, 0, stream>>>(
      g.typed_data(), chunk_start.typed_data(), chunk_len.typed_data(), out->typed_data(),
      num_tokens, static_cast<int>(num_heads));
  JCG_CHECK_LAUNCH();
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cake_gdn

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cake_gdn_gate_cumsum, jax_cake_gdn::gate_cumsum_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // g
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // chunk_start
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // chunk_len
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // G
                              {xla::ffi::Traits::kCmdBufferCompatible});
