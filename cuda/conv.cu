// The short causal depthwise conv per document (conv.py: short_conv), forward and backward:
//
//   jax_cake_gdn_conv_fwd(x [T, C], weight [C, W], pos int32[T]; activation) -> y [T, C]
//   jax_cake_gdn_conv_bwd(x, weight, pos, dy [T, C]; activation)
//       -> dx [T, C], dweight f32[C, W], partials f32[NB, C, W] (workspace)
//
//   z[t, c] = sum over s < W with s <= pos[t] of weight[c, W-1-s] * x[t-s, c];  y = silu(z) or z
//
// pos[t] is the token's position inside its document (taps before the document start read zero).
// x, dy, y, dx share one dtype (bf16 or f32); weight is bf16 or f32; all arithmetic is f32.
//
// Mapping (both kernels): a CTA of 8 warps covers one chunk of 32 * VEC channels; the warps are
// stacked along tokens and a thread owns VEC consecutive channels of TPT consecutive tokens
// (VEC * sizeof(T) bytes per access, a warp reads 32 * VEC contiguous channels of one row:
// coalesced). A thread issues all the loads of its tile up front (many independent loads in
// flight), then computes from registers. The W-1 rows before the tile (and, in the backward, the
// W-1 rows after it) are read again: they are the neighbouring warp's rows, L1/L2 hits.
//   forward:  VEC = 16 bytes (8 bf16 or 4 f32), TPT = 8;
//   backward: VEC = 8 bytes (4 bf16 or 2 f32: 8 channels x W taps of state and 25 rows of
//             16 bytes in flight would cost too many registers), TPT = 8; dx[u] needs the
//             pre-activation gradient g at u..u+W-1, so the thread recomputes g for W-1 tokens
//             past its tile.
// VEC = 1 when C is not a multiple of VEC or a buffer is misaligned. The chunk's weights go
// through shared memory (coalesced global read, once per CTA).
// dweight: the CTA of token block b (T / NB tokens, walked tile by tile) adds its warps' sums in
// warp order and writes them to partials[b]; a second kernel adds the NB partials in block
// order. No atomics: bitwise reproducible.
#include "device_common.cuh"
#include "handler.cuh"

namespace jax_cake_gdn {
namespace {

constexpr int kWarps = 8;                // warps per CTA, stacked along tokens
constexpr int kConvThreads = kWarps * 32;
constexpr int kFwdTokens = 8;            // tokens per thread, forward
constexpr int kBwdTokens = 8;            // tokens per thread (per tile step), backward
constexpr int kFwdTile = kWarps * kFwdTokens;  // tokens per forward CTA
constexpr int kBwdTile = kWarps * kBwdTokens;  // tokens per backward tile step
constexpr int kSumThreads = 256;
constexpr int kSumUnroll = 16;           // partial rows in flight per thread of sum_partials
constexpr int kBwdRowBytes = 8;          // bytes per thread and row, backward vector path

// ---------------------------------------------------------------- per-thread rows

// VEC consecutive elements of one row, kept packed as loaded (bf16 pairs or f32 bits).
template <typename T, int VEC>
struct Row {
  static constexpr int kWords = (VEC * static_cast<int>(sizeof(T)) + 3) / 4;
  uint32_t w[kWords];
};

template <typename T, int VEC>
__device__ __forceinline__ void zero_row(Row<T, VEC>& r) {
#pragma unroll
  for (int i = 0; i < Row<T, VEC>::kWords; ++i) r.w[i] = 0u;
}

// p is aligned to VEC * sizeof(T) bytes (the dispatch checks it); read-only path.
template <typename T, int VEC>
__device__ __forceinline__ void load_row(const T* p, Row<T, VEC>& r) {
  constexpr int kBytes = VEC * static_cast<int>(sizeof(T));
  if constexpr (kBytes == 16) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    r.w[0] = v.x; r.w[1] = v.y; r.w[2] = v.z; r.w[3] = v.w;
  } else if constexpr (kBytes == 8) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    r.w[0] = v.x; r.w[1] = v.y;
  } else if constexpr (kBytes == 4) {
    r.w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
  } else {
    static_assert(kBytes == 2, "row of one bf16");
    r.w[0] = __ldg(reinterpret_cast<const unsigned short*>(p));
  }
}

