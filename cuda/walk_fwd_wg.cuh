// The forward state walks on Hopper warpgroup MMA, one kernel template for three modes
// (WalkMode):
//   kTapes, the state walk (docs/design.md section 1): reads w, u; writes the h tape, v_new and the
//     final state;
//   kReplay, the light backward's replay: the same walk and outputs (plus w), but reads A and
//     makes w, u on chip as prep does (bit for bit), so no wy pass is needed;
//   kOut, the light forward's fused walk + output: writes o and the final state (neither h nor
//     v_new leaves the chip), and reads A instead of w, u (it makes them on chip);
//   kOutTapes, the full forward: kOut that also stores kReplay's h, v_new and w (bit for bit:
//     the same values), so the full backward needs no replay;
//   kTransfer, the units' affine summaries (transfer.cu): kOut's transposed walk without q and
//     o, from a CTA's own entry (kind 0, B: h0 and u = A_u v; kind 1, M: the identity and u = 0),
//     its exit state out, nothing else.
// Below, "tapes" is kTapes and kReplay where they share their compute path.
// Per segment and value head, walk the segment's chunks in order:
//
//   h[c] = S;   v_new = u - w S;   S <- e^{G_C} S + k^T diag(d) v_new,  d_t = r_t e^{G_C - G_t}
//   (kOut)  Att_ij = [j <= i] e^{G_i - G_j} (q_i . k_j) r_j;
//           o_i = scale rq_i (e^{G_i} q_i S + (Att v_new)_i)
//
// (r = rstd of k, rq = rstd of q, 1 without L2 norm; d = 0 beyond the chunk). q and k enter the
// products as they are (bf16 q, k land by cp.async straight into their swizzled slabs, f32 q, k
// are rounded on the way) and every per-token factor is applied to an accumulator or to v_new.
// One CTA of V / 64 compute warpgroups plus a producer warpgroup per (segment, value head, column
// tile), grid S x HV x VG / V (segment-major, the segments in seg_order: longest first, so that
// the last wave holds the short ones). Compute warpgroup wg owns the value columns v0 + 64 wg..
// v0 + 64 wg + 63 of the VG in memory (one tile: v0 = 0, VG = V).
// Tapes: its K x 64 f32 state in K / 64 wgmma accumulators of 64 x 64 (rows: key, columns:
// value; wg_acc.cuh) and its slabs Sb, Vd. Per chunk:
//   top: Sb = bf16(S); the product-1 accumulator = u; warpgroup barrier
//   product 1: v_new = u - Ws Sb  (m64n64, K / 16 steps; A = w K-major, B = Sb MN-major);
//     h[c] = Sb while the product runs (kReplay: one TMA store a warpgroup; kTapes: 16-byte
//     stores); v_new to global
//   Vd = bf16(d v_new)
//   product 2: S = e^{G_C} S + K^T Vd  (per 64-key block: m64n64, 4 steps; A = k MN-major)
// kOut: the state transposed, S^T (64 value rows x K keys, one m64nK accumulator), and the
// chain in registers: bf16(S^T) and bf16(v_new^T) are the A operands (wgmma_m64k16_rs,
// wg_acc_to_a), so no slab, fence or warpgroup barrier sits between the products. Per chunk:
//   top: sa = bf16(S^T) fragments; the product-1 accumulator = u^T (the producer's layout)
//   product 1: v_new^T = u^T - S^T W^T  (A = sa, B = w [token][K] K-major); then
//     o^T = S^T Q^T (A = sa, B = q K-major) and att = Q K^T, the columns kAttCols wg.. of Att
//     (kAttCols = 64 / (V / 64); SS)
//   vn = bf16(v_new^T), vd = bf16(v_new^T diag(d)); Att gated into its slab; CTA compute barrier
//   product 2: o^T = diag-cols(e^G) o^T + vn Att^T (B = Att [i][j] K-major);
//     S^T = e^{G_C} S^T + vd K (m64nK, B = k [token][K] MN-major)
//   o = scale rq (o^T)^T: bf16 through the Vd slab by stmatrix .trans, then one TMA store of a
//   whole chunk (16-byte stores of the rows < len of a partial one; f32 o: 4-byte stores)
// kOutTapes adds, per chunk: h[c] = bf16(S) (S^T by stmatrix .trans into its own slabs, while
// the products run) and w's rows by TMA stores at the top; v_new's rows (from the vn fragments)
// beside o's at the end. Each store's thread waits for the reads of its earlier ones before o's
// slab is written, so no slab is rewritten before it is read.
// All modes make the same walk products over the same bf16 operands in the same k16 order.
// The per-token factors of kOut (d, e^G, scale rq) are made by the producer into its rows.
// Every input of chunk c + 1 (k, w, u, rows G / rstd; kOut: q, rstd_q) is double-buffered by
// chunk parity and made by the producer warpgroup (after the compute warpgroups) while the
// compute warps work on chunk c: it issues the cp.async pieces, waits for them and fences them
// before it arrives at the barrier that opens chunk c + 1. kOut with bf16 inputs loads q, k, v
// and A by TMA (tma.cuh; one thread, one mbarrier a buffer), then zeroes the rows past a
// partial chunk's end (TMA reads on into the next document), as the cp.async zero fill does.
// With a_ready (walk_fwd.cu: solve_a_walk_output, bf16 inputs) the walk starts while solve_a runs
// on the SMs it leaves idle: the TMA thread waits for A's flags of chunks c.. (kAReadyBatch at a
// time) before it loads chunk c.
// kTapes copies w and u. kOut and kReplay make them from A as prep does (prep.cuh):
//   A_u = bf16(A diag(beta)),  A_w = bf16(A diag(beta e^G r))   (A bf16 from solve_a / prep)
//   w = A_w K,  u = A_u V   (m64n64 wgmma blocks, 4 k16 steps from zero, rounded to bf16 into
//   the slabs: prep's mma.sync products, so kReplay's w, u are prep's bit for bit)
// kOut takes u transposed (u^T = V^T A_u^T: the same sums, operand roles swapped). v lands in
// the u slabs (each 64-column block of u^T overwrites the v columns it read) and k in its own
// slabs (the compute warps read it as they are). In kReplay the producer makes w alone; each
// compute warpgroup makes its 64 columns of u from A_u (double-buffered) and the v slabs straight
// into its product-1 accumulator, rounded as the slab would round it, and the compute warps
// store w's token rows from the w slab for walk_bwd while product 1 runs (TMA for a whole chunk):
// the producer, which the compute warps waited for, does less. The issuing thread of each TMA
// store waits for its read before the slab is written again.
// Registers (setmaxnreg, WalkFwdWgRegs): the producer drops to 56 (kOut, kReplay: 88, for its
// 32-register wgmma accumulator), the compute warpgroups take the rest (V = 128: 168 a thread at
// launch, compute 224, kOut and kReplay 208; kTapes at V = 64: 2 CTAs per SM, 128 at launch,
// compute 200; kOut, kReplay at V = 64: 1 CTA per SM, no reallocation).
// Shared memory (K = V = 128; WalkFwdWgSmem): k, w, u 2 x 16 KB each, Vd 2 x 8 KB, rows, + 1 KB
// alignment; tapes: Sb 2 x 16 KB, 146 KB in all (kReplay: + A_u 2 x 8 KB, A_w 8 KB, 3 rows a
// buffer);
// kOut: q 2 x 16 KB, Att 8 KB, A_u and A_w 8 KB each, 6 rows a buffer: about 172 KB (kOutTapes:
// + h 2 x 16 KB and v_new 2 x 8 KB on their way out, about 220 KB). One CTA of 12 warps per SM.
#pragma once

