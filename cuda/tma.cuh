// Hopper tensor memory access (TMA): bf16 tiles from global memory straight into 128-byte
// swizzled shared-memory slabs (the layout wgmma.cuh's sw128_desc reads), completed on an
// mbarrier; and bf16 or f32 boxes from shared memory out to global memory (stored, or added by
// the TMA unit's f32 reduce-add), as bulk groups of the issuing thread.
//
// Host: make_tma encodes a tensor map (cuTensorMapEncodeTiled, found through the runtime's
// driver entry point, so nothing links libcuda) for boxes 128 bytes wide (the swizzle span: 64
// bf16 or 32 f32 elements) x box rows. A kernel takes the map as a member of a __grid_constant__
// parameter.
// Device: one thread arms an mbarrier with the bytes it expects and issues the copies; every
// thread that reads the tiles waits on the barrier's phase parity. Elements outside the tensor
// read as zero (and still count as bytes).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "device_common.cuh"

namespace jax_cake_gdn {

// ---------------------------------------------------------------- host

// A tensor map of a bf16 or f32 array with dims[0] contiguous: rank dims (innermost first),
// strides (bytes) of dims 1.., box extents; 128-byte swizzle, so box[0] must span 128 bytes (64
// bf16 or 32 f32 elements). Returns "" or why not.
inline std::string make_tma(CUtensorMap* map, CUtensorMapDataType type, const void* base,
                            int rank, const uint64_t* dims, const uint64_t* strides,
                            const uint32_t* box) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr) return "cuTensorMapEncodeTiled is not available from the driver";
  const cuuint32_t ones[5] = {1, 1, 1, 1, 1};
  const CUresult r = encode(map, type, static_cast<cuuint32_t>(rank),
                            const_cast<void*>(base), dims, strides, box, ones,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? "" : "cuTensorMapEncodeTiled failed (error " + std::to_string(r) + ")";
}

inline std::string make_tma_bf16(CUtensorMap* map, const void* base, int rank,
                                 const uint64_t* dims, const uint64_t* strides,
                                 const uint32_t* box) {
  return make_tma(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, base, rank, dims, strides, box);
}

// A map of a bf16 or f32 [T, heads, D] array (per-token rows of heads; f32 unless bf16 is set):
// boxes of 128 bytes (32 f32 or 64 bf16 columns) x 64 token rows of one head. Returns "" or why
// not.
inline std::string make_tma_token_rows(CUtensorMap* map, const void* base, int64_t T,
                                       int64_t heads, int64_t D, bool bf16 = false) {
  const uint64_t es = bf16 ? 2 : 4;
  const uint64_t dims[3] = {static_cast<uint64_t>(D), static_cast<uint64_t>(heads),
                            static_cast<uint64_t>(T)};
  const uint64_t strides[2] = {static_cast<uint64_t>(D) * es,
                               static_cast<uint64_t>(heads * D) * es};
  const uint32_t box[3] = {static_cast<uint32_t>(128 / es), 1, static_cast<uint32_t>(kChunk)};
  return make_tma(map,
                  bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
                  base, 3, dims, strides, box);
}

// A map of a row-major bf16 [rows, cols] array (cols a multiple of 8): boxes of 64 columns x
// box_rows rows. Returns "" or why not.
inline std::string make_tma_rows_bf16(CUtensorMap* map, const void* base, int64_t rows,
                                      int64_t cols, uint32_t box_rows) {
  const uint64_t dims[2] = {static_cast<uint64_t>(cols), static_cast<uint64_t>(rows)};
  const uint64_t strides[1] = {static_cast<uint64_t>(cols) * 2};
  const uint32_t box[2] = {64, box_rows};
  return make_tma_bf16(map, base, 2, dims, strides, box);
}

// A map of a state tape bf16[NC, HV, K, V] (h, dS_end) as [NC * HV * K rows, V]: K x 64 boxes (a
// warpgroup's columns of one (chunk, head)). Returns "" or why not.
inline std::string make_tma_state_rows_bf16(CUtensorMap* map, const void* base, int64_t NC,
                                            int64_t HV, int64_t K, int64_t V) {
  if (NC * HV * K >= (int64_t{1} << 31)) return "NC * HV * K must be below 2^31";
  return make_tma_rows_bf16(map, base, NC * HV * K, V, static_cast<uint32_t>(K));
}

// ---------------------------------------------------------------- device

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(arrivals)
               : "memory");
}

// After mbar_init, before any other thread uses the barrier (then a CTA or named barrier).
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// The arming thread's arrival, with the bytes the phase's copies will deliver.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}

// Waits until the phase with this parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// The box of `map` at coordinates (c0, c1[, c2]) (innermost first) into dst (1024-byte aligned
// for the swizzle), completing on bar.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int c0, int c1,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar))
      : "memory");
}

__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, int c0, int c1,
                                            int c2, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar))
      : "memory");
}

// The same boxes into L2 only (a hint: no barrier, no shared memory; a later tma_load of the box
// then reads L2 instead of waiting for DRAM).
__device__ __forceinline__ void tma_prefetch_2d(const CUtensorMap* map, int c0, int c1) {
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1)
               : "memory");
}

__device__ __forceinline__ void tma_prefetch_3d(const CUtensorMap* map, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.prefetch.tensor.3d.L2.global.tile [%0, {%1, %2, %3}];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}

// A 128-byte swizzled slab at src (1024-byte aligned, written by this CTA and fenced with
// fence.proxy.async before a barrier) to the box of `map` at (c0, c1), as one bulk group of the
// issuing thread: it calls tma_store_wait_read before src is written again and tma_store_wait
// before the CTA exits.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int c0,
                                             int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n"
      "cp.async.bulk.commit_group;\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(c0), "r"(c1), "r"(smem_u32(src))
      : "memory");
}

__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* src, int c0,
                                             int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n"
      "cp.async.bulk.commit_group;\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(src))
      : "memory");
}

// tma_store_3d, adding the box to what is in global memory (f32 atomic adds, in no fixed order
// against other adds to the same elements).
__device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap* map, const void* src, int c0,
                                                  int c1, int c2) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group"
      " [%0, {%1, %2, %3}], [%4];\n"
      "cp.async.bulk.commit_group;\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(src))
      : "memory");
}

// Until this thread's bulk stores have read their shared memory (it may be written again).
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

// Until this thread's bulk stores are complete.
__device__ __forceinline__ void tma_store_wait() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// Rows len..63 of n consecutive 64-row slabs (128 bytes a row) set to zero by Threads threads
// (t: this thread's index among them): what TMA read there from beyond a chunk's end.
template <int Threads>
__device__ __forceinline__ void zero_slab_rows(unsigned char* slabs, int n, int len, int t) {
  const int per = (kChunk - len) * 8;  // 16-byte pieces a slab
  for (int i = t; i < n * per; i += Threads) {
    const int sl = i / per, j = i % per;
    sts8_zero(reinterpret_cast<bf16*>(slabs + sl * kChunk * 128 + (len + j / 8) * 128 +
                                      16 * (j % 8)));
  }
}

}  // namespace jax_cake_gdn
