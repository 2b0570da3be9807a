// What every FFI handler shares on the host: its binding, the dtype / head-dim dispatch, the
// error tails and the launch helpers.
//
// A handler is a function `ffi::Error impl(cudaStream_t, params...)`; JCG_FFI_HANDLER(name, impl)
// defines the extern "C" symbol jax_cake_gdn_<name> with the binding read from impl's parameter
// list, so each argument is declared once, there: a buffer (ffi::AnyBuffer, F32, BF16, S32) is
// one argument, ChunkTable and SegmentTable are their tables' argument groups, a Ret<...> is a
// result, an ffi::Attr<T, name> an attribute. A failing impl's error gets the target's name.
// The arguments' shapes and dtypes are checked once, by the Python wrappers
// (jax_cake_gdn/primitives/cuda.py), before the custom call is built; a handler reads its sizes
// from the buffers.
#pragma once

#include <cuda_bf16.h>

#include <array>
#include <cstddef>
#include <initializer_list>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "common.cuh"

namespace jax_cake_gdn {

using bf16 = __nv_bfloat16;
using F32 = ffi::Buffer<ffi::F32>;
using BF16 = ffi::Buffer<ffi::BF16>;
using S32 = ffi::Buffer<ffi::S32>;
template <typename T>
using Ret = ffi::Result<T>;

inline constexpr char kScale[] = "scale";
using Scale = ffi::Attr<float, kScale>;
// The forward walk's column tiles (walk_fwd_launch.cuh: walk_column_tiles): 0 lets the handler
// choose, 1 or 2 ask for that many.
inline constexpr char kColumnTiles[] = "column_tiles";
using ColumnTiles = ffi::Attr<int32_t, kColumnTiles>;

// The chunk table (chunks.py): chunk_start, chunk_len int32[NC].
struct ChunkTable {
  S32 start, len;
  int64_t count() const { return start.dimensions()[0]; }
};

// The walks' segment table: seg_first, seg_last, seg_len int32[S] (which CTA walks which segment
// is the handler's own argument: seg_order, transfer_seg, unit_seg).
struct SegmentTable {
  S32 first, last, len;
  int64_t count() const { return len.dimensions()[0]; }
};

// An absent optional buffer (no L2 norm) is passed as f32[1]. Not f32[0]: a zero-size operand
// crashes XLA's SPMD partitioner (shardy) in jax 0.11.2 under shard_map.
inline const float* optional_data(const F32& x) {
  const auto d = x.dimensions();
  return d.size() == 1 && d[0] == 1 ? nullptr : x.typed_data();
}

template <typename T>
inline T* data(ffi::AnyBuffer& x) {
  return static_cast<T*>(x.untyped_data());
}
template <typename T>
inline const T* data(const ffi::AnyBuffer& x) {
  return static_cast<const T*>(x.untyped_data());
}

// ---------------------------------------------------------------- error tails

// Returns the ffi::Error from the enclosing function if it is a failure.
#define JCG_RETURN_IF_ERROR(expr)                        \
  do {                                                   \
    ::xla::ffi::Error jcg_e_ = (expr);                   \
    if (jcg_e_.failure()) return jcg_e_;                 \
  } while (0)

inline ffi::Error cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + " failed: " + cudaGetErrorString(e));
}

// Returns Internal(...) from the enclosing function if a CUDA call failed.
#define JCG_CHECK_CUDA(expr) JCG_RETURN_IF_ERROR(::jax_cake_gdn::cuda_status((expr), #expr))

// A tensor map's encoding ("" or why not, tma.cuh) as an error.
inline ffi::Error map_status(const std::string& why, const char* map) {
  if (why.empty()) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(map) + " map: " + why);
}

#define JCG_CHECK_MAP(expr, map) JCG_RETURN_IF_ERROR(::jax_cake_gdn::map_status((expr), map))

// poison() (common.cuh) of each buffer.
template <typename... Bufs>
inline cudaError_t poison_all(cudaStream_t stream, Bufs&... bufs) {
  cudaError_t e = cudaSuccess;
  ((e = e == cudaSuccess ? poison(stream, bufs.untyped_data(), bufs.size_bytes()) : e), ...);
  return e;
}

// ---------------------------------------------------------------- dispatch

