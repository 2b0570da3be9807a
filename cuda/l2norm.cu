// The q / k L2 norm's backward epilogue of dq / dk (docs/design.md section 1; the forward's rstd
// comes from solve_a, prep.cuh):
//
//   jax_cake_gdn_l2norm_bwd(dy f32[T, HV, K], x [T, H, K], rstd f32[T, H] or f32[1])
//       -> dx [T, H, K] in x's dtype:  d = sum_{j < HV/H} dy[:, h HV/H + j]  (the GVA group sum),
//          dx = rstd (d - (d . y) y) with y = x rstd  (no L2 norm: dx = d)
//
// f32 sums in a fixed order (per-lane partial sums, then a butterfly), so it is deterministic;
// one warp per row, K in {64, 128} (l2norm.cuh: the row's code, which chunk_bwd's epilogue shares).
#include "l2norm.cuh"

namespace jax_cake_gdn {
namespace {

constexpr int kL2Threads = 256;

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
  float xf[E];
#pragma unroll
  for (int i = 0; i < E; ++i)
    xf[i] = rstd != nullptr ? static_cast<float>(x[row * K + lane + 32 * i]) : 0.f;
  l2norm_bwd_row<In, K>(d, xf, rstd != nullptr, rstd != nullptr ? rstd[row] : 1.f,
                        dx + row * K + lane);
}

ffi::Error l2norm_bwd(cudaStream_t stream, F32 dy, ffi::AnyBuffer x, F32 rstd,
                      Ret<ffi::AnyBuffer> dx) {
  JCG_CHECK_CUDA(poison(stream, *dx));
  return launch_l2norm_bwd(stream, dy.typed_data(), dy.dimensions()[1], x, optional_data(rstd),
                           *dx);
}

}  // namespace

ffi::Error launch_l2norm_bwd(cudaStream_t stream, const float* dy, int64_t HV,
                             const ffi::AnyBuffer& x, const float* rstd, ffi::AnyBuffer& dx) {
  const auto xd = x.dimensions();
  const int64_t T = xd[0], H = xd[1], K = xd[2];
  const int64_t rows = T * H;
  if (rows == 0) return ffi::Error::Success();
  return dispatch(
      [&](auto in, auto kd) {
        using In = typename decltype(in)::type;
        constexpr int KD = decltype(kd)::value;
        l2norm_bwd_kernel<In, KD><<<ceil_div(rows, kL2Threads / 32), kL2Threads, 0, stream>>>(
            dy, static_cast<const In*>(x.untyped_data()), rstd, data<In>(dx), rows,
            static_cast<int>(H), static_cast<int>(HV / H));
        return cuda_status(cudaGetLastError(), "l2norm_bwd_kernel");
      },
      FloatType{x.element_type()}, HeadDim{K});
}

}  // namespace jax_cake_gdn

JCG_FFI_HANDLER(l2norm_bwd, jax_cake_gdn::l2norm_bwd)
