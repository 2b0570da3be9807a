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

namespace jax_cake_gdn {
namespace {

ffi::Error transfer(cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v, F32 beta, BF16 A,
                    F32 G, F32 h0, F32 rstd_k, ChunkTable chunks, SegmentTable segs,
                    S32 transfer_seg, Ret<F32> B, Ret<F32> M) {
  JCG_CHECK_CUDA(poison_all(stream, *B, *M));
  const int64_t U = transfer_seg.dimensions()[0] / 2;
  return dispatch(
      [&](auto in, auto kd, auto vd) -> ffi::Error {
        using In = typename decltype(in)::type;
        constexpr int KD = decltype(kd)::value, VD = decltype(vd)::value;
        auto a = walk_args<In, float>(k, G, h0, rstd_k, chunks, segs, nullptr, B->typed_data());
        a.v = data<In>(v);
        a.beta = beta.typed_data();
        a.A = static_cast<const bf16*>(A.untyped_data());
        a.m_out = M->typed_data();
        a.transfer_seg = transfer_seg.typed_data();
        a.U = static_cast<int>(U);
        a.S = static_cast<int>(segs.count());
        a.VG = VD;  // one CTA a head
        JCG_RETURN_IF_ERROR((walk_maps<WalkMode::kTransfer, KD>(a)));
        if constexpr (KD == VD) {  // B and M in one launch: kind-major slots
          return launch_walk<WalkMode::kTransfer, In, float, KD, VD>(a, 2 * U, stream);
        } else {  // the state widths differ: B at V columns, then M at K
          JCG_RETURN_IF_ERROR((launch_walk<WalkMode::kTransfer, In, float, KD, VD>(a, U, stream)));
          a.kind0 = 1;
          a.VG = KD;
          return launch_walk<WalkMode::kTransfer, In, float, KD, KD>(a, U, stream);
        }
      },
      FloatType{k.element_type()}, HeadDim{k.dimensions()[2]}, HeadDim{v.dimensions()[2]});
}

}  // namespace
}  // namespace jax_cake_gdn

JCG_FFI_HANDLER(transfer, jax_cake_gdn::transfer)