inline const char* dtype_name(ffi::DataType dt) {
  switch (dt) {
    case ffi::DataType::BF16:
      return "bfloat16";
    case ffi::DataType::F32:
      return "float32";
    case ffi::DataType::F16:
      return "float16";
    case ffi::DataType::F64:
      return "float64";
    default:
      return "an unsupported dtype";
  }
}

template <typename T>
struct TypeTag {
  using type = T;
};

// A dispatch choice: calls g with the compile-time value for its run-time one, or fails.
// FloatType: TypeTag<bf16> / TypeTag<float>; HeadDim: integral_constant<int, 64 / 128> (the head
// dims the kernels are instantiated for, primitives/cuda.py: SUPPORTED_DIMS).
struct FloatType {
  ffi::DataType dt;
  template <typename G>
  ffi::Error operator()(G&& g) const {
    if (dt == ffi::DataType::BF16) return g(TypeTag<bf16>{});
    if (dt == ffi::DataType::F32) return g(TypeTag<float>{});
    return ffi::Error::InvalidArgument(std::string("no kernel for ") + dtype_name(dt));
  }
};

struct HeadDim {
  int64_t d;
  template <typename G>
  ffi::Error operator()(G&& g) const {
    if (d == 64) return g(std::integral_constant<int, 64>{});
    if (d == 128) return g(std::integral_constant<int, 128>{});
    return ffi::Error::InvalidArgument("no kernel for head dim " + std::to_string(d));
  }
};

// f(c...) with each choice's compile-time value (f returns ffi::Error).
template <typename F>
inline ffi::Error dispatch(F&& f) {
  return f();
}
template <typename F, typename C, typename... Cs>
inline ffi::Error dispatch(F&& f, const C& c, const Cs&... cs) {
  return c([&](auto x) { return dispatch([&](auto... xs) { return f(x, xs...); }, cs...); });
}

// ---------------------------------------------------------------- launch

// Raise a kernel's dynamic shared-memory limit, then launch it (no host sync, capturable).
template <typename Kernel, typename... Args>
inline cudaError_t launch(Kernel kernel, dim3 grid, int threads, size_t smem, cudaStream_t stream,
                          Args... args) {
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return e;
  }
  kernel<<<grid, threads, smem, stream>>>(args...);
  return cudaGetLastError();
}

// The most dynamic shared memory one CTA may ask for on sm_90: a CTA that asks for it has its SM
// to itself.
constexpr size_t kMaxSmemPerCta = 227 * 1024;

// SMs of the current device (read once per process; 0 if unknown).
inline int sm_count() {
  static const int n = [] {
    int dev = 0, count = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
      return 0;
    return count;
  }();
  return n;
}

// JAX_CAKE_GDN_PDL=0 (read once per process): no programmatic dependent launch (launch(true,
// ...) waits for the kernel before it, as a plain launch).
inline bool pdl_enabled() {
  static const bool enabled = !env_is("JAX_CAKE_GDN_PDL", "0");
  return enabled;
}

// launch(), with programmatic dependent launch when `overlap`: the kernel may start once every
// CTA of the kernel before it in the stream has run griddepcontrol.launch_dependents; it must
// then order its reads of that kernel's writes itself (as chunk_bwd does with the hand-off).
template <typename... Params, typename... Args>
inline cudaError_t launch(bool overlap, void (*kernel)(Params...), dim3 grid, int threads,
                          size_t smem, cudaStream_t stream, Args... args) {
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return e;
  }
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = overlap ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...);
}

// ---------------------------------------------------------------- binding

