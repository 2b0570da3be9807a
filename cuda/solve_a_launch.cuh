// solve_a's launch (prep.cu), which walk_fwd.cu's solve_a_walk_output also makes.
#pragma once

#include "handler.cuh"

namespace jax_cake_gdn {

// A bf16[NC, HV, 64, 64] of every (chunk, value head) item (prep_kernel without w, u). a_ready
// null: one CTA per item. Else (int32[1 + NC HV], zeroed): ahead of a forward walk launched
// behind it with programmatic dependent launch, on all SMs but `reserve` (the walk's), each
// item's A published on a_ready[1 + item] (handoff.cuh).
ffi::Error launch_solve_a(cudaStream_t stream, const ffi::AnyBuffer& k, F32 beta, F32 G,
                          F32 rstd_k, ChunkTable chunks, BF16 A, int32_t* a_ready, int reserve);

}  // namespace jax_cake_gdn