// Packed row -> f32 (bf16 -> f32 is exact: the bits go to the high half).
template <typename T, int VEC>
__device__ __forceinline__ void unpack(const Row<T, VEC>& r, float (&f)[VEC]) {
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) f[i] = __uint_as_float(r.w[i]);
  } else if constexpr (VEC == 1) {
    f[0] = __uint_as_float(r.w[0] << 16);
  } else {
#pragma unroll
    for (int i = 0; i < VEC / 2; ++i) {
      f[2 * i] = __uint_as_float(r.w[i] << 16);  // the lower channel sits in the low half
      f[2 * i + 1] = __uint_as_float(r.w[i] & 0xffff0000u);
    }
  }
}

template <int VEC>
__device__ __forceinline__ void store_row(float* p, const float (&f)[VEC]) {
  if constexpr (VEC == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(f[0], f[1], f[2], f[3]);
  } else if constexpr (VEC == 2) {
    *reinterpret_cast<float2*>(p) = make_float2(f[0], f[1]);
  } else {
    static_assert(VEC == 1, "f32 rows are 4, 2 or 1 channels");
    p[0] = f[0];
  }
}

template <int VEC>
__device__ __forceinline__ void store_row(bf16* p, const float (&f)[VEC]) {
  if constexpr (VEC == 8) {
    *reinterpret_cast<uint4*>(p) = make_uint4(pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]),
                                              pack_bf16(f[4], f[5]), pack_bf16(f[6], f[7]));
  } else if constexpr (VEC == 4) {
    *reinterpret_cast<uint2*>(p) = make_uint2(pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]));
  } else {
    static_assert(VEC == 1, "bf16 rows are 8, 4 or 1 channels");
    p[0] = __float2bfloat16_rn(f[0]);
  }
}

// ws[j][k] = weight[cb0 + k, j] as f32 for the chunk's CH channels (0 past C): one coalesced
// read of the chunk's contiguous CH * W weights by the whole CTA. Ends with __syncthreads.
template <int W, int CH>
__device__ __forceinline__ void load_weight_smem(const void* w, bool w_bf16, int64_t cb0,
                                                 int64_t C, float (&ws)[W][CH]) {
  const int64_t n = min(int64_t{CH}, C - cb0) * W;
  for (int e = threadIdx.x; e < CH * W; e += kConvThreads) {
    float v = 0.f;
    if (e < n) {
      const int64_t g = cb0 * W + e;
      v = w_bf16 ? __bfloat162float(static_cast<const bf16*>(w)[g])
                 : static_cast<const float*>(w)[g];
    }
    ws[e % W][e / W] = v;
  }
  __syncthreads();
}

// wf[j][i] = weight[c0 + i, j] for the thread's channels c0 = cb0 + k0 .. + VEC-1.
template <int W, int CH, int VEC>
__device__ __forceinline__ void weight_regs(const float (&ws)[W][CH], int k0,
                                            float (&wf)[W][VEC]) {
#pragma unroll
  for (int j = 0; j < W; ++j)
#pragma unroll
    for (int i = 0; i < VEC; ++i) wf[j][i] = ws[j][k0 + i];
}

// The pre-activation z of the token at document position p; rows[s] holds x s tokens back
// (rows[0] = the token's own row). The taps are added in the order s = 0, 1, .., W-1.
template <typename T, int W, int VEC>
__device__ __forceinline__ void conv_z(const float (&wf)[W][VEC], const Row<T, VEC>* const* rows,
                                       int p, float (&z)[VEC]) {
  float v[VEC];
  unpack(*rows[0], v);
#pragma unroll
  for (int i = 0; i < VEC; ++i) z[i] = wf[W - 1][i] * v[i];
#pragma unroll
  for (int s = 1; s < W; ++s)
    if (p >= s) {
      unpack(*rows[s], v);
#pragma unroll
      for (int i = 0; i < VEC; ++i) z[i] = fmaf(wf[W - 1 - s][i], v[i], z[i]);
    }
}

// 1 / (1 + exp(-z)) with the hardware exp2 and reciprocal (relative error ~1e-7 for |z| < 20,
// far inside the f32 tolerance of 1e-5; exact 0 / 1 in the tails).
__device__ __forceinline__ float sigmoid(float z) { return __fdividef(1.f, 1.f + __expf(-z)); }

// ---------------------------------------------------------------- kernels

