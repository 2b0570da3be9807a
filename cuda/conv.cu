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
// A thread owns 8 consecutive channels (one when C % 8 != 0 or a buffer is misaligned) and walks a
// run of tokens keeping the last W-1 rows of x in registers, so x is read about once. The
// backward runs W-1 tokens past its run (dx[u] needs the pre-activation gradient at u..u+W-1).
// dweight: the CTA of token block b writes its run's sums to partials[b]; a second kernel adds
// the NB partials in block order. No atomics: bitwise reproducible.
#include "fwd_args.cuh"

namespace jax_cake_gdn {
namespace {

constexpr int kConvThreads = 128;
constexpr int kFwdTokens = 64;   // tokens per forward CTA
constexpr int kSumThreads = 256;
constexpr int kMaxWidth = 4;

// ---------------------------------------------------------------- per-thread vectors

template <int VEC, typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&f)[VEC]) {
  if constexpr (VEC == 8) {
    load8(p, f);
  } else {
    f[0] = static_cast<float>(p[0]);
  }
}

template <int VEC>
__device__ __forceinline__ void store_vec(float* p, const float (&f)[VEC]) {
  if constexpr (VEC == 8) {
    reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
  } else {
    p[0] = f[0];
  }
}

template <int VEC>
__device__ __forceinline__ void store_vec(bf16* p, const float (&f)[VEC]) {
  if constexpr (VEC == 8) {
    *reinterpret_cast<uint4*>(p) = make_uint4(pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]),
                                              pack_bf16(f[4], f[5]), pack_bf16(f[6], f[7]));
  } else {
    p[0] = __float2bfloat16_rn(f[0]);
  }
}

// wf[j][i] = weight[c0 + i, j] as f32.
template <int W, int VEC>
__device__ __forceinline__ void load_weight(const void* w, bool w_bf16, int64_t c0,
                                            float (&wf)[W][VEC]) {
#pragma unroll
  for (int i = 0; i < VEC; ++i)
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const int64_t e = (c0 + i) * W + j;
      wf[j][i] = w_bf16 ? __bfloat162float(static_cast<const bf16*>(w)[e])
                        : static_cast<const float*>(w)[e];
    }
}

// The last W-1 rows of x: hist[s-1] = x[t-s] (zero before row 0). Size >= 1 for W == 1.
template <int W, int VEC>
struct History {
  float r[W > 1 ? W - 1 : 1][VEC];

  template <typename T>
  __device__ __forceinline__ void init(const T* x, int64_t t, int64_t C, int64_t c0) {
#pragma unroll
    for (int s = 1; s < W; ++s) {
      if (t - s >= 0) {
        load_vec<VEC>(x + (t - s) * C + c0, r[s - 1]);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) r[s - 1][i] = 0.f;
      }
    }
  }

  __device__ __forceinline__ void push(const float (&cur)[VEC]) {
#pragma unroll
    for (int s = W - 2; s >= 1; --s)
#pragma unroll
      for (int i = 0; i < VEC; ++i) r[s][i] = r[s - 1][i];
    if constexpr (W > 1) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) r[0][i] = cur[i];
    }
  }
};

// The pre-activation z of the token whose row is cur, at document position p.
template <int W, int VEC>
__device__ __forceinline__ void conv_z(const float (&wf)[W][VEC], const float (&cur)[VEC],
                                       const History<W, VEC>& h, int p, float (&z)[VEC]) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) z[i] = wf[W - 1][i] * cur[i];
#pragma unroll
  for (int s = 1; s < W; ++s)
    if (p >= s)
#pragma unroll
      for (int i = 0; i < VEC; ++i) z[i] = fmaf(wf[W - 1 - s][i], h.r[s - 1][i], z[i]);
}

__device__ __forceinline__ float sigmoid(float z) { return 1.f / (1.f + expf(-z)); }

// ---------------------------------------------------------------- kernels

