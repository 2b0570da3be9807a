// Standalone check of cuda/wgmma.cuh on an sm_90a GPU: D = C + s A B by wgmma (m64nNk16, N = 32,
// 64, 128, K = 128, A and B from shared memory; A K-major (stored [M][K]) or MN-major (stored
// [K][M]), B K-major (stored [N][K]) or MN-major (stored [K][N]), all 128-byte swizzled; s = 1 or
// -1; or A from registers: wgmma_m64k16_rs on wg_acc_to_a of A held as a 64 x K accumulator)
// against a host reference. The inputs are multiples of 1/4 in [-1, 1], so every product and
// sum is exact in f32 and the check is exact equality: a wrong layout, descriptor, sign or
// fragment mapping shows as a mismatch. Without C the first K step runs with accumulate = false
// over a D pre-filled with 12345; with C, D starts as C and every step accumulates. D's memory
// starts as NaN.
// Build and run (tests/test_wgmma.py does both), from the repository root:
//   nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icuda tests/cuda/wgmma_check.cu -o x
//   ./x
// Exit status 0 when all fifteen cases match.
#include <cuda_bf16.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "wgmma.cuh"

namespace jcg = jax_cake_gdn;

constexpr int kM = 64, kK = 128, kSlab = 64;

// A: [kM][kK] row-major; B: Bt[n][k] = B[k][n], given as [N][kK] row-major either way (the kernel
// lays them out K-major or MN-major in shared memory); C: [kM][N] (kC).
// kNOff: B's N columns sit at N offset kNOff of its shared tile (B stored [K][N + kNOff] or
// [N + kNOff][K]), read through a descriptor that starts there (N = 32 blocks inside a slab).
// Element 4 j + e of this thread's m64nN accumulator (wgmma.cuh's layout) as an index into the
// 64 x N row-major matrix: row 16 warp + g + 8 (e / 2), column 8 j + 2 q + e % 2.
template <int N>
__device__ __forceinline__ int acc_index(int j, int e) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  return (16 * warp + g + 8 * (e / 2)) * N + 8 * j + 2 * q + (e % 2);
}

// kRegA: A from registers (kMnA unused; A's shared tile is not written).
template <int N, bool kMnA, bool kMnB, int kScaleA, bool kC, int kNOff, bool kRegA>
__global__ void __launch_bounds__(128) wgmma_check_kernel(const __nv_bfloat16* A,
                                                          const __nv_bfloat16* Bt, const float* C,
                                                          float* D) {
  extern __shared__ unsigned char smem_raw[];
  // 1024-byte aligned slabs (the swizzle acts on address bits)
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  unsigned char* smem = smem_raw + ((1024 - (raw & 1023)) & 1023);
  unsigned char* sA = smem;  // K-major: kK / kSlab slabs of kM x 128 bytes; MN-major: one slab
                             // of kK x 128 bytes
  unsigned char* sB = smem + kM * kK * 2;  // K-major: kK / 64 slabs of N x 128 bytes;
                                           // MN-major: N / 64 slabs of kK x 128 bytes
  const int tid = threadIdx.x;
  for (int i = tid; i < (kRegA ? 0 : kM * kK); i += 128) {
    const int r = i / kK, k = i % kK;
    unsigned char* p = kMnA ? sA + jcg::sw128_offset(k, r)
                            : sA + (k / kSlab) * kM * 128 + jcg::sw128_offset(r, k % kSlab);
    *reinterpret_cast<__nv_bfloat16*>(p) = A[i];
  }
  constexpr int NS = N + kNOff;  // the stored tile's N
  for (int i = tid; i < N * kK; i += 128) {
    const int n = i / kK + kNOff, k = i % kK;
    unsigned char* p = kMnB ? sB + (n / 64) * kK * 128 + jcg::sw128_offset(k, n % 64)
                            : sB + (k / kSlab) * NS * 128 + jcg::sw128_offset(n, k % kSlab);
    *reinterpret_cast<__nv_bfloat16*>(p) = Bt[i];
  }
  jcg::fence_proxy_async();
  __syncthreads();

  // kRegA: A as a 64 x kK accumulator (the m64nN layout with N = kK), as bf16 A fragments of
  // every k16 step, all made before the wgmma fence (else ptxas inserts warpgroup.arrive)
  [[maybe_unused]] uint32_t ra[kRegA ? kK / 16 : 1][4];
  if constexpr (kRegA) {
    float fa[kK / 2];
#pragma unroll
    for (int j = 0; j < kK / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        fa[4 * j + e] = __bfloat162float(A[acc_index<kK>(j, e)]);
      }
#pragma unroll
    for (int ks = 0; ks < kK / 16; ++ks) jcg::wg_acc_to_a<kK>(fa, ks, ra[ks]);
  }
  float d[N / 2];
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      d[4 * j + e] = kC ? C[acc_index<N>(j, e)] : 12345.f;
    }
  jcg::wgmma_fence_operand(d);
  jcg::wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kK / 16; ++ks) {
    const int slab = ks / (kSlab / 16), kk = ks % (kSlab / 16);
    const uint64_t da = kMnA ? jcg::sw128_desc(sA + 2048 * ks, kK * 128)
                             : jcg::sw128_desc(sA + slab * kM * 128 + 32 * kk);
    const uint64_t db = kMnB ? jcg::sw128_desc(sB + (kNOff / 64) * kK * 128 + 2 * (kNOff % 64) +
                                                   2048 * ks,
                                               kK * 128)
                             : jcg::sw128_desc(sB + slab * NS * 128 + 128 * kNOff + 32 * kk);
    if constexpr (kRegA) {
      jcg::wgmma_m64k16_rs<N, kMnB, kScaleA>(d, ra[ks], db, kC || ks > 0);
    } else {
      jcg::wgmma_m64k16_ss<N, kMnA, kMnB, kScaleA>(d, da, db, kC || ks > 0);
    }
  }
  jcg::wgmma_commit();
  jcg::wgmma_wait<0>();
  jcg::wgmma_fence_operand(d);

