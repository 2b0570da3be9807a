// The backward kernels' launches as plans: the argument checks of a handler, then what it runs.
// walk_bwd.cu and chunk_bwd.cu run one plan each; walk_chunk_bwd.cu runs both, chunk_bwd behind
// the walk with a hand-off buffer (handoff.cuh).
#pragma once

#include <functional>

#include "common.cuh"
#include "handoff.cuh"

namespace jax_cake_gdn {

struct KernelPlan {
  // poison the outputs; zero_sums: and zero chunk_bwd's atomic group sums (false: the walk
  // zeroes them, Handoff::zero_dq)
  std::function<cudaError_t(cudaStream_t, bool zero_sums)> prepare;
  std::function<cudaError_t(cudaStream_t, Handoff)> launch;  // Handoff{}: the kernel alone
  int64_t ctas = 0;   // CTAs of the launch
  int tiles = 1;      // the walk's CTAs an item
  int64_t items = 0;  // (chunk, value head) items, NC * HV
  float* sums_dq = nullptr;  // chunk_bwd's atomic group sums, f32 [T, H, K] (null: per head)
  float* sums_dk = nullptr;
};

// Argument checks of jax_cake_gdn_walk_bwd (walk_bwd.cu); the plan launches the reverse walk.
ffi::Error plan_walk_bwd(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::Buffer<ffi::BF16> w,
                         ffi::Buffer<ffi::F32> G, ffi::AnyBuffer dout,
                         ffi::Buffer<ffi::F32> dfinal, ffi::Buffer<ffi::F32> rstd_q, ffi::Buffer<ffi::F32> rstd_k,
                         ffi::Buffer<ffi::S32> chunk_start, ffi::Buffer<ffi::S32> chunk_len,
                         ffi::Buffer<ffi::S32> seg_first, ffi::Buffer<ffi::S32> seg_last,
                         ffi::Buffer<ffi::S32> seg_len, ffi::Buffer<ffi::S32> seg_order,
                         float scale, ffi::Buffer<ffi::BF16> dS_end, ffi::Buffer<ffi::F32> dh0,
                         ffi::Buffer<ffi::BF16> dvn, KernelPlan& plan);

// Argument checks of jax_cake_gdn_chunk_bwd (chunk_bwd.cu); the plan launches chunk_bwd (with a
// hand-off buffer: by programmatic dependent launch, unless JAX_CAKE_GDN_PDL=0).
ffi::Error plan_chunk_bwd(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> G,
                          ffi::Buffer<ffi::BF16> A, ffi::Buffer<ffi::BF16> h,
                          ffi::Buffer<ffi::BF16> v_new, ffi::Buffer<ffi::BF16> dS_end,
                          ffi::Buffer<ffi::BF16> dvn, ffi::AnyBuffer dout,
                          ffi::Buffer<ffi::F32> rstd_q, ffi::Buffer<ffi::F32> rstd_k,
                          ffi::Buffer<ffi::S32> chunk_start, ffi::Buffer<ffi::S32> chunk_len,
                          float scale, ffi::Buffer<ffi::F32> dQ, ffi::Buffer<ffi::F32> dK,
                          ffi::AnyBuffer dV, ffi::Buffer<ffi::F32> dg,
                          ffi::Buffer<ffi::F32> dbeta, KernelPlan& plan);

}  // namespace jax_cake_gdn