// grid (token blocks of `tokens`, channel blocks of kConvThreads * VEC).
template <typename T, int W, int VEC>
__global__ void __launch_bounds__(kConvThreads)
    conv_fwd_kernel(const T* __restrict__ x, const void* __restrict__ w, bool w_bf16,
                    const int32_t* __restrict__ pos, T* __restrict__ y, int64_t num_tokens,
                    int64_t C, int64_t tokens, bool silu) {
  const int64_t c0 = (static_cast<int64_t>(blockIdx.y) * kConvThreads + threadIdx.x) * VEC;
  if (c0 >= C) return;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * tokens;
  const int64_t t1 = min(t0 + tokens, num_tokens);
  float wf[W][VEC];
  load_weight<W, VEC>(w, w_bf16, c0, wf);
  History<W, VEC> h;
  h.init(x, t0, C, c0);
#pragma unroll 2
  for (int64_t t = t0; t < t1; ++t) {
    float cur[VEC], z[VEC];
    load_vec<VEC>(x + t * C + c0, cur);
    conv_z<W, VEC>(wf, cur, h, __ldg(pos + t), z);
    if (silu)
#pragma unroll
      for (int i = 0; i < VEC; ++i) z[i] *= sigmoid(z[i]);
    store_vec<VEC>(y + t * C + c0, z);
    h.push(cur);
  }
}

// grid (NB token blocks of `tokens`, channel blocks). Writes dx for its run and the run's
// dweight sums to partials[blockIdx.x] (zeros for an empty run).
template <typename T, int W, int VEC>
__global__ void __launch_bounds__(kConvThreads)
    conv_bwd_kernel(const T* __restrict__ x, const void* __restrict__ w, bool w_bf16,
                    const int32_t* __restrict__ pos, const T* __restrict__ dy,
                    T* __restrict__ dx, float* __restrict__ partials, int64_t num_tokens,
                    int64_t C, int64_t tokens, bool silu) {
  const int64_t c0 = (static_cast<int64_t>(blockIdx.y) * kConvThreads + threadIdx.x) * VEC;
  if (c0 >= C) return;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * tokens;
  const int64_t t1 = max(t0, min(t0 + tokens, num_tokens));
  const int64_t t_end = min(t1 + W - 1, num_tokens);  // the run plus W-1 tokens of look-ahead
  float wf[W][VEC];
  load_weight<W, VEC>(w, w_bf16, c0, wf);
  float da[W][VEC];  // at step t: da[s] = dx[t - s] so far
  float dw[W][VEC];  // dw[j] = this run's sum for weight[:, j]
#pragma unroll
  for (int j = 0; j < W; ++j)
#pragma unroll
    for (int i = 0; i < VEC; ++i) da[j][i] = dw[j][i] = 0.f;
  History<W, VEC> h{};
  if (t1 > t0) h.init(x, t0, C, c0);  // an empty run (t0 >= T) reads nothing

  for (int64_t t = t0; t < t1 + W - 1; ++t) {
    if (t < t_end) {
      float cur[VEC], g[VEC];
      load_vec<VEC>(x + t * C + c0, cur);
      load_vec<VEC>(dy + t * C + c0, g);
      const int p = __ldg(pos + t);
      if (silu) {  // recompute z; d silu(z) / dz = sig (1 + z (1 - sig))
        float z[VEC];
        conv_z<W, VEC>(wf, cur, h, p, z);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float sg = sigmoid(z[i]);
          g[i] *= sg * (1.f + z[i] * (1.f - sg));
        }
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) da[0][i] = fmaf(wf[W - 1][i], g[i], da[0][i]);
#pragma unroll
      for (int s = 1; s < W; ++s)
        if (p >= s)
#pragma unroll
          for (int i = 0; i < VEC; ++i) da[s][i] = fmaf(wf[W - 1 - s][i], g[i], da[s][i]);
      if (t < t1) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) dw[W - 1][i] = fmaf(g[i], cur[i], dw[W - 1][i]);
#pragma unroll
        for (int s = 1; s < W; ++s)
          if (p >= s)
#pragma unroll
            for (int i = 0; i < VEC; ++i)
              dw[W - 1 - s][i] = fmaf(g[i], h.r[s - 1][i], dw[W - 1 - s][i]);
      }
      h.push(cur);
    }
    // dx[t - (W-1)] has all its contributions (tokens up to t)
    const int64_t u = t - (W - 1);
    if (u >= t0 && u < t1) store_vec<VEC>(dx + u * C + c0, da[W - 1]);
#pragma unroll
    for (int s = W - 1; s >= 1; --s)
#pragma unroll
      for (int i = 0; i < VEC; ++i) da[s][i] = da[s - 1][i];
#pragma unroll
    for (int i = 0; i < VEC; ++i) da[0][i] = 0.f;
  }
  float* out = partials + (static_cast<int64_t>(blockIdx.x) * C + c0) * W;
#pragma unroll
  for (int i = 0; i < VEC; ++i)
#pragma unroll
    for (int j = 0; j < W; ++j) out[i * W + j] = dw[j][i];
}

