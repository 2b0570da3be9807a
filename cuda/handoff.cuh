// The reverse walk -> chunk_bwd hand-off of walk_chunk_bwd (walk_chunk_bwd.cu): chunk_bwd is
// launched behind walk_bwd with programmatic dependent launch, so its CTAs start on the SMs the
// walk's longest-first schedule leaves idle (once every walk CTA has started), take the items
// last chunk first and wait for each item's dS_end and dvn (the only walk results they read).
//
// The buffer, int32[1 + n] for n = NC * HV items (item = c * HV + hv), zeroed before the walk:
//   [0] walk CTAs finished; [1 + item] walk CTAs (column tiles) whose part of the item is stored.
// The walk publishes with release adds once the stores are complete; chunk_bwd acquires. An item
// no walk CTA covers (only with a malformed segment table) is released when the walk finishes.
#pragma once

#include <cstdint>

namespace jax_cake_gdn {

struct Handoff {
  int32_t* data = nullptr;  // null: no hand-off (the kernels alone)
  int walk_ctas = 0;        // CTAs of the walk
  int tiles = 0;            // walk CTAs an item (its column tiles)
};

__device__ __forceinline__ void red_add_release_gpu(int32_t* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ int ld_acquire_gpu(const int32_t* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// This thread's bulk (TMA) stores but the newest N are complete; their writes ordered before
// this thread's later generic-proxy accesses (the release that publishes them).
template <int N>
__device__ __forceinline__ void bulk_stores_complete_but() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// Lets the kernel launched behind this one with programmatic dependent launch start once every
// CTA of this grid has run it (or exited). No effect without such a launch.
__device__ __forceinline__ void allow_dependent_launch() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// Walk side, one thread of a CTA: this CTA's part of `item` is complete and ordered before this
// call (its storing threads waited for their stores, then a CTA barrier).
__device__ __forceinline__ void handoff_publish(const Handoff& h, int item) {
  red_add_release_gpu(h.data + 1 + item, 1);
}

// Walk side, one thread of a CTA, after all of the CTA's publishes (ordered before it).
__device__ __forceinline__ void handoff_walk_done(const Handoff& h) {
  red_add_release_gpu(h.data, 1);
}

// chunk_bwd side, one thread: until `item` is published, or the walk has finished; then its
// TMA (async proxy) loads may read what the walk wrote.
__device__ __forceinline__ void handoff_wait(const Handoff& h, int item) {
  while (ld_acquire_gpu(h.data + 1 + item) < h.tiles && ld_acquire_gpu(h.data) < h.walk_ctas)
    __nanosleep(128);
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// ---------------------------------------------------------------- solve_a -> walk_output
// The forward's hand-off (walk_fwd.cu: solve_a_walk_output): when the walk's CTAs leave SMs idle,
// solve_a runs on the others (prep.cuh) and the walk is launched behind it with programmatic
// dependent launch; solve_a publishes each (chunk, head) item's A (int32[1 + NC HV]: [0] its item
// counter, [1 + item] the flags, item = c HV + hv, zeroed before solve_a) and the walk's producer
// waits for the items of its head a batch of chunks at a time. The walk only waits for the
// kernel launched before it, so the hand-off cannot deadlock, overlapped or not.

__device__ __forceinline__ int ld_relaxed_gpu(const int32_t* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// solve_a side, every thread of a CTA after its stores of `item`'s A: publish the item (flags:
// the buffer's [1]).
__device__ __forceinline__ void handoff_publish_a(int32_t* flags, int item) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) red_add_release_gpu(flags + item, 1);
}

// Walk side, one thread: until items first, first + step, .., last are all published (N flags
// read together per try: one round trip), then its TMA (async proxy) loads may read them.
template <int N>
__device__ __forceinline__ void handoff_wait_items(const int32_t* flags, int first, int last,
                                                   int step) {
  for (;;) {
    bool all = true;
#pragma unroll
    for (int j = 0; j < N; ++j) all &= ld_relaxed_gpu(flags + min(first + j * step, last)) != 0;
    if (all) break;
    __nanosleep(256);
  }
  asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

}  // namespace jax_cake_gdn