// grid (ceil(T / kFwdTile), ceil(C / (32 * VEC))). Warp w of CTA b: tokens
// (b * kWarps + w) * kFwdTokens + 0..kFwdTokens-1.
template <typename T, int W, int VEC>
__global__ void __launch_bounds__(kConvThreads, 2)
    conv_fwd_kernel(const T* __restrict__ x, const void* __restrict__ w, bool w_bf16,
                    const int32_t* __restrict__ pos, T* __restrict__ y, int64_t num_tokens,
                    int64_t C, bool silu) {
  constexpr int CH = 32 * VEC;
  constexpr int TPT = kFwdTokens;
  constexpr int NR = TPT + W - 1;  // rows t0 - (W-1) .. t0 + TPT - 1
  __shared__ __align__(16) float ws[W][CH];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t cb0 = static_cast<int64_t>(blockIdx.y) * CH;
  load_weight_smem<W, CH>(w, w_bf16, cb0, C, ws);
  const int64_t c0 = cb0 + lane * VEC;
  const int64_t t0 = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * TPT;
  if (c0 >= C || t0 >= num_tokens) return;

  Row<T, VEC> r[NR];  // r[k] = x[t0 - (W-1) + k] (zero outside 0..T-1)
#pragma unroll
  for (int k = 0; k < NR; ++k) {
    const int64_t t = t0 - (W - 1) + k;
    if (t >= 0 && t < num_tokens) {
      load_row(x + t * C + c0, r[k]);
    } else {
      zero_row(r[k]);
    }
  }
  int p[TPT];
#pragma unroll
  for (int k = 0; k < TPT; ++k) p[k] = t0 + k < num_tokens ? __ldg(pos + t0 + k) : 0;
  float wf[W][VEC];
  weight_regs<W, CH, VEC>(ws, lane * VEC, wf);

#pragma unroll
  for (int k = 0; k < TPT; ++k) {
    if (t0 + k >= num_tokens) break;
    const Row<T, VEC>* rows[W];
#pragma unroll
    for (int s = 0; s < W; ++s) rows[s] = &r[k + W - 1 - s];
    float z[VEC];
    conv_z<T, W, VEC>(wf, rows, p[k], z);
    if (silu)
#pragma unroll
      for (int i = 0; i < VEC; ++i) z[i] *= sigmoid(z[i]);
    store_row<VEC>(y + (t0 + k) * C + c0, z);
  }
}