#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      D[acc_index<N>(j, e)] = d[4 * j + e];
    }
}

static uint32_t lcg(uint32_t& s) {
  s = s * 1664525u + 1013904223u;
  return s >> 8;
}

template <int N, bool kMnA, bool kMnB, int kScaleA, bool kC, int kNOff = 0, bool kRegA = false>
static bool check(uint32_t seed) {
  std::vector<__nv_bfloat16> a(kM * kK), b(N * kK);
  std::vector<float> af(a.size()), bf(b.size()), c(kM * N, 0.f);
  uint32_t s = seed;
  for (size_t i = 0; i < a.size(); ++i) {
    af[i] = static_cast<float>(static_cast<int>(lcg(s) % 9) - 4) / 4.f;
    a[i] = __float2bfloat16(af[i]);
  }
  for (size_t i = 0; i < b.size(); ++i) {
    bf[i] = static_cast<float>(static_cast<int>(lcg(s) % 9) - 4) / 4.f;
    b[i] = __float2bfloat16(bf[i]);
  }
  if (kC)
    for (float& x : c) x = static_cast<float>(static_cast<int>(lcg(s) % 33) - 16) / 4.f;
  __nv_bfloat16 *dA, *dB;
  float *dC, *dD;
  cudaMalloc(&dA, a.size() * 2);
  cudaMalloc(&dB, b.size() * 2);
  cudaMalloc(&dC, kM * N * sizeof(float));
  cudaMalloc(&dD, kM * N * sizeof(float));
  cudaMemcpy(dC, c.data(), c.size() * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemcpy(dA, a.data(), a.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dB, b.data(), b.size() * 2, cudaMemcpyHostToDevice);
  cudaMemset(dD, 0xFF, kM * N * sizeof(float));  // NaN: every element must be written
  const size_t smem = (kM + N + kNOff) * kK * 2 + 1024;
  auto kernel = wgmma_check_kernel<N, kMnA, kMnB, kScaleA, kC, kNOff, kRegA>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       static_cast<int>(smem));
  kernel<<<1, 128, smem>>>(dA, dB, dC, dD);
  const cudaError_t err = cudaDeviceSynchronize();
  std::vector<float> d(kM * N);
  cudaMemcpy(d.data(), dD, d.size() * sizeof(float), cudaMemcpyDeviceToHost);
  cudaFree(dA);
  cudaFree(dB);
  cudaFree(dC);
  cudaFree(dD);
  char name[128];
  std::snprintf(name, sizeof(name), "wgmma m64n%dk16 (K = %d, A %s, B %s at N offset %d, %sA B%s)",
                N, kK, kRegA ? "in registers" : kMnA ? "MN-major" : "K-major",
                kMnB ? "MN-major" : "K-major", kNOff, kScaleA < 0 ? "-" : "", kC ? " + C" : "");
  if (err != cudaSuccess) {
    std::printf("%s: CUDA error %s\n", name, cudaGetErrorString(err));
    return false;
  }
  int bad = 0;
  for (int m = 0; m < kM; ++m)
    for (int n = 0; n < N; ++n) {
      float ref = 0.f;
      for (int k = 0; k < kK; ++k) ref += af[m * kK + k] * bf[n * kK + k];
      ref = c[m * N + n] + kScaleA * ref;
      const float got = d[m * N + n];
      if (!(got == ref)) {
        if (bad < 4) std::printf("  D[%d][%d] = %g, reference %g\n", m, n, got, ref);
        ++bad;
      }
    }
  std::printf("%s: %d of %d elements differ%s\n", name, bad, kM * N,
              bad ? " FAILED" : ", OK");
  return bad == 0;
}

int main() {
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
    std::printf("no CUDA device\n");
    return 2;
  }
  if (major != 9) {
    std::printf("needs an sm_90 GPU, found compute capability %d.x\n", major);
    return 2;
  }
  // <N, A MN-major, B MN-major, sign of A, + C>: the four plain products, then the state walk's
  // two (u - W S: A K-major, B MN-major, -A, + C; S + Kd^T v_new: both MN-major, + C) and A
  // MN-major with a K-major B at N = 128
  // and N = 32 blocks at N offset 32 of a 64-wide tile and 96 of a 128-wide one (chunk_bwd's
  // blocks): B K-major (rows 32.., 96..) and MN-major (columns 32.. of the first slab, 32.. of
  // the second); then A from registers (wgmma_m64k16_rs): the products of a state walk that holds
  // S^T in registers (u^T - S^T W^T: B K-major, -A, + C; S^T + Vd^T K: B MN-major at N = 128)
  // and N = 32, 64 without C
  const bool ok[15] = {
      check<64, false, false, 1, false>(1u),    check<128, false, false, 1, false>(2u),
      check<64, false, true, 1, false>(3u),     check<128, false, true, 1, false>(4u),
      check<64, false, true, -1, true>(5u),     check<64, true, true, 1, true>(6u),
      check<128, true, false, -1, false>(7u),   check<32, false, false, 1, false, 32>(8u),
      check<32, true, true, 1, true, 32>(9u),   check<32, false, false, 1, false, 96>(10u),
      check<32, true, true, 1, true, 96>(11u),
      check<64, false, false, -1, true, 0, true>(12u),
      check<128, false, true, 1, true, 0, true>(13u),
      check<32, false, false, 1, false, 0, true>(14u),
      check<64, false, true, 1, false, 0, true>(15u)};
  bool all = true;
  for (bool x : ok) all = all && x;
  return all ? 0 : 1;
}