#include <type_traits>

#include "handoff.cuh"
#include "tma.cuh"
#include "wg_acc.cuh"

namespace jax_cake_gdn {

// Operands of walk_fwd_wg_kernel (WalkMode): q, rstd_q, o, scale: kOut, kOutTapes; v, beta, A:
// all but kTapes; w, u: kTapes; h, v_new: all but kOut; w_out: kReplay, kOutTapes.
template <typename In, typename Out>
struct WalkFwdArgs {
  // bf16 inputs: the producer's TMA loads (kOut: q, k, v, A; kTapes: k, w, u; kReplay,
  // kTransfer: k, v, A)
  CUtensorMap tm_q, tm_k, tm_v, tm_A, tm_w, tm_u;
  // the compute warps' TMA stores: h (kReplay, kOutTapes: [NC * HV * K rows, V]); w_out
  // (kReplay, kOutTapes), o (bf16 o) and v_new (kOutTapes) as token arrays [T, heads, D], for
  // whole chunks
  CUtensorMap tm_h, tm_wout, tm_o, tm_vnew;
  const In* q;
  const In* k;
  const In* v;
  const float* beta;
  const bf16* A;
  const bf16* w;
  const bf16* u;
  const float* G;
  const float* h0;
  const float* rstd_q;  // nullable
  const float* rstd;    // of k; nullable
  const int32_t* cstart;
  const int32_t* clen;
  const int32_t* seg_first;
  const int32_t* seg_last;
  const int32_t* seg_len;
  const int32_t* seg_order;
  Out* o;
  bf16* h;
  bf16* v_new;
  bf16* w_out;
  float* final_state;  // kTransfer: B [U, HV, K, V] (kind 0)
  float* m_out;        // kTransfer: M [U, HV, K, K] (kind 1)
  // kTransfer: per kind (B, then M) and unit, the segment to summarise (-1: none, zeros out)
  const int32_t* transfer_seg;
  // kOut, kOutTapes with bf16 inputs: int32[1 + NC HV], solve_a runs ahead of the walk (the
  // walk launched behind it) and publishes each item's A at [1 + item] (handoff.cuh); null: A
  // is complete before the launch
  const int32_t* a_ready;
  int64_t num_tokens;
  int H, HV, NC;
  // v's (and u's, o's, v_new's, the states' and h's) columns in memory: V (one CTA a head, the
  // default) or, for the V = 64 kernel, 128 (launch_walk's column tiles: two CTAs a head)
  int VG;
  int U, S, kind0;  // kTransfer: units, segments, the first kind of this launch
  float scale;
};

// Chunks of A flags the forward walk's producer reads per round trip (WalkFwdArgs::a_ready).
constexpr int kAReadyBatch = 8;

// What an instance of walk_fwd_wg_kernel reads and writes.
enum class WalkMode {
  kTapes,   // k, w, u in; the h tape, v_new and the final state out (the full forward)
  kReplay,  // k, v, beta, A in, w and u made on chip as prep makes them (bit for bit); the h
            // tape, v_new, w and the final state out (the light backward's replay)
  kOut,     // q, k, v, beta, A in, w and u made on chip; o and the final state out (the light
            // forward)
  kOutTapes,  // kOut plus kReplay's tapes out: h, v_new, w (the full forward, no second walk)
  kTransfer,  // k, v, beta, A in; a unit's exit state from its entry (B or M), nothing else
};

// kOut and kOutTapes share every input and product; kOutTapes also stores the tapes.
constexpr bool walk_outputs_o(WalkMode m) {
  return m == WalkMode::kOut || m == WalkMode::kOutTapes;
}

// The modes that carry the state transposed in registers (kOut's walk): w, u^T made by the
// producer, the per-token factors in its rows.
constexpr bool walk_transposed(WalkMode m) {
  return walk_outputs_o(m) || m == WalkMode::kTransfer;
}

template <WalkMode M, int K, int V>
struct WalkFwdWgSmem {
  static constexpr bool kOut = walk_outputs_o(M), kFromA = M != WalkMode::kTapes;
  static constexpr bool kReplay = M == WalkMode::kReplay, kT = walk_transposed(M);
  static constexpr int kWarpgroups = V / 64;  // compute warpgroups
  static constexpr size_t kSlab = size_t{kChunk} * 128;  // 64 rows x 64 bf16
  static constexpr size_t kTok = K / 64 * kSlab;           // [64 tokens][K] as slabs
  // G, rstd; kOut, kTransfer: scale rstd_q, beta, d, e^G; kReplay: beta
  static constexpr size_t kRows = (kT ? 6 : kReplay ? 3 : 2) * kChunk * sizeof(float);
  static constexpr size_t oK = 0;                                        // 2 buffers
  static constexpr size_t oWs = oK + 2 * kTok;                           // 2 buffers
  static constexpr size_t oUs = oWs + 2 * kTok;  // 2 buffers of V / 64 slabs [token][v]
  static constexpr size_t oSb = oUs + 2 * kWarpgroups * kSlab;  // per warpgroup (tapes)
  // kOutTapes, per warpgroup: h (K x 64, at oSb) and v_new (64 x 64) on their way out
  static constexpr size_t oHt = oSb, oVt = oHt + kWarpgroups * size_t{K} * 128;
  // per warpgroup: Vd (tapes), o on its way to token rows (kOut)
  static constexpr size_t oVd = M == WalkMode::kOut || M == WalkMode::kTransfer ? oSb
                                : M == WalkMode::kOutTapes ? oVt + kWarpgroups * kSlab
                                                           : oSb + kWarpgroups * size_t{K} * 128;
  static constexpr size_t oQ =
      oVd + (M == WalkMode::kTransfer ? 0 : kWarpgroups * kSlab);  // kOut: 2 buffers
  static constexpr size_t oAtt = oQ + (kOut ? 2 * kTok : 0);             // kOut: [i][j]
  // the producer's A_u and A_w (kFromA; A lands in A_u; kReplay: A_u 2 buffers, the compute
  // warps make u from it)
  static constexpr size_t oAu = oAtt + (kOut ? kSlab : 0);
  static constexpr size_t oAw = oAu + (kFromA ? (kReplay ? 2 : 1) * kSlab : 0);
  static constexpr size_t oRows = oAw + (kFromA ? kSlab : 0);            // 2 buffers
  static constexpr size_t oBar = oRows + 2 * kRows;  // 2 mbarriers (TMA: one a buffer)
  static constexpr size_t bytes = oBar + 16 + 1024;  // + alignment
  static_assert(!kFromA || oRows >= oAw + kSlab, "walk_fwd_wg: A_w overlaps the rows");
  static_assert(bytes <= 227 * 1024, "walk_fwd_wg: shared memory over the sm_90 limit");
};

template <int V>
constexpr int walk_fwd_wg_threads() {
  return 2 * V + 128;  // V / 64 compute warpgroups of 128, then the producer warpgroup
}

// CTAs per SM the launch bounds ask for: 2 for kTapes at V = 64 (one compute warpgroup, about
// 106 KB of shared memory), else 1.
template <WalkMode M, int V>
constexpr int walk_fwd_wg_ctas() {
  return M == WalkMode::kTapes && V == 64 ? 2 : 1;
}

// setmaxnreg targets (a multiple of 8 each): the producer's 56 (w, u made on chip: 88) and the
// compute warpgroups' share of the rest of the launch allocation; none when the launch allows 255
// already.
template <WalkMode M, int V>
struct WalkFwdWgRegs {
  static constexpr int kThreads = walk_fwd_wg_threads<V>(), kWarpgroups = V / 64;
  static constexpr int kLaunch = 65536 / (kThreads * walk_fwd_wg_ctas<M, V>()) / 8 * 8;
  static constexpr bool kRealloc = kLaunch < 255;
  static constexpr int kProducerRegs = M == WalkMode::kTapes ? 56 : 88;
  static constexpr int kComputeRegs =
      ((kWarpgroups + 1) * kLaunch - kProducerRegs) / kWarpgroups / 8 * 8;
  static_assert(!kRealloc || (kComputeRegs >= kLaunch && kComputeRegs <= 256),
                "bad register split");
};

template <WalkMode M, typename In, typename Out, int K, int V>
__global__ void __launch_bounds__(walk_fwd_wg_threads<V>(), (walk_fwd_wg_ctas<M, V>()))
    walk_fwd_wg_kernel(const __grid_constant__ WalkFwdArgs<In, Out> a) {
  static_assert(K == 64 || K == 128, "K = 64 or 128");
  static_assert(V == 64 || V == 128, "V = 64 or 128");
  constexpr bool kOut = walk_outputs_o(M), kReplay = M == WalkMode::kReplay;
  constexpr bool kOutTapes = M == WalkMode::kOutTapes, kTransfer = M == WalkMode::kTransfer;
  constexpr bool kT = walk_transposed(M);
  using Sm = WalkFwdWgSmem<M, K, V>;
  constexpr bool kFromA = Sm::kFromA;  // kOut, kReplay: w, u made from A
  using Regs = WalkFwdWgRegs<M, V>;
  static_assert(walk_fwd_wg_ctas<M, V>() * (Sm::bytes + 1024) <= 228 * 1024,
                "walk_fwd_wg: the CTAs per SM do not fit in shared memory");
  constexpr int kCompute = 2 * V;  // compute threads; the producer warpgroup follows them
  constexpr int kLoaders = 128;
  constexpr int kCopyUnroll = 2;  // cp.async pieces per issue-loop step (ptxas spills at 4)
  // bf16 inputs: the producer's tiles come by TMA (one thread issues 7 copies a chunk at K = V =
  // 128; kOut: q, k, v, A; tapes: k, w, u); f32 q, k, v are rounded on the way by its loads.
  constexpr bool kTma = std::is_same_v<In, bf16>;
  static_assert(walk_fwd_wg_threads<V>() == kCompute + kLoaders, "one producer warpgroup");
  constexpr int kAttCols = 64 / Sm::kWarpgroups;  // Att columns per warpgroup (kOut)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = align_1024(smem_raw);

  const int H = a.H, HV = a.HV, NC = a.NC;
  // segments x heads, the segments in seg_order (longest first); an entry out of range walks
  // nothing. kTransfer: (kind, unit) x heads, kind-major, the segment from transfer_seg.
  // Column tiles: VG / V adjacent CTAs a head, tile v0 / V taking the columns v0.. of VG (only
  // the V = 64 kernel takes tiles: at V = 128 they are compile-time 1, as its registers need).
  const int VG = V == 64 ? a.VG : V, tiles = VG / V;
  const int rest = static_cast<int>(blockIdx.x) / tiles;
  const int slot = rest / HV, v0 = static_cast<int>(blockIdx.x) % tiles * V;
  const int unit = kTransfer ? slot % a.U : 0, kind = kTransfer ? a.kind0 + slot / a.U : 0;
  const int hv = rest % HV;
  const int s = kTransfer ? a.transfer_seg[kind * a.U + unit] : a.seg_order[slot];
  const bool with_v = !kTransfer || kind == 0;  // M: u = 0, no v
  const int hk = hv / (HV / H);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  const int wg = warp >> 2, wq = warp & 3;  // warpgroup, warp in it
  const bool producer = threadIdx.x >= kCompute;
  const int64_t state_stride = int64_t{K} * VG;
  const bool s_ok = s >= 0 && s < (kTransfer ? a.S : static_cast<int>(gridDim.x) / (HV * tiles));
  const int c_first = s_ok ? a.seg_first[s] : 0, c_last = s_ok ? a.seg_last[s] : -1;
  const bool empty = !s_ok || a.seg_len[s] <= 0 || c_first < 0 || c_last >= NC ||
                     c_last < c_first;

  auto q_slabs = [&](int b) { return smem + Sm::oQ + b * Sm::kTok; };
  auto k_slabs = [&](int b) { return smem + Sm::oK + b * Sm::kTok; };
  auto w_slabs = [&](int b) { return smem + Sm::oWs + b * Sm::kTok; };
  auto u_slabs = [&](int b) { return smem + Sm::oUs + b * Sm::kWarpgroups * Sm::kSlab; };
  auto rows = [&](int b) { return reinterpret_cast<float*>(smem + Sm::oRows + b * Sm::kRows); };
  auto au_slab = [&](int b) { return smem + Sm::oAu + (kReplay ? b * Sm::kSlab : 0); };
  // A chunk's table entries (loaded a chunk or two ahead of their use by both roles)
  auto span = [&](int c) { return chunk_span(a.cstart, a.clen, min(c, c_last), a.num_tokens); };
  // The compute warps' tape stores. h[c] (this warpgroup's columns) from a K x 64 slab with
  // 16-byte stores, after a barrier that follows the slab's writes:
  [[maybe_unused]] auto copy_slab_to_h = [&](const unsigned char* slab, int c) {
    wg_copy_sb<K>(slab, a.h + (static_cast<int64_t>(c) * HV + hv) * state_stride + v0 + 64 * wg,
                  VG, threadIdx.x % 128);
  };
  // segment 0 of a table with no used chunk: every h zero (warp w zeroes columns 16 w..)
  [[maybe_unused]] auto zero_h_if_no_chunk = [&]() {
    if (s == 0 && NC > 0 && a.clen[0] <= 0) {
      for (int c = 0; c < NC; ++c)
        state_zero_bf16<K>(a.h + (static_cast<int64_t>(c) * HV + hv) * state_stride + v0, VG);
    }
  };
  // w's token rows of a chunk from the producer's slabs Ws (kReplay, kOutTapes; column tile 0
  // only, every tile makes the same w): one TMA store a 64-column slab for a whole chunk; rows
  // past len are the next document's, so a partial one goes by 16-byte stores of its rows < len
  [[maybe_unused]] auto store_w_rows = [&](const unsigned char* Ws, const ChunkSpan& cs) {
    if (v0 != 0) return;
    if (cs.len == kChunk) {
      if (threadIdx.x == 0) {
#pragma unroll
        for (int sl = 0; sl < K / 64; ++sl)
          tma_store_3d(&a.tm_wout, Ws + sl * Sm::kSlab, 64 * sl, hv, cs.start);
      }
    } else {
      bf16* w_rows = a.w_out + (cs.start * HV + hv) * K;
      for (int sl = wg; sl < K / 64; sl += Sm::kWarpgroups)
        wg_copy_slab<kChunk>(Ws + sl * Sm::kSlab, w_rows + 64 * sl, int64_t{HV} * K, cs.len,
                             threadIdx.x % 128);
    }
  };

  // The two roles never merge again after this branch (ptxas applies each register limit to its
  // own path only).
  if (producer) {  // chunk c + 1 into buffer b ^ 1 while the compute warps work on chunk c
    if constexpr (Regs::kRealloc) warpgroup_reg_dealloc<Regs::kProducerRegs>();
    if (empty) return;
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem + Sm::oBar);  // kTma: one a buffer
    if constexpr (kTma) {
      if (threadIdx.x == kCompute) {
        mbar_init(bars, 1);
        mbar_init(bars + 1, 1);
        mbar_init_fence();
      }
      producer_sync();
    }
    // a_ready: before chunk c's A is read, solve_a's flags of this head's chunks c.. (a batch of
    // kAReadyBatch, one round trip) unless an earlier batch covered c. One thread (the TMA's).
    int a_ready_to = c_first - 1;
    [[maybe_unused]] auto wait_a = [&](int c) {
      if (a.a_ready == nullptr || c <= a_ready_to) return;
      const int last = min(c + kAReadyBatch - 1, c_last);
      handoff_wait_items<kAReadyBatch>(a.a_ready + 1, c * HV + hv, last * HV + hv, HV);
      a_ready_to = last;
    };
    // f32 q or k of a chunk, rounded to bf16 on the way (plain loads; bf16 comes by TMA)
    auto copy_qk = [&](const In* src, unsigned char* slabs, int64_t start, int len) {
      load_tile_bf16_at<kChunk, K, 4, kLoaders>(slab_at<kChunk>(slabs),
                                                src + (start * H + hk) * K, int64_t{H} * K,
                                                max(len, 1), ScaleOne{});
    };
    // bf16 inputs: the TMA boxes of chunk c (first token t0) for buffer b, each given to
    // f(dst, map, c0, c1, c2) (c2 < 0: A's 2-D map at (c0, c1)); kOut: A, v, q, k; kReplay: A,
    // v, k; kTapes: k, w, u.
    [[maybe_unused]] auto chunk_boxes = [&](int c, int t0, int b, auto&& f) {
      if constexpr (kFromA) {
        f(au_slab(b), &a.tm_A, 0, (c * HV + hv) * kChunk, -1);
        if (with_v) {
#pragma unroll
          for (int j = 0; j < V / 64; ++j)
            f(u_slabs(b) + j * Sm::kSlab, &a.tm_v, v0 + 64 * j, hv, t0);
        }
      }
#pragma unroll
      for (int j = 0; j < K / 64; ++j) {
        if constexpr (kOut) f(q_slabs(b) + j * Sm::kSlab, &a.tm_q, 64 * j, hk, t0);
        f(k_slabs(b) + j * Sm::kSlab, &a.tm_k, 64 * j, hk, t0);
        if constexpr (!kFromA) f(w_slabs(b) + j * Sm::kSlab, &a.tm_w, 64 * j, hv, t0);
      }
      if constexpr (!kFromA) {
#pragma unroll
        for (int j = 0; j < V / 64; ++j)
          f(u_slabs(b) + j * Sm::kSlab, &a.tm_u, v0 + 64 * j, hv, t0);
      }
    };
    // One thread: chunk c's boxes into buffer b, completing on its mbarrier.
    [[maybe_unused]] auto tma_chunk = [&](int c, int t0, int b) {
      constexpr uint32_t kBase = kOut ? Sm::kSlab + 2 * Sm::kTok
                                 : kFromA ? Sm::kSlab + Sm::kTok : 2 * Sm::kTok;
      uint64_t* bar = bars + b;
      mbar_arrive_expect_tx(bar, kBase + (with_v ? Sm::kWarpgroups * Sm::kSlab : 0));
      chunk_boxes(c, t0, b, [&](unsigned char* dst, const CUtensorMap* m, int x, int y, int z) {
        if (z < 0) {
          tma_load_2d(dst, m, x, y, bar);
        } else {
          tma_load_3d(dst, m, x, y, z, bar);
        }
      });
    };
    // One thread: chunk c's boxes into L2, a chunk step before their tma_chunk (kReplay).
    [[maybe_unused]] auto tma_prefetch_chunk = [&](int c, int t0) {
      chunk_boxes(c, t0, 0, [&](unsigned char*, const CUtensorMap* m, int x, int y, int z) {
        if (z < 0) {
          tma_prefetch_2d(m, x, y);
        } else {
          tma_prefetch_3d(m, x, y, z);
        }
      });
    };
    // kOut, kReplay: A (landed in A_u) -> A_u = bf16(A diag(beta)) in place and A_w = bf16(A
    // diag(beta e^G r)), prep's roundings (prep.cuh); r: the chunk's rows (G, then rstd), rb: its
    // beta row.
    [[maybe_unused]] auto scale_a = [&](const float* r, const float* rb, unsigned char* Au) {
      unsigned char* Aw = smem + Sm::oAw;
      using P = TilePieces<kChunk, kChunk, kLoaders>;
      const int c8 = P::col();
      float fu[8], fw[8];  // this thread's columns c8..: beta, beta e^G r
      lds8(rb + c8, fu);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int j = c8 + e;
        fw[e] = fu[e] * exp_ftz(r[j]) * (a.rstd != nullptr ? r[kChunk + j] : 1.f);
      }
      uint4 raw[P::kPer];  // every piece loaded before any is written
#pragma unroll
      for (int p = 0; p < P::kPer; ++p)
        raw[p] = *reinterpret_cast<const uint4*>(
            Au + sw128_offset(P::row0() + p * P::kRowStep, c8));
#pragma unroll
      for (int p = 0; p < P::kPer; ++p) {
        const uint32_t off = sw128_offset(P::row0() + p * P::kRowStep, c8);
        float f[8];
        unpack8(raw[p], f);
        uint4 xu, xw;
        xu.x = pack_bf16(f[0] * fu[0], f[1] * fu[1]);
        xu.y = pack_bf16(f[2] * fu[2], f[3] * fu[3]);
        xu.z = pack_bf16(f[4] * fu[4], f[5] * fu[5]);
        xu.w = pack_bf16(f[6] * fu[6], f[7] * fu[7]);
        xw.x = pack_bf16(f[0] * fw[0], f[1] * fw[1]);
        xw.y = pack_bf16(f[2] * fw[2], f[3] * fw[3]);
        xw.z = pack_bf16(f[4] * fw[4], f[5] * fw[5]);
        xw.w = pack_bf16(f[6] * fw[6], f[7] * fw[7]);
        *reinterpret_cast<uint4*>(Au + off) = xu;
        *reinterpret_cast<uint4*>(Aw + off) = xw;
      }
    };
    // kOut, kReplay: out = A_s X as bf16 slabs, one 64-column slab at a time (D columns; A_s:
    // A_u or A_w, one K-major slab; X: [64 tokens][D] slabs, MN-major B). out may be X itself: a
    // slab is read only by its own product, and every warp's part of it is done before the store.
    [[maybe_unused]] auto wu_product = [&](const unsigned char* As, const unsigned char* X,
                                           unsigned char* out, int D) {
#pragma unroll 1
      for (int n = 0; n < D / 64; ++n) {
        float acc[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[i] = 0.f;
        wgmma_fence_operand(acc);
        wgmma_fence();
        wg_issue_mm64<kChunk>(acc, As, X + n * Sm::kSlab);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operand(acc);
        producer_sync();
        wg_store_slab<64>(acc, out + n * Sm::kSlab, wq);
      }
    };
    // kOut: u^T = (A_u V)^T = V^T A_u^T as [64 v][64 tokens] slabs in place of the v slabs (A = a
    // v slab, MN-major; B = A_u, K-major), the compute warps' transposed product-1 accumulator.
    [[maybe_unused]] auto ut_product = [&](const unsigned char* As, unsigned char* X) {
#pragma unroll 1
      for (int n = 0; n < V / 64; ++n) {
        float acc[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[i] = 0.f;
        wgmma_fence_operand(acc);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kChunk / 16; ++ks)
          wgmma_m64k16_ss<64, true, false, 1>(acc, sw128_desc(X + n * Sm::kSlab + 2048 * ks),
                                              sw128_desc(As + 32 * ks), true);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operand(acc);
        producer_sync();
        wg_store_slab<64>(acc, X + n * Sm::kSlab, wq);
      }
    };
    // chunk c (span cs) into buffer b; kReplay with bf16: then chunk c + 1's boxes (span cs1)
    // into L2 (its producer waited on its TMA loads: replay 1.08 -> 1.00 ms at B23; the same
    // prefetch made kOut 0.78 -> 0.80-0.82 and kTapes 0.71 -> 0.73)
    auto copy_chunk = [&](int c, int b, const ChunkSpan cs, const ChunkSpan cs1) {
      float* r = rows(b);
      if constexpr (kFromA) {  // rows; A (into A_u), v (into the u slabs), q (kOut), k; w, u
        float* rb = r + (kT ? 3 : 2) * kChunk;  // beta's row
        if constexpr (kOut) {
          const RowVector vecs[4] = {{r, a.G, HV, hv},
                                     {r + kChunk, a.rstd, H, hk},
                                     {r + 2 * kChunk, a.rstd_q, H, hk},
                                     {rb, a.beta, HV, hv}};
          cp_async_row_vectors<kLoaders>(vecs, cs.start, cs.len);
        } else {
          const RowVector vecs[3] = {
              {r, a.G, HV, hv}, {r + kChunk, a.rstd, H, hk}, {rb, a.beta, HV, hv}};
          cp_async_row_vectors<kLoaders>(vecs, cs.start, cs.len);
        }
        cp_async_commit();
        unsigned char* Au = au_slab(b);
        unsigned char* Aw = smem + Sm::oAw;
        const int row_A = (c * HV + hv) * kChunk, t0 = static_cast<int>(cs.start);
        if constexpr (kTma) {
          if (threadIdx.x == kCompute) {
            if constexpr (kOut) wait_a(c);
            tma_chunk(c, t0, b);
          }
          cp_async_wait_all();
          mbar_wait(bars + b, ((c - c_first) >> 1) & 1);  // buffer b's (c - c_first) / 2-th use
          if (cs.len < kChunk) {  // rows past the chunk's end: zero, as cp.async leaves them
            const int t = threadIdx.x - kCompute;
            if (with_v) zero_slab_rows<kLoaders>(u_slabs(b), V / 64, cs.len, t);
            if constexpr (kOut) zero_slab_rows<kLoaders>(q_slabs(b), K / 64, cs.len, t);
            zero_slab_rows<kLoaders>(k_slabs(b), K / 64, cs.len, t);
          }
        } else {  // f32 q, k, v: rounded to bf16 on the way
          cp_async_tile_at<kChunk, kChunk, kLoaders, kCopyUnroll>(
              slab_at<kChunk>(Au), a.A + static_cast<int64_t>(row_A) * kChunk, kChunk, kChunk);
          cp_async_commit();
          if (with_v)
            load_tile_bf16_at<kChunk, V, 2, kLoaders>(slab_at<kChunk>(u_slabs(b)),
                                                      a.v + (cs.start * HV + hv) * VG + v0,
                                                      int64_t{HV} * VG, max(cs.len, 1),
                                                      ScaleOne{});
          if constexpr (kOut) copy_qk(a.q, q_slabs(b), cs.start, cs.len);
          copy_qk(a.k, k_slabs(b), cs.start, cs.len);
          cp_async_wait_all();
        }
        producer_sync();  // rows, A, v, q, k
        if constexpr (kT) {
          if (const int t = threadIdx.x - kCompute; t < kChunk) {  // token t's factors
            const int last = max(cs.len - 1, 0);
            r[4 * kChunk + t] = walk_decay(t, cs.len, r[last], r, a.rstd != nullptr ? r + kChunk
                                                                                    : nullptr);
            if constexpr (kOut) {
              r[5 * kChunk + t] = exp_ftz(r[min(t, last)]);
              r[2 * kChunk + t] = a.scale * (a.rstd_q != nullptr ? r[2 * kChunk + t] : 1.f);
            }
          }
        }
        scale_a(r, rb, Au);
        fence_proxy_async();
        producer_sync();  // A_u, A_w (and zeroed rows) for the products
        if constexpr (kT) {
          if (with_v) ut_product(Au, u_slabs(b));
          wu_product(Aw, k_slabs(b), w_slabs(b), K);
        } else {
          // w = A_w k: prep's product (4 k16 steps from zero), rounded to bf16. The compute
          // warps, which wait for this warpgroup, make u = A_u v from A_u and the v slabs and copy
          // w's rows out during the chunk.
          wu_product(Aw, k_slabs(b), w_slabs(b), K);
        }
      } else {  // tapes: rows; k, w, u
        const RowVector vecs[2] = {{r, a.G, HV, hv}, {r + kChunk, a.rstd, H, hk}};
        cp_async_row_vectors<kLoaders>(vecs, cs.start, cs.len);
        if constexpr (kTma) {
          cp_async_commit();
          const int t0 = static_cast<int>(cs.start);
          if (threadIdx.x == kCompute) tma_chunk(c, t0, b);
          cp_async_wait_all();
          mbar_wait(bars + b, ((c - c_first) >> 1) & 1);
          if (cs.len < kChunk) {  // rows past the chunk's end: zero, as cp.async leaves them
            const int t = threadIdx.x - kCompute;
            zero_slab_rows<kLoaders>(k_slabs(b), K / 64, cs.len, t);
            zero_slab_rows<kLoaders>(w_slabs(b), K / 64, cs.len, t);
            zero_slab_rows<kLoaders>(u_slabs(b), V / 64, cs.len, t);
          }
        } else {
          copy_qk(a.k, k_slabs(b), cs.start, cs.len);
          cp_async_tile_at<kChunk, K, kLoaders, kCopyUnroll>(
              slab_at<kChunk>(w_slabs(b)), a.w + (cs.start * HV + hv) * K, int64_t{HV} * K,
              cs.len);
          cp_async_tile_at<kChunk, V, kLoaders, kCopyUnroll>(
              slab_at<kChunk>(u_slabs(b)), a.u + (cs.start * HV + hv) * VG + v0,
              int64_t{HV} * VG, cs.len);
          cp_async_commit();
          cp_async_wait_all();
        }
      }
      if constexpr (kTma && kReplay)
        if (threadIdx.x == kCompute && c < c_last)
          tma_prefetch_chunk(c + 1, static_cast<int>(cs1.start));
      fence_proxy_async();  // for the compute warps' wgmma (async proxy) reads
    };
    // The chunk table entries of chunk c + 2 are loaded while chunk c + 1 is copied.
    ChunkSpan next = span(c_first + 1);
    copy_chunk(c_first, 0, span(c_first), next);
    for (int c = c_first, b = 0; c <= c_last; ++c, b ^= 1) {
      __syncthreads();  // chunk c's inputs are in; the compute warps are done with chunk c - 1
      if (c < c_last) {
        const ChunkSpan cs = next;
        next = span(c + 2);
        copy_chunk(c + 1, b ^ 1, cs, next);
      }
    }
    return;  // barrier 0 is not used after the last chunk opens
  }
  if constexpr (Regs::kRealloc) warpgroup_reg_alloc<Regs::kComputeRegs>();
  if constexpr (kTransfer) {
    // the unit's B (kind 0) or M (kind 1), this warpgroup's 64 columns
    float* out = (kind == 0 ? a.final_state : a.m_out) +
                 (static_cast<int64_t>(unit) * HV + hv) * state_stride + v0 + 64 * wg;
    float ST[K / 2];
    if (!s_ok) {  // nothing to summarise: zeros
#pragma unroll
      for (int i = 0; i < K / 2; ++i) ST[i] = 0.f;
    } else if (kind == 0) {
      wg_state_rw_t<K>(ST, const_cast<float*>(a.h0) +
                               (static_cast<int64_t>(s) * HV + hv) * state_stride + v0 + 64 * wg,
                       VG, false, wq);
    } else {  // the identity: ST[4 j + e] is state[8 j + 2 q + e % 2][64 wg + 16 wq + g + ..]
#pragma unroll
      for (int i = 0; i < K / 2; ++i) {
        const int j = i / 4, e = i % 4;
        ST[i] = 8 * j + 2 * q + (e & 1) == 64 * wg + 16 * wq + g + 8 * (e >> 1) ? 1.f : 0.f;
      }
    }
    if (!empty) {
      ChunkSpan next = span(c_first);
      for (int c = c_first, b = 0; c <= c_last; ++c, b ^= 1) {
        const ChunkSpan cs = next;
        next = span(c + 1);
        __syncthreads();  // chunk c's inputs have landed; chunk c - 1 is done
        const float* rG = rows(b);
        const float eC = exp_ftz(rG[max(cs.len - 1, 0)]);
        uint32_t sa[K / 16][4];  // bf16(S^T), every k16 step
#pragma unroll
        for (int ks = 0; ks < K / 16; ++ks) wg_acc_to_a<K>(ST, ks, sa[ks]);
        float acc[32];
        if (with_v) {
          wg_load_slab64(acc, u_slabs(b) + wg * Sm::kSlab, wq);  // u^T (the producer's layout)
        } else {
#pragma unroll
          for (int i = 0; i < 32; ++i) acc[i] = 0.f;
        }
        wgmma_fence_operand(acc);
        wgmma_fence();
        // v_new^T = u^T - S^T W^T (B = w [token][K], K-major)
#pragma unroll
        for (int ks = 0; ks < K / 16; ++ks)
          wgmma_m64k16_rs<64, false, -1>(
              acc, sa[ks], sw128_desc(w_slabs(b) + (ks / 4) * Sm::kSlab + 32 * (ks % 4)), true);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operand(acc);
        wg_scale_cols<64>(acc, rG + 4 * kChunk);  // d (the producer's)
        uint32_t vd[kChunk / 16][4];               // bf16(v_new^T diag(d))
#pragma unroll
        for (int ts = 0; ts < kChunk / 16; ++ts) wg_acc_to_a<64>(acc, ts, vd[ts]);
#pragma unroll
        for (int i = 0; i < K / 2; ++i) ST[i] *= eC;
        wgmma_fence_operand(ST);
        wgmma_fence();
        // S^T = e^{G_C} S^T + Vd^T K (B = k [token][K], MN-major)
#pragma unroll
        for (int ts = 0; ts < kChunk / 16; ++ts)
          wgmma_m64k16_rs<K, true, 1>(ST, vd[ts], sw128_desc(k_slabs(b) + 2048 * ts, Sm::kSlab),
                                      true);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operand(ST);
      }
    }
    wg_state_rw_t<K>(ST, out, VG, true, wq);
    return;
  }
  if (!s_ok) return;  // a malformed seg_order entry: no segment to read or write