// grid (NB token blocks of `tokens`, ceil(C / (32 * VEC))). The CTA walks its block
// [b * tokens, min((b + 1) * tokens, T)) in tiles of kBwdTile tokens, warp w taking tokens
// w * kBwdTokens.. of each tile; it writes dx for its block and the block's dweight sums to
// partials[b] (zeros for an empty block).
template <typename T, int W, int VEC>
__global__ void __launch_bounds__(kConvThreads, 2)
    conv_bwd_kernel(const T* __restrict__ x, const void* __restrict__ w, bool w_bf16,
                    const int32_t* __restrict__ pos, const T* __restrict__ dy,
                    T* __restrict__ dx, float* __restrict__ partials, int64_t num_tokens,
                    int64_t C, int64_t tokens, bool silu) {
  constexpr int CH = 32 * VEC;
  constexpr int TPT = kBwdTokens;
  constexpr int NG = TPT + W - 1;        // g (and dy, pos) rows t0 .. t0 + TPT + W - 2
  constexpr int NX = TPT + 2 * (W - 1);  // x rows t0 - (W-1) .. t0 + TPT + W - 2
  __shared__ __align__(16) float ws[W][CH];
  __shared__ __align__(16) float red[kWarps][CH * W];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t cb0 = static_cast<int64_t>(blockIdx.y) * CH;
  load_weight_smem<W, CH>(w, w_bf16, cb0, C, ws);
  const int64_t c0 = cb0 + lane * VEC;
  const int64_t tb0 = static_cast<int64_t>(blockIdx.x) * tokens;
  const int64_t tb1 = min(tb0 + tokens, num_tokens);  // <= tb0: an empty block

  float dw[W][VEC];  // dw[j] = this thread's sum for weight[:, j]
#pragma unroll
  for (int j = 0; j < W; ++j)
#pragma unroll
    for (int i = 0; i < VEC; ++i) dw[j][i] = 0.f;

  if (c0 < C) {
    float wf[W][VEC];
    weight_regs<W, CH, VEC>(ws, lane * VEC, wf);
    for (int64_t t0 = tb0 + warp * TPT; t0 < tb1; t0 += kBwdTile) {
      const int64_t te = min(t0 + TPT, tb1);  // the thread's own tokens: t0 .. te-1
      Row<T, VEC> xr[NX];  // xr[k] = x[t0 - (W-1) + k]
      Row<T, VEC> gr[NG];  // gr[k] = dy[t0 + k]
      int p[NG];           // pos[t0 + k]; 0 past T (no tap reaches back from there)
#pragma unroll
      for (int k = 0; k < NX; ++k) {
        const int64_t t = t0 - (W - 1) + k;
        if (t >= 0 && t < num_tokens) {
          load_row(x + t * C + c0, xr[k]);
        } else {
          zero_row(xr[k]);
        }
      }
#pragma unroll
      for (int k = 0; k < NG; ++k) {
        const int64_t t = t0 + k;
        if (t < num_tokens) {
          load_row(dy + t * C + c0, gr[k]);
          p[k] = __ldg(pos + t);
        } else {
          zero_row(gr[k]);
          p[k] = 0;
        }
      }

      // g[k] = dy[t0 + k] * act'(z[t0 + k]) (zero past T), k = 0..NG-1; once g[u + W - 1] is
      // known, dx[t0 + u] and the token's dweight terms are complete.
      float g[NG][VEC];
#pragma unroll
      for (int k = 0; k < NG; ++k) {
        unpack(gr[k], g[k]);
        if (silu) {  // recompute z; d silu(z) / dz = sig (1 + z (1 - sig))
          const Row<T, VEC>* rows[W];
#pragma unroll
          for (int s = 0; s < W; ++s) rows[s] = &xr[k + W - 1 - s];
          float z[VEC];
          conv_z<T, W, VEC>(wf, rows, p[k], z);
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const float sg = sigmoid(z[i]);
            g[k][i] *= sg * (1.f + z[i] * (1.f - sg));
          }
        }
        const int u = k - (W - 1);
        if (u < 0 || t0 + u >= te) continue;
        // dx[t0 + u] = sum over s of weight[:, W-1-s] * g[u + s], s = 0, 1, .. in order
        float d[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) d[i] = wf[W - 1][i] * g[u][i];
#pragma unroll
        for (int s = 1; s < W; ++s)
          if (p[u + s] >= s)
#pragma unroll
            for (int i = 0; i < VEC; ++i) d[i] = fmaf(wf[W - 1 - s][i], g[u + s][i], d[i]);
        store_row<VEC>(dx + (t0 + u) * C + c0, d);
        // dweight[:, W-1-s] += g[u] * x[t0 + u - s]
        float v[VEC];
        unpack(xr[u + W - 1], v);
#pragma unroll
        for (int i = 0; i < VEC; ++i) dw[W - 1][i] = fmaf(g[u][i], v[i], dw[W - 1][i]);
#pragma unroll
        for (int s = 1; s < W; ++s)
          if (p[u] >= s) {
            unpack(xr[u + W - 1 - s], v);
#pragma unroll
            for (int i = 0; i < VEC; ++i)
              dw[W - 1 - s][i] = fmaf(g[u][i], v[i], dw[W - 1 - s][i]);
          }
      }
    }
  }

  // partials[b, c, j] = sum over warps 0..kWarps-1 in order of the warps' dw (fixed order).
#pragma unroll
  for (int i = 0; i < VEC; ++i)
#pragma unroll
    for (int j = 0; j < W; ++j) red[warp][(lane * VEC + i) * W + j] = dw[j][i];
  __syncthreads();
  const int64_t n = min(int64_t{CH}, C - cb0) * W;
  float* out = partials + (static_cast<int64_t>(blockIdx.x) * C + cb0) * W;
  for (int e = threadIdx.x; e < n; e += kConvThreads) {
    float s = red[0][e];
#pragma unroll
    for (int k = 1; k < kWarps; ++k) s += red[k][e];
    out[e] = s;
  }
}

// out[e] = sum_b partials[b, e] for e < n, b in order 0..nb-1 (kSumUnroll loads in flight).
__global__ void __launch_bounds__(kSumThreads)
    sum_partials_kernel(const float* __restrict__ partials, float* __restrict__ out, int64_t n,
                        int64_t nb) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kSumThreads + threadIdx.x;
  if (e >= n) return;
  float s = 0.f;
  int64_t b = 0;
  for (; b + kSumUnroll <= nb; b += kSumUnroll) {
    float v[kSumUnroll];
#pragma unroll
    for (int k = 0; k < kSumUnroll; ++k) v[k] = __ldg(partials + (b + k) * n + e);
#pragma unroll
    for (int k = 0; k < kSumUnroll; ++k) s += v[k];
  }
  for (; b < nb; ++b) s += __ldg(partials + b * n + e);
  out[e] = s;
}

// ---------------------------------------------------------------- host side

