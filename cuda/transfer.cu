// FFI handler of the units' affine summaries (docs/design.md section 3; the backward twin,
// transfer_bwd, is a mode of the reverse walk: walk_bwd.cu):
//
//   jax_cake_gdn_transfer(k, v, beta, A, G, h0, rstd_k, chunk_start, chunk_len, seg_first,
//                         seg_last, seg_len, transfer_seg)
//       -> B f32[U, HV, K, V], M f32[U, HV, K, K]
//
// transfer_seg int32[2U]: for each unit, the segment whose exit it passes on (B: the walk from
// h0[s] with u = A_u v), then the segment whose transfer matrix is its M (the walk of [K, K]
// states from the identity with u = 0); -1: none, and that unit's B or M is zero. One CTA a
// (kind, unit, value head) on walk_fwd_wg's kTransfer mode (state only: no tape, no output);
// a CTA with nothing to summarise writes its zeros and exits. K == V: both kinds in one launch.
#include "walk_fwd_launch.cuh"

#define JCG_HANDLER_NAME "jax_cake_gdn_transfer"

namespace jax_cake_gdn {
namespace {

ffi::Error transfer_impl(cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v,
                         ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::BF16> A,
                         ffi::Buffer<ffi::F32> G, ffi::Buffer<ffi::F32> h0,
                         ffi::Buffer<ffi::F32> rstd_k, ffi::Buffer<ffi::S32> chunk_start,
                         ffi::Buffer<ffi::S32> chunk_len, ffi::Buffer<ffi::S32> seg_first,
                         ffi::Buffer<ffi::S32> seg_last, ffi::Buffer<ffi::S32> seg_len,
                         ffi::Buffer<ffi::S32> transfer_seg, ffi::ResultBuffer<ffi::F32> B,
                         ffi::ResultBuffer<ffi::F32> M) {
  JCG_CHECK_MSG(check_qk("k", k));
  const auto kd = k.dimensions();
  const int64_t T = kd[0], H = kd[1], K = kd[2];
  int64_t HV, V;
  JCG_CHECK_MSG(check_tokens_v("v", v, "k", k.element_type(), T, HV, V));
  JCG_CHECK_MSG(check_heads(H, HV));
  JCG_CHECK_MSG(check_th("beta", beta.dimensions(), T, HV));
  int64_t NC, S;
  bool has_rstd = false;
  JCG_CHECK_MSG(check_walk_inputs(G, h0, rstd_k, chunk_start, chunk_len, seg_first, seg_last,
                                  seg_len, seg_len.dimensions(), T, H, HV, K, V, NC, S,
                                  has_rstd));
  JCG_CHECK_MSG(check_a(A.dimensions(), NC, HV));
  const auto td = transfer_seg.dimensions();
  JCG_CHECK_ARG(td.size() == 1 && td[0] >= 2 && td[0] % 2 == 0,
                "transfer_seg must be int32[2U], got shape " + dims_str(td));
  const int64_t U = td[0] / 2;
  JCG_CHECK_ARG(2 * U * HV < (int64_t{1} << 31), "U * HV too large");
  JCG_CHECK_ARG(dims_are(B->dimensions(), {U, HV, K, V}),
                "B must be f32[U, HV, K, V], got shape " + dims_str(B->dimensions()));
  JCG_CHECK_ARG(dims_are(M->dimensions(), {U, HV, K, K}),
                "M must be f32[U, HV, K, K], got shape " + dims_str(M->dimensions()));

  JCG_CHECK_CUDA(poison(stream, *B));
  JCG_CHECK_CUDA(poison(stream, *M));
  cudaError_t err = cudaSuccess;
  std::string map_err;
  dispatch_float_type(k.element_type(), [&](auto tag) {
    using In = typename decltype(tag)::type;
    dispatch_head_dim(K, [&](auto kdim) {
      constexpr int KD = decltype(kdim)::value;
      dispatch_head_dim(V, [&](auto vdim) {
        constexpr int VD = decltype(vdim)::value;
        auto a = walk_args<In, float>(k, G, h0, has_rstd ? rstd_k.typed_data() : nullptr,
                                      chunk_start, chunk_len, seg_first, seg_last, seg_len,
                                      nullptr, B->typed_data(), T, H, HV, NC);
        a.v = static_cast<const In*>(v.untyped_data());
        a.beta = beta.typed_data();
        a.A = static_cast<const bf16*>(A.untyped_data());
        a.m_out = M->typed_data();
        a.transfer_seg = transfer_seg.typed_data();
        a.U = static_cast<int>(U);
        a.S = static_cast<int>(S);
        if constexpr (std::is_same_v<In, bf16>) {  // the producer's TMA loads of k, v, A
          map_err = from_a_maps(a, T, H, HV, KD, VD, NC);
          if (!map_err.empty()) return;
        }
        if constexpr (KD == VD) {  // B and M in one launch: kind-major slots
          err = launch_walk<WalkMode::kTransfer, In, float, KD, VD>(a, 2 * U, stream);
        } else {  // the state widths differ: B at V columns, then M at K
          err = launch_walk<WalkMode::kTransfer, In, float, KD, VD>(a, U, stream);
          a.kind0 = 1;
          if (err == cudaSuccess)
            err = launch_walk<WalkMode::kTransfer, In, float, KD, KD>(a, U, stream);
        }
      });
    });
  });
  if (!map_err.empty()) return ffi::Error::Internal(JCG_HANDLER_NAME ": " + map_err);
  JCG_CHECK_CUDA(err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cake_gdn

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_cake_gdn_transfer, jax_cake_gdn::transfer_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()               // k
                                  .Arg<xla::ffi::AnyBuffer>()               // v
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // beta
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // A
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // G
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // h0
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // rstd_k
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // chunk_start
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // chunk_len
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // seg_first
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // seg_last
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // seg_len
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // transfer_seg
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // B
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // M
                              {xla::ffi::Traits::kCmdBufferCompatible});

