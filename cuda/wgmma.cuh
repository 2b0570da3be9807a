// Hopper warpgroup MMA (wgmma.mma_async, sm_90a) on bf16 operands in shared memory.
//
// Operand tiles use the 128-byte swizzle from 1024-byte aligned bases (the swizzle acts on
// address bits): a slab of rows of 64 elements (128 bytes) stores element (r, c) at byte
//   sw128_offset(r, c) = 128 r + 16 ((c / 8) ^ (r % 8)) + 2 (c % 8)
// Two layouts:
//   K-major (A, or B stored [N][K]): rows are M (or N) indices, c the K index; wider K is more
//     slabs one after the other. A 16-element K step is +32 bytes inside a slab; descriptor
//     stride byte offset 1024 (8-row groups), leading byte offset unused.
//   MN-major (B stored [K][N], N contiguous: kMnB; A stored [K][M], M contiguous: kMnA): rows
//     are K indices, c the N (M) index; wider N is more slabs (64 columns each), `slab_bytes`
//     apart. A 16-element K step is +2048 bytes (16 rows); stride byte offset 1024 (8-row K
//     groups), leading byte offset = slab_bytes (the step between 64-column N blocks, used when
//     N > 64; A has M = 64, one slab).
// Descriptor bits (PTX ISA, "Matrix Descriptor Format"): start address >> 4 in [0, 14), leading
// byte offset >> 4 in [16, 30), stride byte offset >> 4 in [32, 46), base offset [49, 52) (0:
// aligned tiles), swizzle mode [62, 64) (1: 128-byte).
//
// The accumulator of m64nN is the m16n8 C fragment (device_common.cuh) tiled over the N / 8 column
// blocks, warp w of the warpgroup owning rows 16 w..16 w + 15: d[4 j + e] is row
// 16 w + g + 8 (e / 2), column 8 j + 2 q + (e % 2) (g = lane / 4, q = lane % 4).
//
// Protocol: shared-memory writes by ordinary stores must be fenced to the async proxy
// (fence_proxy_async) and the CTA synchronized before a wgmma reads them; wgmma_fence_operand(D)
// and wgmma_fence before the first wgmma of a batch (orders earlier register writes of D);
// wgmma_commit, then wgmma_wait<N> and wgmma_fence_operand(D) before D is read or the operand
// tiles are overwritten.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace jax_cake_gdn {

// Byte offset of element (r, c) (c < 64) in a 128-byte swizzled slab.
__host__ __device__ constexpr uint32_t sw128_offset(int r, int c) {
  return static_cast<uint32_t>(128 * r + 16 * ((c / 8) ^ (r % 8)) + 2 * (c % 8));
}

// Descriptor of a 128-byte swizzled operand at p (shared memory: a slab base plus the K step's
// offset, see above); lbo_bytes: the MN-major slab stride (ignored for K-major operands).
__device__ __forceinline__ uint64_t sw128_desc(const void* p, uint32_t lbo_bytes = 16) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr >> 4) & 0x3FFF);
  d |= static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16;  // leading byte offset
  d |= static_cast<uint64_t>(1024 >> 4) << 32;                  // stride byte offset: 8 rows
  d |= static_cast<uint64_t>(1) << 62;                          // 128-byte swizzle
  return d;
}

// sw128_desc(p + off) from d = sw128_desc(p) (off a multiple of 16 bytes): the offset adds to the
// start-address field alone (a shared address >> 4 is below 2^14, so nothing carries out of it),
// one 32-bit add instead of the address arithmetic of a new descriptor.
__device__ __forceinline__ uint64_t desc_plus(uint64_t d, uint32_t off) {
  const uint32_t lo = static_cast<uint32_t>(d) + (off >> 4);
  return (d & 0xFFFFFFFF00000000ull) | lo;
}

// Byte offset of element (row, col) of a [rows][K] bf16 tile stored as 64-column swizzled slabs
// of `rows` rows each.
template <int Rows>
__device__ __forceinline__ uint32_t slab_offset(int row, int col) {
  return static_cast<uint32_t>((col / 64) * Rows * 128) + sw128_offset(row, col % 64);
}

// Element addresses of such a tile at base, for the *_tile_at loaders (device_common.cuh).
template <int Rows>
__device__ __forceinline__ auto slab_at(unsigned char* base) {
  return [=](int row, int col) {
    return reinterpret_cast<__nv_bfloat16*>(base + slab_offset<Rows>(row, col));
  };
}

// The first 1024-byte aligned address at or after p in shared memory (slabs must start there:
// the swizzle acts on address bits); dynamic shared memory sizes add 1 KB for it.
__device__ __forceinline__ unsigned char* align_1024(unsigned char* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return p + ((1024 - (a & 1023)) & 1023);
}

// Barrier of the 128 threads of warpgroup wg (named barrier 1 + wg; barrier 0 is
// __syncthreads').
__device__ __forceinline__ void warpgroup_sync(int wg) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(wg + 1) : "memory");
}

// Barrier of the first Threads threads of the CTA: the compute warpgroups of a kernel with a
// producer warpgroup after them (named barrier 3; 1 and 2 are warpgroup_sync's).
template <int Threads>
__device__ __forceinline__ void compute_sync() {
  asm volatile("bar.sync 3, %0;\n" ::"n"(Threads) : "memory");
}