  const int64_t state0 = (static_cast<int64_t>(s) * HV + hv) * state_stride + v0 + 64 * wg;
  float* fin = a.final_state + state0;
  if constexpr (kOut) {
    // The state transposed, S^T: this warpgroup's 64 value rows x K keys in one accumulator,
    // fed to products 1, Q S and the update from registers; v_new^T likewise to Att Vn and the
    // update. The chain never goes through shared memory.
    float ST[K / 2];
    wg_state_rw_t<K>(ST, const_cast<float*>(a.h0) + state0, VG, false, wq);
    const int t128 = threadIdx.x % 128;
    // kOutTapes: h and v_new on their way out (this warpgroup's 64 value columns)
    [[maybe_unused]] unsigned char* Ht = smem + Sm::oHt + wg * size_t{K} * 128;
    [[maybe_unused]] unsigned char* Vt = smem + Sm::oVt + wg * Sm::kSlab;
    if (!empty) {
      unsigned char* Ot = smem + Sm::oVd + wg * Sm::kSlab;  // o back to token rows
      Out* o_cols = a.o + int64_t{hv} * VG + v0 + 64 * wg;
      [[maybe_unused]] bf16* vn_cols = a.v_new + int64_t{hv} * VG + v0 + 64 * wg;
      ChunkSpan next = span(c_first);
      for (int c = c_first, b = 0; c <= c_last; ++c, b ^= 1) {
        const ChunkSpan cs = next;
        next = span(c + 1);
        const int len = cs.len, last = max(len - 1, 0);
        __syncthreads();  // chunk c's inputs have landed; chunk c - 1 is done

        const unsigned char* Ks = k_slabs(b);
        const unsigned char* Qs = q_slabs(b);
        const float* rG = rows(b);  // rows >= len are zero
        const float* rR = a.rstd != nullptr ? rG + kChunk : nullptr;
        const float* rO = rG + 2 * kChunk;  // scale rstd_q (the producer's)
        const float* rD = rG + 4 * kChunk;  // d_t (the producer's)
        const float* rE = rG + 5 * kChunk;  // e^{G_t} (the producer's)
        const float eC = exp_ftz(rG[last]);
        uint32_t sa[K / 16][4];  // bf16(S^T), every k16 step
#pragma unroll
        for (int ks = 0; ks < K / 16; ++ks) wg_acc_to_a<K>(ST, ks, sa[ks]);
        float acc[32], oacc[32], att[kAttCols / 2];
        wg_load_slab64(acc, u_slabs(b) + wg * Sm::kSlab, wq);  // u^T (the producer's layout)
#pragma unroll
        for (int i = 0; i < 32; ++i) oacc[i] = 0.f;
#pragma unroll
        for (int i = 0; i < kAttCols / 2; ++i) att[i] = 0.f;
        wgmma_fence_operand(acc);
        wgmma_fence_operand(oacc);
        wgmma_fence_operand(att);
        wgmma_fence();
        // product 1 (the chain) first: v_new^T = u^T - S^T W^T (B = w [token][K], K-major)
#pragma unroll
        for (int ks = 0; ks < K / 16; ++ks)
          wgmma_m64k16_rs<64, false, -1>(
              acc, sa[ks], sw128_desc(w_slabs(b) + (ks / 4) * Sm::kSlab + 32 * (ks % 4)), true);
        wgmma_commit();
        // then this warpgroup's columns of Q K^T, then (Q S)^T = S^T Q^T
#pragma unroll
        for (int ks = 0; ks < K / 16; ++ks) {  // B: k rows kAttCols wg.. (K-major, 128 B a row)
          const uint32_t kk = (ks / 4) * Sm::kSlab + 32 * (ks % 4);
          wgmma_m64k16_ss<kAttCols, false, false, 1>(
              att, sw128_desc(Qs + kk), sw128_desc(Ks + kk + 128 * kAttCols * wg), true);
        }
        wgmma_commit();
#pragma unroll
        for (int ks = 0; ks < K / 16; ++ks)
          wgmma_m64k16_rs<64, false, 1>(
              oacc, sa[ks], sw128_desc(Qs + (ks / 4) * Sm::kSlab + 32 * (ks % 4)), true);
        wgmma_commit();
        if constexpr (kOutTapes) {
          // h[c] = bf16(S) (S^T transposed, one slab a 64-key block; Ht's last store was read
          // before the last chunk's o) while the products run; then w's token rows from the
          // producer's slabs, as kReplay
          wg_stsm_t<K>(ST, Ht, wq);
          fence_proxy_async();
          warpgroup_sync(wg);
          if (t128 == 0) tma_store_2d(&a.tm_h, Ht, v0 + 64 * wg, (c * HV + hv) * K);
          store_w_rows(w_slabs(b), cs);
        }
        wgmma_wait<1>();  // product 1 and Q K^T; Q S still runs
        wgmma_fence_operand(acc);
        wgmma_fence_operand(att);
        uint32_t vn[kChunk / 16][4], vd[kChunk / 16][4];  // bf16(v_new^T), bf16(v_new^T diag(d))
#pragma unroll
        for (int ts = 0; ts < kChunk / 16; ++ts) wg_acc_to_a<64>(acc, ts, vn[ts]);
        wg_scale_cols<64>(acc, rD);
#pragma unroll
        for (int ts = 0; ts < kChunk / 16; ++ts) wg_acc_to_a<64>(acc, ts, vd[ts]);
        wg_gate_scores<kAttCols>(att, rG, wq, kAttCols * wg, last, rR);
        wg_store_slab<kAttCols>(att, smem + Sm::oAtt, wq, kAttCols * wg);
        fence_proxy_async();
        wgmma_wait<0>();
        wgmma_fence_operand(oacc);
        compute_sync<kCompute>();  // Att complete
        // o^T = e^G (Q S)^T + v_new^T Att^T;  S^T = e^{G_C} S^T + Vd^T K
        wg_scale_cols<64>(oacc, rE);
#pragma unroll
        for (int i = 0; i < K / 2; ++i) ST[i] *= eC;
        wgmma_fence_operand(oacc);
        wgmma_fence_operand(ST);
        wgmma_fence();
#pragma unroll
        for (int ts = 0; ts < kChunk / 16; ++ts)  // B: Att [i][j], K-major
          wgmma_m64k16_rs<64, false, 1>(oacc, vn[ts], sw128_desc(smem + Sm::oAtt + 32 * ts),
                                        true);
#pragma unroll
        for (int ts = 0; ts < kChunk / 16; ++ts)  // B: k [token][K], MN-major
          wgmma_m64k16_rs<K, true, 1>(ST, vd[ts], sw128_desc(Ks + 2048 * ts, Sm::kSlab), true);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operand(oacc);
        wgmma_fence_operand(ST);
        // o = scale rq o (the producer's rO), token rows < len; kOutTapes: v_new's likewise
        constexpr bool kOt = std::is_same_v<Out, bf16>;  // o through Ot
        if constexpr (kOt || kOutTapes) {  // TMA stores of whole chunks
          // this thread's earlier stores have read their slabs (Ot, Ht, Vt, w's)
          if (t128 == 0) tma_store_wait_read();
          warpgroup_sync(wg);
          if constexpr (kOt) wg_stsm_cols_t(oacc, Ot, wq, rO);
          if constexpr (kOutTapes) {
#pragma unroll
            for (int ts = 0; ts < kChunk / 16; ++ts) wg_stsm_frag_t(vn[ts], Vt, ts, wq);
          }
          fence_proxy_async();
          warpgroup_sync(wg);
          const int64_t ld = int64_t{HV} * VG;
          if (len == kChunk) {
            if (t128 == 0) {
              if constexpr (kOt) tma_store_3d(&a.tm_o, Ot, v0 + 64 * wg, hv, cs.start);
              if constexpr (kOutTapes) tma_store_3d(&a.tm_vnew, Vt, v0 + 64 * wg, hv, cs.start);
            }
          } else {  // rows past len are the next document's: 16-byte stores of rows < len
            if constexpr (kOt) wg_copy_slab<kChunk>(Ot, o_cols + cs.start * ld, ld, len, t128);
            if constexpr (kOutTapes)
              wg_copy_slab<kChunk>(Vt, vn_cols + cs.start * ld, ld, len, t128);
          }
        }
        if constexpr (!kOt) {  // f32 o: 4-byte stores, element (v, t) of o^T to token row t
          wg_scale_cols<64>(oacc, rO);
          const int64_t ld = int64_t{HV} * VG;
          Out* ob = o_cols + cs.start * ld + 16 * wq + g;
#pragma unroll
          for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int t = 8 * j + 2 * q + (e & 1);
              if (t < len) ob[t * ld + 8 * (e >> 1)] = oacc[4 * j + e];
            }
        }
      }
    }
    wg_state_rw_t<K>(ST, fin, VG, true, wq);
    if constexpr (kOutTapes) {  // the unused chunks' h, as kReplay fills them
      if (empty) {
        zero_h_if_no_chunk();
      } else if (c_last + 1 < NC && a.clen[c_last + 1] <= 0) {  // the exit state
        if (t128 == 0) tma_store_wait_read();
        warpgroup_sync(wg);
        wg_stsm_t<K>(ST, Ht, wq);
        warpgroup_sync(wg);
        for (int c = c_last + 1; c < NC; ++c) copy_slab_to_h(Ht, c);
      }
    }
    if (threadIdx.x % 128 == 0) tma_store_wait();
    return;
  }

  unsigned char* Sb = smem + Sm::oSb + wg * size_t{K} * 128;
  unsigned char* Vd = smem + Sm::oVd + wg * Sm::kSlab;
  float S[K / 64][32];
  wg_state_rw<K>(S, const_cast<float*>(a.h0) + state0, VG, false, wq);
  if (empty) {
    wg_state_rw<K>(S, fin, VG, true, wq);
    zero_h_if_no_chunk();
    return;
  }

  const int i0 = 16 * wq + g, i1 = i0 + 8;  // this thread's accumulator rows
  // The chunk table entries of chunk c + 1 are loaded during chunk c.
  ChunkSpan next = span(c_first);
  for (int c = c_first, b = 0; c <= c_last; ++c, b ^= 1) {
    const ChunkSpan cs = next;
    next = span(c + 1);
    const int len = cs.len, last = max(len - 1, 0);
    __syncthreads();  // chunk c's inputs have landed; chunk c - 1 is done

    const unsigned char* Ks = k_slabs(b);
    const unsigned char* Ws = w_slabs(b);
    const unsigned char* Us = u_slabs(b);
    const float* rG = rows(b);  // rows >= len are zero
    const float* rR = a.rstd != nullptr ? rG + kChunk : nullptr;
    const float GC = rG[last];
    float acc[32];
    wg_write_sb<K>(S, Sb, wq);  // (before any wgmma is in flight: S is a wgmma accumulator)
    if constexpr (kReplay) {
      // u = A_u v for this warpgroup's 64 value columns (v in the u slabs), prep's product (4 k16
      // steps from zero) rounded to bf16 as prep stores it: product 1's start
#pragma unroll
      for (int i = 0; i < 32; ++i) acc[i] = 0.f;
      wgmma_fence_operand(acc);
      wgmma_fence();
      wg_issue_mm64<kChunk>(acc, au_slab(b), Us + wg * Sm::kSlab);
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operand(acc);
#pragma unroll
      for (int i = 0; i < 32; ++i) acc[i] = __bfloat162float(__float2bfloat16_rn(acc[i]));
    } else {
      wg_load_slab64(acc, Us + wg * Sm::kSlab, wq);
    }
    fence_proxy_async();
    warpgroup_sync(wg);  // Sb complete

    // product 1: v_new = u - Ws Sb; h[c] = Sb while the tensor cores run
    wgmma_fence_operand(acc);
    wgmma_fence();
    wg_issue_product1<K>(acc, Ws, Sb);
    wgmma_commit();
    // h[c] = Sb. kTapes: 16-byte copies (its TMA store measured 1.03 -> 1.24 ms at B23);
    // kReplay: one TMA store a warpgroup (waited for, read, after product 1, which reads Sb
    // too), then w's token rows to global from the producer's slabs
    if constexpr (!kReplay) {
      copy_slab_to_h(Sb, c);
    } else {
      if (threadIdx.x % 128 == 0) tma_store_2d(&a.tm_h, Sb, v0 + 64 * wg, (c * HV + hv) * K);
      store_w_rows(Ws, cs);
    }
    wgmma_wait<0>();
    wgmma_fence_operand(acc);
    // Sb and Ws are written again after the next chunk's barrier
    if constexpr (kReplay) {
      if (threadIdx.x % 128 == 0) tma_store_wait_read();
    }
    // v_new to global (rows < len); Vd = bf16(d v_new)
    const float d0 = walk_decay(i0, len, GC, rG, rR), d1 = walk_decay(i1, len, GC, rG, rR);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int t = half ? i1 : i0;
      if (t < len) {
        bf16* vp = a.v_new + ((cs.start + t) * HV + hv) * VG + v0 + 64 * wg + 2 * q;
#pragma unroll
        for (int j = 0; j < 8; ++j)
          store2(vp + 8 * j, acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
      }
    }
    wg_store_slab<64>(acc, Vd, wq, 0, d0, d1);
    fence_proxy_async();
    warpgroup_sync(wg);  // Vd complete

    // S = e^{G_C} S + K^T Vd
    wg_scale_state<K>(S, exp_ftz(GC));
    wgmma_fence();
    wg_issue_state_update<K>(S, Ks, Vd);
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int kb = 0; kb < K / 64; ++kb) wgmma_fence_operand(S[kb]);
  }

  wg_state_rw<K>(S, fin, VG, true, wq);
  if (threadIdx.x % 128 == 0) tma_store_wait();
  // The last used chunk's segment also fills the unused chunks' h with its exit state.
  if (c_last + 1 < NC && a.clen[c_last + 1] <= 0) {
    warpgroup_sync(wg);  // every warp of this warpgroup is done reading Sb
    wg_write_sb<K>(S, Sb, wq);
    warpgroup_sync(wg);
    for (int c = c_last + 1; c < NC; ++c) copy_slab_to_h(Sb, c);
  }
}

}  // namespace jax_cake_gdn
