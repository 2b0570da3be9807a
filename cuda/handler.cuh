// Host-side argument checks shared by the handlers (prep.cu, walk_fwd.cu, walk_bwd.cu, ...).
// Each returns an empty string when the argument is fine, else the message for JCG_CHECK_ARG.
#pragma once

#include <string>

#include "device_common.cuh"

namespace jax_cake_gdn {

inline bool dims_are(ffi::Span<const int64_t> d, std::initializer_list<int64_t> want) {
  if (d.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t x : want)
    if (d[i++] != x) return false;
  return true;
}

// q / k [T, H, K] (bf16 or f32) with a supported K.
inline std::string check_qk(const char* name, const ffi::AnyBuffer& x) {
  const auto d = x.dimensions();
  if (d.size() != 3) return std::string(name) + " must be [T, H, K], got shape " + dims_str(d);
  if (x.element_type() != ffi::DataType::BF16 && x.element_type() != ffi::DataType::F32)
    return std::string(name) + " must be bfloat16 or float32, got " + dtype_name(x.element_type());
  if (!head_dim_supported(d[2]))
    return std::string(name) + ": K = " + std::to_string(d[2]) +
           " is not supported by the cuda kernels (K must be 64 or 128)";
  if (d[1] <= 0) return std::string(name) + ": H must be positive";
  return {};
}

// An f32 per-token array [T, n].
inline std::string check_th(const char* name, ffi::Span<const int64_t> d, int64_t T, int64_t n) {
  if (!dims_are(d, {T, n}))
    return std::string(name) + " must be f32[" + std::to_string(T) + ", " + std::to_string(n) +
           "], got shape " + dims_str(d);
  return {};
}

// An absent optional buffer (no L2 norm) is passed as f32[1]. Not f32[0]: a
// zero-size operand crashes XLA's SPMD partitioner (shardy) in jax 0.11.2 under shard_map.
inline bool is_absent(ffi::Span<const int64_t> d) { return d.size() == 1 && d[0] == 1; }

// Optional rstd: f32[T, H], or f32[1] for "no L2 norm". Sets `present`.
inline std::string check_rstd(const char* name, ffi::Span<const int64_t> d, int64_t T, int64_t H,
                              bool& present) {
  present = !is_absent(d);
  if (present && !dims_are(d, {T, H}))
    return std::string(name) + " must be f32[" + std::to_string(T) + ", " + std::to_string(H) +
           "] or f32[1] (no L2 norm), got shape " + dims_str(d);
  return {};
}

inline std::string check_table(ffi::Span<const int64_t> start, ffi::Span<const int64_t> len) {
  if (start.size() != 1) return "chunk_start must be int32[NC], got shape " + dims_str(start);
  if (len.size() != 1 || len[0] != start[0])
    return "chunk_len must match chunk_start " + dims_str(start) + ", got " + dims_str(len);
  if (start[0] >= (int64_t{1} << 31)) return "too many chunks";
  return {};
}

// The walks' segment table: seg_first, seg_last, seg_len, seg_order all int32[S], S >= 1
// (seg_order: the segments in the order the walk starts their CTAs, a permutation of 0..S-1;
// chunks.py puts the longest first).
inline std::string check_segments(ffi::Span<const int64_t> first, ffi::Span<const int64_t> last,
                                  ffi::Span<const int64_t> len, ffi::Span<const int64_t> order) {
  if (len.size() != 1 || len[0] < 1) return "seg_len must be int32[S], got shape " + dims_str(len);
  if (!(first == len && last == len && order == len))
    return "seg_first, seg_last, seg_order must match seg_len " + dims_str(len);
  return {};
}

inline std::string check_heads(int64_t H, int64_t HV) {
  if (HV <= 0 || H <= 0 || HV % H != 0)
    return "HV = " + std::to_string(HV) + " must be a positive multiple of H = " +
           std::to_string(H);
  if (HV >= 65536) return "HV too large: " + std::to_string(HV);
  return {};
}

inline std::string check_v(int64_t V) {
  if (!head_dim_supported(V))
    return "V = " + std::to_string(V) +
           " is not supported by the cuda kernels (V must be 64 or 128)";
  return {};
}

// q and k: one [T, H, K] shape (check_qk) and one dtype.
inline std::string check_q_k(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k) {
  std::string m = check_qk("q", q);
  if (!m.empty()) return m;
  if (!(k.dimensions() == q.dimensions()))
    return "k must have q's shape " + dims_str(q.dimensions()) + ", got " +
           dims_str(k.dimensions());
  if (k.element_type() != q.element_type())
    return std::string("k must have q's dtype ") + dtype_name(q.element_type()) + ", got " +
           dtype_name(k.element_type());
  return {};
}

// A [T, HV, V] input (v, do) of dtype dt, the dtype of the array named ref ("q" or "k"):
// sets HV and V (V supported).
inline std::string check_tokens_v(const char* name, const ffi::AnyBuffer& x, const char* ref,
                                  ffi::DataType dt, int64_t T, int64_t& HV, int64_t& V) {
  const auto d = x.dimensions();
  if (!(d.size() == 3 && d[0] == T))
    return std::string(name) + " must be [T, HV, V], got shape " + dims_str(d);
  if (x.element_type() != dt)
    return std::string(name) + " must have " + ref + "'s dtype " + dtype_name(dt) + ", got " +
           dtype_name(x.element_type());
  HV = d[1], V = d[2];
  return check_v(V);
}

#define JCG_CHECK_MSG(expr)                       \
  do {                                            \
    const std::string jcg_msg_ = (expr);          \
    JCG_CHECK_ARG(jcg_msg_.empty(), jcg_msg_);    \
  } while (0)

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

// JAX_CAKE_GDN_PDL=0 (read once per process): no programmatic dependent launch (launch(true,
// ...) waits for the kernel before it, as a plain launch).
inline bool pdl_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("JAX_CAKE_GDN_PDL");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
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

}  // namespace jax_cake_gdn