// Barrier of the producer warpgroup (the last 128 threads) of such a kernel: named barrier 4.
__device__ __forceinline__ void producer_sync() {
  asm volatile("bar.sync 4, 128;\n" ::: "memory");
}

// Hopper's per-warpgroup register reallocation (every warp of the warpgroup executes it): a
// producer warpgroup gives registers back, compute warpgroups take them, so a CTA of three
// warpgroups (launched at 168 registers a thread) runs its compute warps at up to N.
template <int N>
__device__ __forceinline__ void warpgroup_reg_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void warpgroup_reg_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Pins the accumulator registers at this point of the program: called before the first wgmma of
// a batch and after wgmma_wait, so that the compiler neither moves reads of D above the wait nor
// writes of D below the fence.
template <int R>
__device__ __forceinline__ void wgmma_fence_operand(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define JCG_WGMMA_D16                                                                        \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
      "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), \
      "+f"(d[14]), "+f"(d[15])
#define JCG_WGMMA_D32_HI                                                                     \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),             \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),         \
      "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define JCG_WGMMA_D64_HI                                                                     \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),             \
      "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),         \
      "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),         \
      "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),         \
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]),         \
      "+f"(d[62]), "+f"(d[63])

// D[64 x N] (+)= kScaleA A[64 x 16] B[16 x N], N in {32, 64, 128}: bf16 A and B from shared
// memory by descriptor (K-major, or MN-major with kMnA / kMnB: A stored [K][M], M contiguous,
// with the same slab layout as an MN-major B; an N = 32 block may start inside a slab: +64 bytes
// MN-major, +32 rows K-major), f32 D in registers (the accumulator layout above). kScaleA = -1
// negates A (exact). accumulate = false overwrites D.
template <int N, bool kMnA, bool kMnB, int kScaleA>
__device__ __forceinline__ void wgmma_m64k16_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                                bool accumulate) {
  static_assert(N == 32 || N == 64 || N == 128, "N = 32, 64 or 128");
  static_assert(kScaleA == 1 || kScaleA == -1, "scale of A: 1 or -1");
  if constexpr (N == 32) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "%16, %17, p, %19, 1, %20, %21;\n}\n"
        : JCG_WGMMA_D16
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)), "n"(kScaleA),
          "n"(kMnA ? 1 : 0), "n"(kMnB ? 1 : 0));
  } else if constexpr (N == 64) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, %35, 1, %36, %37;\n}\n"
        : JCG_WGMMA_D16, JCG_WGMMA_D32_HI
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)), "n"(kScaleA),
          "n"(kMnA ? 1 : 0), "n"(kMnB ? 1 : 0));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, %67, 1, %68, %69;\n}\n"
        : JCG_WGMMA_D16, JCG_WGMMA_D32_HI, JCG_WGMMA_D64_HI
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)), "n"(kScaleA),
          "n"(kMnA ? 1 : 0), "n"(kMnB ? 1 : 0));
  }
}

// The register form: A[64 x 16] from registers a (bf16 pairs in the accumulator's row / column
// mapping, see wg_acc_to_a), B by descriptor as above; N in {32, 64, 128}. The registers of a
// must stay unchanged until the wgmma_wait that covers this product, and be written before the
// batch's wgmma_fence (ptxas otherwise inserts a warpgroup.arrive before the product: C7519).
template <int N, bool kMnB, int kScaleA>
__device__ __forceinline__ void wgmma_m64k16_rs(float (&d)[N / 2], const uint32_t (&a)[4],
                                                uint64_t desc_b, bool accumulate) {
  static_assert(N == 32 || N == 64 || N == 128, "N = 32, 64 or 128");
  static_assert(kScaleA == 1 || kScaleA == -1, "scale of A: 1 or -1");
  if constexpr (N == 32) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "{%16, %17, %18, %19}, %20, p, %22, 1, %23;\n}\n"
        : JCG_WGMMA_D16
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b),
          "r"(static_cast<int>(accumulate)), "n"(kScaleA), "n"(kMnB ? 1 : 0));
  } else if constexpr (N == 64) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, %38, 1, %39;\n}\n"
        : JCG_WGMMA_D16, JCG_WGMMA_D32_HI
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b),
          "r"(static_cast<int>(accumulate)), "n"(kScaleA), "n"(kMnB ? 1 : 0));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, %70, 1, %71;\n}\n"
        : JCG_WGMMA_D16, JCG_WGMMA_D32_HI, JCG_WGMMA_D64_HI
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b),
          "r"(static_cast<int>(accumulate)), "n"(kScaleA), "n"(kMnB ? 1 : 0));
  }
}

// A of k16 step s (columns 16 s..16 s + 15) of a 64 x N f32 accumulator d, rounded to bf16, as
// wgmma_m64k16_rs's register operand: the register A fragment maps rows and columns as the
// accumulator does (a[0]: row g, columns 2q, 2q + 1; a[1]: row g + 8; a[2], a[3]: the same 8
// columns on), so one product's result feeds the next without shared memory (FlashAttention-3's
// P V).
template <int N>
__device__ __forceinline__ void wg_acc_to_a(const float (&d)[N / 2], int s, uint32_t (&a)[4]) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(d[8 * s + 2 * r], d[8 * s + 2 * r + 1]);
    a[r] = *reinterpret_cast<const uint32_t*>(&h);
  }
}

#undef JCG_WGMMA_D16
#undef JCG_WGMMA_D32_HI
#undef JCG_WGMMA_D64_HI

}  // namespace jax_cake_gdn
