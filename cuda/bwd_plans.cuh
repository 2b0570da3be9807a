// The backward kernels' launches as plans: what a handler runs, made from its operands.
// walk_bwd.cu and chunk_bwd.cu run one plan each; walk_chunk_bwd.cu runs both, chunk_bwd behind
// the walk with a hand-off buffer (handoff.cuh).
#pragma once

#include <functional>

#include "handler.cuh"
#include "handoff.cuh"

namespace jax_cake_gdn {

struct KernelPlan {
  // poison the outputs (and zero chunk_bwd's atomic group sums)
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

struct ChunkBwdOut {
  F32 dQ, dK;
  ffi::AnyBuffer dV;
  F32 dg, dbeta;
};

// The plan of jax_cake_gdn_walk_bwd: the reverse walk storing dS_end, dh0 and dvn.
ffi::Error plan_walk_bwd(const WalkBwdIn& in, BF16 dS_end, F32 dh0, BF16 dvn, KernelPlan& plan);

// The plan of jax_cake_gdn_chunk_bwd (with a hand-off buffer: by programmatic dependent launch,
// unless JAX_CAKE_GDN_PDL=0).
ffi::Error plan_chunk_bwd(const ChunkBwdIn& in, const ChunkBwdOut& out, KernelPlan& plan);

}  // namespace jax_cake_gdn