// out[e] = sum_b partials[b, e] for e < n, b in order 0..nb-1.
__global__ void __launch_bounds__(kSumThreads)
    sum_partials_kernel(const float* __restrict__ partials, float* __restrict__ out, int64_t n,
                        int64_t nb) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kSumThreads + threadIdx.x;
  if (e >= n) return;
  float s = 0.f;
  for (int64_t b = 0; b < nb; ++b) s += partials[b * n + e];
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

// Calls f(integral_constant<int, VEC>) with VEC = 8 when C % 8 == 0 and every x-shaped buffer is
// 16-byte aligned, else 1.
template <typename F>
void dispatch_vec(int64_t C, std::initializer_list<const void*> ptrs, F&& f) {
  bool vec8 = C % 8 == 0;
  for (const void* p : ptrs) vec8 = vec8 && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  if (vec8) {
    f(std::integral_constant<int, 8>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

bool is_float(ffi::DataType dt) { return dt == ffi::DataType::BF16 || dt == ffi::DataType::F32; }

// x [T, C], weight [C, W] (W in 1..4), pos int32[T], activation 0 or 1.
std::string check_conv_inputs(const ffi::AnyBuffer& x, const ffi::AnyBuffer& weight,
                              ffi::Span<const int64_t> pos, int32_t activation) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return "x must be [T, C], got shape " + dims_str(xd);
  if (!is_float(x.element_type()))
    return std::string("x must be bfloat16 or float32, got ") + dtype_name(x.element_type());
  const auto wd = weight.dimensions();
  if (wd.size() != 2 || wd[0] != xd[1])
    return "weight must be [C, W] with C = " + std::to_string(xd[1]) + ", got shape " +
           dims_str(wd);
  if (wd[1] < 1 || wd[1] > kMaxWidth)
    return "weight width W must be in 1..4, got " + std::to_string(wd[1]);
  if (!is_float(weight.element_type()))
    return std::string("weight must be bfloat16 or float32, got ") +
           dtype_name(weight.element_type());
  if (!dims_are(pos, {xd[0]}))
    return "pos must be int32[" + std::to_string(xd[0]) + "], got shape " + dims_str(pos);
  if (activation != 0 && activation != 1)
    return "activation must be 0 (none) or 1 (silu), got " + std::to_string(activation);
  if (xd[1] > int64_t{65535} * kConvThreads) return "C too large: " + std::to_string(xd[1]);
  return {};
}

// An x-shaped result (y, dx) or operand (dy): x's shape and dtype.
std::string check_like_x(const char* name, ffi::Span<const int64_t> d, ffi::DataType dt,
                         const ffi::AnyBuffer& x) {
  if (!(d == x.dimensions()) || dt != x.element_type())
    return std::string(name) + " must have x's shape " + dims_str(x.dimensions()) + " and dtype " +
           dtype_name(x.element_type()) + ", got " + dims_str(d) + " " + dtype_name(dt);
  return {};
}

dim3 conv_grid(int64_t token_blocks, int64_t C, int vec) {
  return dim3(static_cast<unsigned>(token_blocks), ceil_div(C, int64_t{kConvThreads} * vec));
}

#define JCG_HANDLER_NAME "jax_cake_gdn_conv_fwd"

ffi::Error conv_fwd_impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                         ffi::Buffer<ffi::S32> pos, int32_t activation,
                         ffi::Result<ffi::AnyBuffer> y) {
  JCG_CHECK_MSG(check_conv_inputs(x, weight, pos.dimensions(), activation));
  JCG_CHECK_MSG(check_like_x("y", y->dimensions(), y->element_type(), x));
  const int64_t T = x.dimensions()[0], C = x.dimensions()[1], W = weight.dimensions()[1];
  JCG_CHECK_ARG(T / kFwdTokens < (int64_t{1} << 31) - 1, "T too large: " + std::to_string(T));

  JCG_CHECK_CUDA(poison(stream, y->untyped_data(), y->size_bytes()));
  if (T == 0 || C == 0) return ffi::Error::Success();
  const bool w_bf16 = weight.element_type() == ffi::DataType::BF16;
  cudaError_t err = cudaSuccess;
  dispatch_float_type(x.element_type(), [&](auto tag) {
    using In = typename decltype(tag)::type;
    dispatch_width(W, [&](auto width) {
      constexpr int kW = decltype(width)::value;
      dispatch_vec(C, {x.untyped_data(), y->untyped_data()}, [&](auto vec) {
        constexpr int kVec = decltype(vec)::value;
        conv_fwd_kernel<In, kW, kVec>
            <<<conv_grid(ceil_div(T, kFwdTokens), C, kVec), kConvThreads, 0, stream>>>(
                static_cast<const In*>(x.untyped_data()), weight.untyped_data(), w_bf16,
                pos.typed_data(), static_cast<In*>(y->untyped_data()), T, C, kFwdTokens,
                activation == 1);
        err = cudaGetLastError();
      });
    });
  });
  JCG_CHECK_CUDA(err);
  return ffi::Error::Success();
}

#undef JCG_HANDLER_NAME
#define JCG_HANDLER_NAME "jax_cake_gdn_conv_bwd"

ffi::Error conv_bwd_impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                         ffi::Buffer<ffi::S32> pos, ffi::AnyBuffer dy, int32_t activation,
                         ffi::Result<ffi::AnyBuffer> dx, ffi::ResultBuffer<ffi::F32> dweight,
                         ffi::ResultBuffer<ffi::F32> partials) {
  JCG_CHECK_MSG(check_conv_inputs(x, weight, pos.dimensions(), activation));
  JCG_CHECK_MSG(check_like_x("dy", dy.dimensions(), dy.element_type(), x));
  JCG_CHECK_MSG(check_like_x("dx", dx->dimensions(), dx->element_type(), x));
  const int64_t T = x.dimensions()[0], C = x.dimensions()[1], W = weight.dimensions()[1];
  JCG_CHECK_ARG(dims_are(dweight->dimensions(), {C, W}),
                "dweight must be f32[C, W] = f32" + dims_str(weight.dimensions()) + ", got shape " +
                    dims_str(dweight->dimensions()));
  const auto pd = partials->dimensions();
  JCG_CHECK_ARG(pd.size() == 3 && pd[0] >= 1 && pd[0] < (int64_t{1} << 31) && pd[1] == C &&
                    pd[2] == W,
                "partials must be f32[NB, C, W] with NB >= 1, got shape " + dims_str(pd));
  const int64_t NB = pd[0];
  const int64_t tokens = (T + NB - 1) / NB;  // token block of each partial

  JCG_CHECK_CUDA(poison(stream, dx->untyped_data(), dx->size_bytes()));
  JCG_CHECK_CUDA(poison(stream, *dweight));
  JCG_CHECK_CUDA(poison(stream, *partials));
  if (C == 0) return ffi::Error::Success();
  const bool w_bf16 = weight.element_type() == ffi::DataType::BF16;
  cudaError_t err = cudaSuccess;
  dispatch_float_type(x.element_type(), [&](auto tag) {
    using In = typename decltype(tag)::type;
    dispatch_width(W, [&](auto width) {
      constexpr int kW = decltype(width)::value;
      dispatch_vec(C, {x.untyped_data(), dy.untyped_data(), dx->untyped_data()}, [&](auto vec) {
        constexpr int kVec = decltype(vec)::value;
        conv_bwd_kernel<In, kW, kVec><<<conv_grid(NB, C, kVec), kConvThreads, 0, stream>>>(
            static_cast<const In*>(x.untyped_data()), weight.untyped_data(), w_bf16,
            pos.typed_data(), static_cast<const In*>(dy.untyped_data()),
            static_cast<In*>(dx->untyped_data()), partials->typed_data(), T, C, tokens,
            activation == 1);
        err = cudaGetLastError();
      });
    });
  });
  JCG_CHECK_CUDA(err);
  sum_partials_kernel<<<ceil_div(C * W, kSumThreads), kSumThreads, 0, stream>>>(
      partials->typed_data(), dweight->typed_data(), C * W, NB);
  JCG_CHECK_LAUNCH();
  return ffi::Error::Success();
}

#undef JCG_HANDLER_NAME

}  // namespace
}  // namespace jax_cake_gdn

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cake_gdn_conv_fwd, jax_cake_gdn::conv_fwd_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // x
                                  .Arg<xla::ffi::AnyBuffer>()              // weight
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // pos
                                  .Attr<int32_t>("activation")
                                  .Ret<xla::ffi::AnyBuffer>(),  // y
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cake_gdn_conv_bwd, jax_cake_gdn::conv_bwd_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // x
                                  .Arg<xla::ffi::AnyBuffer>()              // weight
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // pos
                                  .Arg<xla::ffi::AnyBuffer>()              // dy
                                  .Attr<int32_t>("activation")
                                  .Ret<xla::ffi::AnyBuffer>()              // dx
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // dweight
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // partials
                              {xla::ffi::Traits::kCmdBufferCompatible});
