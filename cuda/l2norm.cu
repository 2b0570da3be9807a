// The q / k L2 norm (docs/design.md section 1), forward and the backward epilogue of dq / dk:
//
//   jax_cake_gdn_l2norm_rstd(x [T, H, K] bf16 or f32) -> rstd f32[T, H] = 1 / sqrt(sum x^2 + 1e-6)
//   jax_cake_gdn_l2norm_bwd(dy f32[T, HV, K], x [T, H, K], rstd f32[T, H] or f32[1])
//       -> dx [T, H, K] in x's dtype:  d = sum_{j < HV/H} dy[:, h HV/H + j]  (the GVA group sum),
//          dx = rstd (d - (d . y) y) with y = x rstd  (no L2 norm: dx = d)
//
// f32 sums in a fixed order (per-lane partial sums, then a butterfly), so both are deterministic.
// rstd: 16-byte loads, K * sizeof / 16 lanes per row where that is 8, 16 or 32 (K = 64, 128), else
// any K with a warp per row; l2norm_bwd: one warp per row, K in {64, 128}.
#include "handler.cuh"

namespace jax_cake_gdn {
namespace {

constexpr int kL2Threads = 256;

// kLanes > 0: kLanes lanes per row of K = kLanes x 16 / sizeof(In) elements, one 16-byte load a
// lane (K = 64, 128); kLanes = 0: any K, a warp per row, lane-strided loads.
template <typename In, int kLanes>
__global__ void __launch_bounds__(kL2Threads)
    l2norm_rstd_kernel(const In* __restrict__ x, float* __restrict__ rstd, int64_t rows, int K) {
  constexpr int kRowLanes = kLanes > 0 ? kLanes : 32;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * kL2Threads + threadIdx.x) / kRowLanes;
  const int lane = threadIdx.x % kRowLanes;
  float s = 0.f;
  if (row < rows) {
    if constexpr (kLanes > 0) {
      constexpr int kVec = 16 / sizeof(In);
      const uint4 raw = *reinterpret_cast<const uint4*>(x + (row * kLanes + lane) * kVec);
      const In* e = reinterpret_cast<const In*>(&raw);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float v = static_cast<float>(e[i]);
        s = fmaf(v, v, s);
      }
    } else {
      const In* p = x + row * K;
      for (int i = lane; i < K; i += 32) {
        const float v = static_cast<float>(p[i]);
        s = fmaf(v, v, s);
      }
    }
  }
#pragma unroll
  for (int off = kRowLanes / 2; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (row < rows && lane == 0) rstd[row] = rsqrtf(s + 1e-6f);
}

template <typename In, int kLanes>
void launch_l2norm_rstd(cudaStream_t stream, const In* x, float* rstd, int64_t rows, int K) {
  constexpr int kRowLanes = kLanes > 0 ? kLanes : 32;
  const unsigned blocks = ceil_div(rows * kRowLanes, kL2Threads);
  l2norm_rstd_kernel<In, kLanes><<<blocks, kL2Threads, 0, stream>>>(x, rstd, rows, K);
}

ffi::Error l2norm_rstd(cudaStream_t stream, ffi::AnyBuffer x, Ret<F32> rstd) {
  JCG_CHECK_CUDA(poison(stream, *rstd));
  const auto d = x.dimensions();
  const int64_t rows = d[0] * d[1];
  if (rows == 0) return ffi::Error::Success();
  return dispatch(
      [&](auto in) {
        using In = typename decltype(in)::type;
        const auto* xp = data<In>(x);
        const int K = static_cast<int>(d[2]);
        const int64_t row_bytes = d[2] * static_cast<int64_t>(sizeof(In));
        switch (row_bytes % 16 == 0 ? row_bytes / 16 : 0) {  // lanes of 16 bytes per row
          case 8: launch_l2norm_rstd<In, 8>(stream, xp, rstd->typed_data(), rows, K); break;
          case 16: launch_l2norm_rstd<In, 16>(stream, xp, rstd->typed_data(), rows, K); break;
          case 32: launch_l2norm_rstd<In, 32>(stream, xp, rstd->typed_data(), rows, K); break;
          default: launch_l2norm_rstd<In, 0>(stream, xp, rstd->typed_data(), rows, K);
        }
        return cuda_status(cudaGetLastError(), "l2norm_rstd_kernel");
      },
      FloatType{x.element_type()});
}

// Row (t, h): lane l holds elements l + 32 i, i < K / 32 (coalesced 128-byte accesses).
template <typename In, int K>
__global__ void __launch_bounds__(kL2Threads)
    l2norm_bwd_kernel(const float* __restrict__ dy, const In* __restrict__ x,
                      const float* __restrict__ rstd,  // nullable
                      In* __restrict__ dx, int64_t rows, int H, int group) {
  constexpr int E = K / 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kL2Threads / 32) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const int64_t t = row / H;
  const int h = static_cast<int>(row - t * H);
  const float* src = dy + (t * H * group + int64_t{h} * group) * K + lane;
  float d[E];
#pragma unroll
  for (int i = 0; i < E; ++i) d[i] = src[32 * i];
  for (int j = 1; j < group; ++j) {
#pragma unroll
    for (int i = 0; i < E; ++i) d[i] += src[int64_t{j} * K + 32 * i];
  }
  In* out = dx + row * K + lane;
  if (rstd != nullptr) {
    const float r = rstd[row];
    const In* xr = x + row * K + lane;
    float y[E], s = 0.f;
#pragma unroll
    for (int i = 0; i < E; ++i) {
      y[i] = static_cast<float>(xr[32 * i]) * r;
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

ffi::Error l2norm_bwd(cudaStream_t stream, F32 dy, ffi::AnyBuffer x, F32 rstd,
                      Ret<ffi::AnyBuffer> dx) {
  JCG_CHECK_CUDA(poison(stream, *dx));
  const auto xd = x.dimensions();
  const int64_t T = xd[0], H = xd[1], K = xd[2], HV = dy.dimensions()[1];
  const int64_t rows = T * H;
  if (rows == 0) return ffi::Error::Success();
  return dispatch(
      [&](auto in, auto kd) {
        using In = typename decltype(in)::type;
        constexpr int KD = decltype(kd)::value;
        l2norm_bwd_kernel<In, KD><<<ceil_div(rows, kL2Threads / 32), kL2Threads, 0, stream>>>(
            dy.typed_data(), data<In>(x), optional_data(rstd), data<In>(*dx), rows,
            static_cast<int>(H), static_cast<int>(HV / H));
        return cuda_status(cudaGetLastError(), "l2norm_bwd_kernel");
      },
      FloatType{x.element_type()}, HeadDim{K});
}

}  // namespace
}  // namespace jax_cake_gdn

JCG_FFI_HANDLER(l2norm_rstd, jax_cake_gdn::l2norm_rstd)
JCG_FFI_HANDLER(l2norm_bwd, jax_cake_gdn::l2norm_bwd)
