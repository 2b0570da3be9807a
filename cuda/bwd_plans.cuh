// The backward kernels' launches as plans: what a handler runs, made from its operands.
// walk_bwd.cu and chunk_bwd.cu run one plan each; walk_chunk_bwd.cu runs both, chunk_bwd behind
// the walk with a hand-off buffer (handoff.cuh).
#pragma once

#include <functional>

#include "handler.cuh"
#include "handoff.cuh"

namespace jax_cake_gdn {

struct KernelPlan {
  // poison the outputs (and zero chunk_bwd's atomic group sums and epilogue counts)
  std::function<ffi::Error(cudaStream_t)> prepare;
  std::function<ffi::Error(cudaStream_t, Handoff)> launch;  // Handoff{}: the kernel alone
  int64_t ctas = 0;   // CTAs of the launch
  int tiles = 1;      // the walk's CTAs an item
  int64_t items = 0;  // (chunk, value head) items, NC * HV
};

// The reverse walk's operands (walk_bwd.cu). slots: the segment each CTA slot walks (seg_order;
// transfer_bwd: unit_seg).
struct WalkBwdIn {
  ffi::AnyBuffer q, k;
  BF16 w;
  F32 G;
  ffi::AnyBuffer dout;
  F32 dfinal, rstd_q, rstd_k;
  ChunkTable chunks;
  SegmentTable segs;
  S32 slots;
  float scale;
};

// chunk_bwd's operands and results (chunk_bwd.cu).
struct ChunkBwdIn {
  ffi::AnyBuffer q, k, v;
  F32 beta, G;
  BF16 A, h, v_new, dS_end, dvn;
  ffi::AnyBuffer dout;
  F32 rstd_q, rstd_k;
  ChunkTable chunks;
  float scale;
};

// dq, dk [T, H, K] in q's dtype; dQ, dK f32[T, HQ, K] (scratch: per value head, or HQ = H the
// group sums); counts int32[NC H] (scratch: the epilogue's, chunk_bwd.cu).
struct ChunkBwdOut {
  ffi::AnyBuffer dq, dk, dV;
  F32 dg, dbeta, dQ, dK;
  S32 counts;
};

// The plan of jax_cake_gdn_walk_bwd: the reverse walk storing dS_end, dh0 and dvn; with
// dq_sums, dk_sums (chunk_bwd's f32 group sums [T, H, K]; walk_chunk_bwd) and a hand-off it also
// zeroes those a chunk at a time before it publishes the chunk (walk_bwd_wg.cuh: WalkBwdZero).
ffi::Error plan_walk_bwd(const WalkBwdIn& in, BF16 dS_end, F32 dh0, BF16 dvn, KernelPlan& plan,
                         float* dq_sums = nullptr, float* dk_sums = nullptr);

// The plan of jax_cake_gdn_chunk_bwd (with a hand-off buffer: by programmatic dependent launch,
// unless JAX_CAKE_GDN_PDL=0), its dq, dk epilogue included. sums_by_walk: the walk launched
// before it zeroes the group sums (its prepare does not).
ffi::Error plan_chunk_bwd(const ChunkBwdIn& in, const ChunkBwdOut& out, KernelPlan& plan,
                          bool sums_by_walk = false);

}  // namespace jax_cake_gdn