template <typename F>
void dispatch_width(int64_t W, F&& f) {
  switch (W) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// Calls f(integral_constant<int, VEC>) with VEC = kVec when C % kVec == 0 and every x-shaped
// buffer is aligned to kVec elements of `elem_bytes` bytes, else 1.
template <int kVec, typename F>
void dispatch_vec(int64_t C, int64_t elem_bytes, std::initializer_list<const void*> ptrs, F&& f) {
  bool vec = C % kVec == 0;
  for (const void* p : ptrs) vec = vec && reinterpret_cast<uintptr_t>(p) % (kVec * elem_bytes) == 0;
  if (vec) {
    f(std::integral_constant<int, kVec>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

// (token blocks, channel chunks of 32 * vec).
dim3 conv_grid(int64_t token_blocks, int64_t C, int vec) {
  return dim3(static_cast<unsigned>(token_blocks), ceil_div(C, int64_t{32} * vec));
}

inline constexpr char kActivation[] = "activation";
using Activation = ffi::Attr<int32_t, kActivation>;  // 0: none, 1: silu

ffi::Error conv_fwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight, S32 pos,
                    Activation activation, Ret<ffi::AnyBuffer> y) {
  JCG_CHECK_CUDA(poison(stream, *y));
  const int64_t T = x.dimensions()[0], C = x.dimensions()[1], W = weight.dimensions()[1];
  if (T == 0 || C == 0) return ffi::Error::Success();
  const bool w_bf16 = weight.element_type() == ffi::DataType::BF16;
  return dispatch(
      [&](auto in) {
        using In = typename decltype(in)::type;
        cudaError_t err = cudaSuccess;
        dispatch_width(W, [&](auto width) {
          constexpr int kW = decltype(width)::value;
          constexpr int kVec16 = 16 / static_cast<int>(sizeof(In));  // 16-byte rows
          dispatch_vec<kVec16>(C, sizeof(In), {x.untyped_data(), y->untyped_data()},
                               [&](auto vec) {
            constexpr int kVec = decltype(vec)::value;
            conv_fwd_kernel<In, kW, kVec>
                <<<conv_grid(ceil_div(T, kFwdTile), C, kVec), kConvThreads, 0, stream>>>(
                    data<In>(x), weight.untyped_data(), w_bf16, pos.typed_data(), data<In>(*y),
                    T, C, *activation == 1);
            err = cudaGetLastError();
          });
        });
        return cuda_status(err, "conv_fwd_kernel");
      },
      FloatType{x.element_type()});
}

ffi::Error conv_bwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight, S32 pos,
                    ffi::AnyBuffer dy, Activation activation, Ret<ffi::AnyBuffer> dx,
                    Ret<F32> dweight, Ret<F32> partials) {
  JCG_CHECK_CUDA(poison_all(stream, *dx, *dweight, *partials));
  const int64_t T = x.dimensions()[0], C = x.dimensions()[1], W = weight.dimensions()[1];
  const int64_t NB = partials->dimensions()[0];
  const int64_t tokens = (T + NB - 1) / NB;  // token block of each partial
  if (C == 0) return ffi::Error::Success();
  const bool w_bf16 = weight.element_type() == ffi::DataType::BF16;
  JCG_RETURN_IF_ERROR(dispatch(
      [&](auto in) {
        using In = typename decltype(in)::type;
        cudaError_t err = cudaSuccess;
        dispatch_width(W, [&](auto width) {
          constexpr int kW = decltype(width)::value;
          constexpr int kVec8 = kBwdRowBytes / static_cast<int>(sizeof(In));  // 8-byte rows
          dispatch_vec<kVec8>(C, sizeof(In),
                              {x.untyped_data(), dy.untyped_data(), dx->untyped_data()},
                              [&](auto vec) {
            constexpr int kVec = decltype(vec)::value;
            conv_bwd_kernel<In, kW, kVec><<<conv_grid(NB, C, kVec), kConvThreads, 0, stream>>>(
                data<In>(x), weight.untyped_data(), w_bf16, pos.typed_data(), data<In>(dy),
                data<In>(*dx), partials->typed_data(), T, C, tokens, *activation == 1);
            err = cudaGetLastError();
          });
        });
        return cuda_status(err, "conv_bwd_kernel");
      },
      FloatType{x.element_type()}));
  sum_partials_kernel<<<ceil_div(C * W, kSumThreads), kSumThreads, 0, stream>>>(
      partials->typed_data(), dweight->typed_data(), C * W, NB);
  JCG_CHECK_CUDA(cudaGetLastError());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cake_gdn

JCG_FFI_HANDLER(conv_fwd, jax_cake_gdn::conv_fwd)
JCG_FFI_HANDLER(conv_bwd, jax_cake_gdn::conv_bwd)
