// Chunk-local inclusive cumsum of the log gate (the G of docs/design.md section 1).
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
#include "handler.cuh"

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

ffi::Error gate_cumsum(cudaStream_t stream, F32 g, ChunkTable chunks, Ret<F32> out) {
  JCG_CHECK_CUDA(poison(stream, *out));
  const int64_t num_tokens = g.dimensions()[0], num_heads = g.dimensions()[1];
  const int64_t num_chunks = chunks.count();
  if (num_tokens == 0 || num_heads == 0 || num_chunks == 0) return ffi::Error::Success();

  const int threads = num_heads >= 128 ? 128 : static_cast<int>((num_heads + 31) / 32 * 32);
  const dim3 grid(static_cast<unsigned>(num_chunks), ceil_div(num_heads, threads));
  gate_cumsum_kernel<kChunk><<<grid, threads, 0, stream>>>(
      g.typed_data(), chunks.start.typed_data(), chunks.len.typed_data(), out->typed_data(),
      num_tokens, static_cast<int>(num_heads));
  JCG_CHECK_CUDA(cudaGetLastError());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cake_gdn

JCG_FFI_HANDLER(gate_cumsum, jax_cake_gdn::gate_cumsum)