namespace binding {

// How one impl parameter binds (kSlots FFI values, in order) and is made from the decoded ones.
template <typename T>
struct Param {  // one argument
  static constexpr size_t kSlots = 1;
  template <typename B>
  static auto bind(B&& b) {
    return std::move(b).template Arg<T>();
  }
  template <size_t I, typename Tuple>
  static T make(Tuple& t) {
    return std::get<I>(t);
  }
};

template <>
struct Param<cudaStream_t> {
  static constexpr size_t kSlots = 1;
  template <typename B>
  static auto bind(B&& b) {
    return std::move(b).template Ctx<ffi::PlatformStream<cudaStream_t>>();
  }
  template <size_t I, typename Tuple>
  static cudaStream_t make(Tuple& t) {
    return std::get<I>(t);
  }
};

template <typename T>
struct Param<ffi::Result<T>> {
  static constexpr size_t kSlots = 1;
  template <typename B>
  static auto bind(B&& b) {
    return std::move(b).template Ret<T>();
  }
  template <size_t I, typename Tuple>
  static ffi::Result<T> make(Tuple& t) {
    return std::get<I>(t);
  }
};

template <>
struct Param<ffi::RemainingRets> {  // the results after the named ones
  static constexpr size_t kSlots = 1;
  template <typename B>
  static auto bind(B&& b) {
    return std::move(b).RemainingRets();
  }
  template <size_t I, typename Tuple>
  static ffi::RemainingRets make(Tuple& t) {
    return std::get<I>(t);
  }
};

template <typename T, const char* kName>
struct Param<ffi::Attr<T, kName>> {
  static constexpr size_t kSlots = 1;
  template <typename B>
  static auto bind(B&& b) {
    return std::move(b).template Attr<T>(kName);
  }
  template <size_t I, typename Tuple>
  static ffi::Attr<T, kName> make(Tuple& t) {
    return std::get<I>(t);
  }
};

// A group of kN int32 buffers, made by aggregate initialisation in binding order.
template <typename Group, size_t kN>
struct S32Group {
  static constexpr size_t kSlots = kN;
  template <typename B>
  static auto bind(B&& b) {
    if constexpr (kN == 1) {
      return std::move(b).template Arg<S32>();
    } else {
      return S32Group<Group, kN - 1>::bind(std::move(b).template Arg<S32>());
    }
  }
  template <size_t I, typename Tuple, size_t... J>
  static Group make_from(Tuple& t, std::index_sequence<J...>) {
    return Group{std::get<I + J>(t)...};
  }
  template <size_t I, typename Tuple>
  static Group make(Tuple& t) {
    return make_from<I>(t, std::make_index_sequence<kN>{});
  }
};

template <>
struct Param<ChunkTable> : S32Group<ChunkTable, 2> {};
template <>
struct Param<SegmentTable> : S32Group<SegmentTable, 3> {};

// Binding's constructors are private: each step returns a prvalue (no move) into the next.
template <typename P, typename... Ps, typename B>
auto append(B&& b) {
  if constexpr (sizeof...(Ps) == 0) {
    return Param<P>::bind(std::move(b));
  } else {
    return append<Ps...>(Param<P>::bind(std::move(b)));
  }
}

// The handler XLA calls: decodes the binding's values, makes impl's parameters from them, calls
// impl and prefixes a failure with the target's name.
template <typename... Ps>
struct Handler {
  ffi::Error (*impl)(Ps...);
  const char* name;

  auto binding() const { return append<Ps...>(ffi::Ffi::Bind()); }

  template <typename... Flat>
  ffi::Error operator()(Flat... flat) const {
    std::tuple<Flat...> t(flat...);
    ffi::Error e = call(t, std::index_sequence_for<Ps...>{});
    if (e.failure()) return ffi::Error(*e.errc(), std::string(name) + ": " + e.message());
    return e;
  }

 private:
  // offsets()[i]: where parameter i's values start among the decoded ones
  static constexpr std::array<size_t, sizeof...(Ps) + 1> offsets() {
    constexpr size_t slots[] = {Param<Ps>::kSlots...};
    std::array<size_t, sizeof...(Ps) + 1> o{};
    for (size_t j = 0; j < sizeof...(Ps); ++j) o[j + 1] = o[j] + slots[j];
    return o;
  }
  template <typename Tuple, size_t... I>
  ffi::Error call(Tuple& t, std::index_sequence<I...>) const {
    return impl(Param<Ps>::template make<offsets()[I]>(t)...);
  }
};

template <typename... Ps>
auto bound(ffi::Error (*impl)(Ps...), const char* name) {
  const Handler<Ps...> h{impl, name};
  return h.binding().To(h, {ffi::Traits::kCmdBufferCompatible});
}

}  // namespace binding

}  // namespace jax_cake_gdn

// The extern "C" handler symbol jax_cake_gdn_<name> of `impl` (listed in bindings/handlers.inc).
#define JCG_FFI_HANDLER(name, impl)                                                           \
  extern "C" XLA_FFI_Error* jax_cake_gdn_##name(XLA_FFI_CallFrame* call_frame) {             \
    static auto* handler =                                                                    \
        ::jax_cake_gdn::binding::bound(impl, "jax_cake_gdn_" #name).release();                \
    return handler->Call(call_frame);                                                         \
  }
