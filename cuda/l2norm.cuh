// The q / k L2 norm's backward for one row, shared by the l2norm_bwd kernel (l2norm.cu) and
// chunk_bwd's epilogue (chunk_bwd.cuh), and the l2norm_bwd kernel's launch:
//
//   dx = rstd (d - (d . y) y) with y = x rstd  (no L2 norm: dx = d), d the row's summed gradient
#pragma once

#include "handler.cuh"

namespace jax_cake_gdn {

// One warp a row, K in {64, 128}: lane l holds the elements l + 32 i (i < K / 32) of d and of
// x's row (as float) and writes dx's at out + 32 i (with_r false: no L2 norm, dx = d; r: the
// row's rstd). f32 sums in a fixed order (per-lane partial sums, then a butterfly): deterministic.
template <typename In, int K>
__device__ __forceinline__ void l2norm_bwd_row(float (&d)[K / 32], const float (&x)[K / 32],
                                               bool with_r, float r, In* __restrict__ out) {
  constexpr int E = K / 32;
  if (with_r) {
    float y[E], s = 0.f;
#pragma unroll
    for (int i = 0; i < E; ++i) {
      y[i] = x[i] * r;
      s = fmaf(d[i], y[i], s);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
#pragma unroll
    for (int i = 0; i < E; ++i) d[i] = r * (d[i] - s * y[i]);
  }
#pragma unroll
  for (int i = 0; i < E; ++i) out[32 * i] = static_cast<In>(d[i]);
}

// dx [T, H, K] in x's dtype from dy f32[T, HV, K]: each GVA group's HV / H rows summed in head
// order, then l2norm_bwd_row (rstd f32[T, H] or null). Every row of dx is written.
ffi::Error launch_l2norm_bwd(cudaStream_t stream, const float* dy, int64_t HV,
                             const ffi::AnyBuffer& x, const float* rstd, ffi::AnyBuffer& dx);

}  // namespace jax_cake_gdn
