// solve_a's launch (prep.cu), which walk_fwd.cu's solve_a_walk_output also makes.
#pragma once

#include "handler.cuh"

namespace jax_cake_gdn {

// solve_a's L2 norm: q and the rstd it stores (null: no L2 norm, A from the raw k).
struct SolveARstd {
  const void* q = nullptr;
  float* rstd_q = nullptr;
  float* rstd_k = nullptr;
};

// The handlers' rstd_q, rstd_k results (f32[T, H], poisoned here; f32[1]: no L2 norm, left as
// they are) as solve_a's SolveARstd.
ffi::Error solve_a_rstd(cudaStream_t stream, const ffi::AnyBuffer& q, F32 rstd_q, F32 rstd_k,
                        SolveARstd& rs);

// A bf16[NC, HV, 64, 64] of every (chunk, value head) item (prep_kernel without w, u) and, with
// rs, the rstd of q's and k's rows. a_ready null: one CTA per item. Else (int32[1 + NC HV],
// zeroed): ahead of a forward walk launched behind it with programmatic dependent launch, on all
// SMs but `reserve` (the walk's), each item's A and its CTA's rstd rows published on
// a_ready[1 + item] (handoff.cuh; the rows of a chunk come from its GVA groups' first heads).
ffi::Error launch_solve_a(cudaStream_t stream, const ffi::AnyBuffer& k, F32 beta, F32 G,
                          const SolveARstd& rs, ChunkTable chunks, BF16 A, int32_t* a_ready,
                          int reserve);

}  // namespace jax_cake_gdn
