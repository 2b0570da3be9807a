// The backward after the reverse walk (primitives/xla.py: chunk_bwd), parallel over chunks.
//
// One CTA of 8 warps per (chunk, value head), value heads of one chunk adjacent in the (1-D) grid
// so GVA heads share q / k through L2; unused chunks (length 0) return at once. Per chunk, with
// G the in-chunk cumsum (padding rows G = G_C), Gam_ij = exp(G_i - G_j) (i >= j only, never
// e^{-G}), dec = e^{G_C - G}, Q / K normalised by rstd when given:
//
//   Att  = Gam o Q K^T (recomputed: light and full save modes give bitwise-equal gradients)
//   datt = scale tril(dO vn^T)        da = datt o Att        dGam = datt o Gam
//   dvn  = scale Att^T dO + diag(dec) K dS   (walk_bwd's; du = dvn)
//   dQ   = scale diag(e^G) dO h^T + dGam K                   (dQg = scale dO h^T)
//   dKd  = vn dS^T                   dw = -dvn h^T
//   dA   = diag-col(beta) (du V^T + diag-col(e^G) dw K^T)
//   dbV  = A^T du  ->  dV = beta dbV          dbK = A^T dw
//   dL   = -tril(A^T dA A^T, -1)     dLG = dL o Gam     N = dLG o (K K^T)
//   dK   = diag(dec) dKd + dGam^T Q + diag(beta e^G) dbK + dKK K + dKK^T K
//          (dKK = diag(beta) dLG)
//   dG   = rowsum(dQg o Q e^G) - rowsum(dKd o K dec) + rowsum(M) - colsum(M)
//          + beta e^G rowsum(dbK o K)
//          with M = da + diag(beta) N
//   dbeta = rowsum(dbV o V) + e^G rowsum(dbK o K) + rowsum(N)
//   dG_C = sum(dKd o K dec) + e^{G_C} sum(dS o h);   dg_t = dG_C + sum_{t <= i < len} dG_i
//
// Every product runs on Hopper wgmma (wgmma.cuh, bf16 operands from 128-byte swizzled slabs, f32
// accumulate): one generic block (64 x 32 of a 64 x N result, N in {64, K, V}; warpgroup wg
// takes the N / 64 adjacent blocks at columns 32 (N / 64) wg.., one m64n(N / 2) chain) in any
// of the four transposition layouts; each accumulator element sees the k16 steps of the former
// mma.sync warp tile in the same order from zero, so every output is expected bit for bit equal
// to that kernel's. f32 intermediates (dvn, dw, dA, A^T dA, dKK) are rounded to bf16 once, when
// they become operands. A, h, dS_end and vn arrive in bf16 (the walks round them when they write
// them, to the values this kernel rounded them to itself before) and go straight into their tiles
// by cp.async; e^{G_C} sum(dS o h), their only other use, sums these bf16 values in f32. A CPU
// emulation of exactly these roundings (before v5: with that sum in f32 h, dS) against the f32
// xla chunk_bwd gives 2-3e-3 relative RMS on every output (splitting the A-chain operands into
// bf16 hi + lo changed nothing that matters: the error comes from the K dS and vn dS^T products).
// Per-row reductions (dG, dbeta, dG_C) go through per-tile partial arrays in shared memory and
// are summed in a fixed order: the kernel is deterministic (no atomics) unless sum_groups asks it
// to add dQ, dK over the GVA group itself (f32 atomic adds in the order the CTAs reach them).
//
// Where a stage's result is 64 x 128, each warpgroup's two blocks thus go out as one m64n64 chain
// (half the A-operand reads from shared memory of two m64n32 chains), and a stage's chains go out
// as one batch before one wait (cb_batch). Products that do not read each other's results share
// a batch: dQ's and dK's two halves (stages 2 and 3), and dbV with dbK (stage 5). Whatever a
// stage's epilogue needs besides the products (G, beta and their exponentials, the bf16 Q / K / V
// elements as 4-byte pairs, sum(dS o h), the final per-row reductions) is loaded and computed
// between the commit and the wait (cb_batch_pre), while the chains run: the same operations on
// the same values, so every output keeps its bits.
// dK accumulates in registers across the stages (two 64 x 32 blocks per warpgroup at K = 128),
// and so does M (stage 1's 64 x 64 block layout, stage 7 adds to it; its row and column sums
// leave through small partial arrays); dQ, dV are written as soon as they are final. A full
// chunk's dQ, dV and dK leave by TMA, one after the other through one staging area: the threads
// put them there as the boxes of a swizzled tensor map (cb_stage_f32; bf16 dV as slabs), and
// after the next CTA barrier one thread stores the boxes (or, for dQ, dK with sum_groups, adds
// them by TMA's f32 reduce-add); a partial chunk's rows go out from the threads (with sum_groups
// as 16-byte atomic adds). The threads' stores cost the item more than the bulk copies (their
// shuffles and 16-byte atomics held the warps).
// Shared memory (K = V = 128: 224 KiB, 1 CTA / SM), every bf16 tile as slabs (element (r, c) at
// slab_offset<rows>(r, c)): persistent Ks, dvn (bf16, walk_bwd's); a phase-A region (Q, dO, vn,
// h, dS, dGam) that phase B reuses for dw, dA, A^T dA, dKK; A (bf16, as prep stored it); V; the
// staging area (64 x K f32, or 64 x V in dV's dtype if larger); small arrays.
// Loads: with bf16 inputs the token-row operands go by cp.async at stage 0 in two groups: what
// stage 1 reads (vn, q, k, dO, rstd; q, k are then scaled by rstd in place, each thread its own
// pieces: the values a register pass would give), then V, in flight during stage 1; f32 inputs
// convert q, k, dO (stage 0) and V (stage 4) through registers.
// h, A and dS_end, dvn (walk_bwd's) come by TMA on one mbarrier, issued by the last thread in
// stage 0 and waited for after stage 1. With a hand-off buffer (handoff.cuh; walk_chunk_bwd)
// the CTAs take the items last chunk first and that thread first waits for the walk launched
// before them to publish the item (its warp has only its copies to wait for then).
#pragma once

#include "device_common.cuh"
#include "handoff.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace jax_cake_gdn {

constexpr int kCbThreads = 256;
constexpr int kCbWarps = kCbThreads / 32;
static_assert(kChunk == 64, "chunk_bwd: the dg scan holds two rows per lane");

template <typename In, int K, int V>
struct ChunkBwdSmem {
  static constexpr bool kRaw = std::is_same_v<In, bf16>;  // q, k, dO, v copied as they are
  static constexpr size_t kTK = size_t{kChunk} * K * sizeof(bf16);       // 64 x K: K / 64 slabs
  static constexpr size_t kTV = size_t{kChunk} * V * sizeof(bf16);       // 64 x V
  static constexpr size_t kTS = size_t{K} * V * sizeof(bf16);            // K x V: V / 64 slabs
  static constexpr size_t kTT = size_t{kChunk} * kChunk * sizeof(bf16);  // 64 x 64: one slab
  // persistent (every slab offset a multiple of 1024 from the aligned base)
  static constexpr size_t oKs = 0;
  static constexpr size_t oDu = oKs + kTK;
  // phase A
  static constexpr size_t oQ = oDu + kTV;
  static constexpr size_t oDO = oQ + kTK;
  static constexpr size_t oVN = oDO + kTV;
  static constexpr size_t oH = oVN + kTV;
  static constexpr size_t oDS = oH + kTS;
  static constexpr size_t oDA = oDS + kTS;  // phase B: 64 x 64 dA, later dKK
  static constexpr size_t oDG = oDA + kTT;
  // A (bf16, as stored) and V (bf16 inputs: copied at stage 0), read from stage 5 on
  static constexpr size_t oA = oDG + kTT;
  static constexpr size_t oV = oA + kTT;
  // dQ, dV, then dK on their way out by TMA (full chunks): boxes of 64 rows x 128 bytes
  static constexpr size_t kStage = size_t{kChunk} * (K * sizeof(float) > V * sizeof(In)
                                                         ? K * sizeof(float)
                                                         : V * sizeof(In));
  static constexpr size_t oStage = oV + kTV;
  // small arrays (floats): G, beta, partial sums a, b, c, d (64 x 4 each), e (64 x 2), M's row
  // (64 x 2) and column (4 x 64) partial sums, dG, red, rstd_q, rstd_k of the chunk's rows
  static constexpr size_t oSmall = oStage + kStage;
  static constexpr int nSmall =
      2 * kChunk + 4 * 4 * kChunk + 2 * kChunk + 6 * kChunk + kChunk + 32 + 2 * kChunk;
  static constexpr size_t bytes = oSmall + nSmall * sizeof(float) + 1024;  // + alignment
  // phase B aliases
  static constexpr size_t oDw = oDS;   // 64 x K
  static constexpr size_t oX = oDG;    // 64 x 64
  static_assert(kTK <= kTS, "dw does not fit dS's slot");
  static_assert(bytes <= 227 * 1024, "chunk_bwd: shared memory over the sm_90 limit");
};

// The 16 floats of a 64 x 32 block's accumulator, as wgmma takes them.
__device__ __forceinline__ float (&cb_flat(float (&acc)[4][4]))[16] {
  return reinterpret_cast<float(&)[16]>(acc);
}

// acc (NB adjacent 64 x 32 blocks at columns n0.. of a 64 x N result; warp wq of the warpgroup
// holds rows 16 wq.., the layout of the former 16 x 32 warp tile at m0 = 16 wq) += op(A) op(B),
// reduction length KD, as one m64n(32 NB) wgmma chain per warpgroup (the NB blocks' 16 NB floats
// in a row are that instruction's accumulator): issues only (cb_begin before, cb_end after; all
// four warps of the warpgroup call it). AT = false: A stored [64][KD] (K-major slabs of 64
// rows); AT = true: A stored [KD][64] (A = M^T: one MN-major slab of KD rows). BT = false: B
// stored [KD][N] (MN-major slabs of KD rows); BT = true: B stored [N][KD] (B = M^T: K-major
// slabs of BR rows, the tile's N). NB = 2 needs n0 % 64 == 0 (one slab column).
template <int KD, bool AT, bool BT, int BR = kChunk, int NB>
__device__ __forceinline__ void cb_mma(float (&acc)[NB][4][4], const unsigned char* a,
                                       const unsigned char* b, int n0) {
  static_assert(NB == 1 || NB == 2, "cb_mma: one or two 64 x 32 blocks");
  float(&d)[16 * NB] = reinterpret_cast<float(&)[16 * NB]>(acc);
  const uint64_t a0 = AT ? sw128_desc(a, KD * 128) : sw128_desc(a);
  const uint64_t b0 = BT ? sw128_desc(b + 128 * n0)
                         : sw128_desc(b + (n0 / 64) * (KD * 128) + 2 * (n0 % 64), KD * 128);
#pragma unroll
  for (int ks = 0; ks < KD / 16; ++ks) {
    const uint64_t da = desc_plus(a0, AT ? 2048 * ks : (ks / 4) * (kChunk * 128) + 32 * (ks % 4));
    const uint64_t db = desc_plus(b0, BT ? (ks / 4) * (BR * 128) + 32 * (ks % 4) : 2048 * ks);
    wgmma_m64k16_ss<32 * NB, AT, !BT, 1>(d, da, db, true);
  }
}
template <int KD, bool AT, bool BT, int BR = kChunk>
__device__ __forceinline__ void cb_mma(float (&acc)[4][4], const unsigned char* a,
                                       const unsigned char* b, int n0) {
  cb_mma<KD, AT, BT, BR, 1>(reinterpret_cast<float(&)[1][4][4]>(acc), a, b, n0);
}

// Before a batch of cb_mma: order the accumulators' register writes before the wgmmas.
template <typename... Acc>
__device__ __forceinline__ void cb_begin(Acc&... acc) {
  (wgmma_fence_operand(cb_flat(acc)), ...);
  wgmma_fence();
}

// After a batch's commit: wait, and fence the accumulators before they are read.
template <typename... Acc>
__device__ __forceinline__ void cb_wait(Acc&... acc) {
  wgmma_wait<0>();
  (wgmma_fence_operand(cb_flat(acc)), ...);
}

// After a batch: commit, wait, and fence the accumulators before they are read.
template <typename... Acc>
__device__ __forceinline__ void cb_end(Acc&... acc) {
  wgmma_commit();
  cb_wait(acc...);
}

// cb_begin / cb_end over arrays of blocks (one batch: every chain issued before one wait).
template <int N>
__device__ __forceinline__ void cb_fence_blocks(float (&acc)[N][4][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) wgmma_fence_operand(cb_flat(acc[i]));
}
template <int... N>
__device__ __forceinline__ void cb_begin_all(float (&... acc)[N][4][4]) {
  (cb_fence_blocks(acc), ...);
  wgmma_fence();
}
template <int... N>
__device__ __forceinline__ void cb_end_all_wait(float (&... acc)[N][4][4]) {
  wgmma_wait<0>();
  (cb_fence_blocks(acc), ...);
}
template <int... N>
__device__ __forceinline__ void cb_end_all(float (&... acc)[N][4][4]) {
  wgmma_commit();
  cb_end_all_wait(acc...);
}

// Block i (of NB = N / 64) of this warp in a 64 x N result: rows m0 = 16 (warp % 4).., columns
// n0.. (the four warps of a warpgroup share n0; warpgroup w holds columns 32 NB w.. to 32 NB (w +
// 1), so its NB blocks are adjacent: one m64n(32 NB) chain).
template <int NB>
__device__ __forceinline__ void cb_tile_pos(int i, int& m0, int& n0) {
  const int w = threadIdx.x >> 5;
  m0 = 16 * (w & 3);
  n0 = 32 * (NB * (w >> 2) + i);
}

// One batch: issue(n0) puts the chains of this warpgroup's blocks (columns n0.., N / 64 adjacent
// 64 x 32 blocks of every accumulator array) in flight between one fence and one wait.
template <int N, int... M, typename Issue>
__device__ __forceinline__ void cb_batch(Issue&& issue, float (&acc)[N][4][4],
                                         float (&... more)[M][4][4]) {
  static_assert(((M == N) && ...), "cb_batch: arrays of one result width");
  cb_begin_all(acc, more...);
  int m0, n0;
  cb_tile_pos<N>(0, m0, n0);
  issue(n0);
  cb_end_all(acc, more...);
}

// cb_batch with pre(): work that needs none of the batch's results (an epilogue's row / column
// factors and other operands from shared memory) runs between the commit and the wait, while the
// chains are on the tensor cores. ptxas keeps shared-memory loads on their side of the wait but
// may sink pure arithmetic below it, so a factor's inputs are best loaded before the issue (its
// exponential then becomes ready among the wgmma instructions). Same products, same operations:
// the outputs do not change.
template <int N, int... M, typename Issue, typename Pre>
__device__ __forceinline__ void cb_batch_pre(Issue&& issue, Pre&& pre, float (&acc)[N][4][4],
                                             float (&... more)[M][4][4]) {
  static_assert(((M == N) && ...), "cb_batch: arrays of one result width");
  cb_begin_all(acc, more...);
  int m0, n0;
  cb_tile_pos<N>(0, m0, n0);
  issue(n0);
  wgmma_commit();
  pre();
  cb_end_all_wait(acc, more...);
}

// Column n0 of this warpgroup's first block in a 64 x (64 NB) result (cb_tile_pos's).
template <int NB>
__device__ __forceinline__ int cb_n0() {
  int m0, n0;
  cb_tile_pos<NB>(0, m0, n0);
  return n0;
}

// cb_batch_pre for results of different widths: issue() puts every chain in flight, taking each
// array's n0 from cb_n0.
template <int... N, typename Issue, typename Pre>
__device__ __forceinline__ void cb_batch_mixed(Issue&& issue, Pre&& pre,
                                               float (&... acc)[N][4][4]) {
  cb_begin_all(acc...);
  issue();
  wgmma_commit();
  pre();
  cb_end_all_wait(acc...);
}

// Element (nt, e) of a tile: row m0 + g + 8 (e / 2), column n0 + 8 nt + 2 q + (e % 2).
__device__ __forceinline__ int cb_row(int m0, int e) {
  return m0 + ((threadIdx.x & 31) >> 2) + 8 * (e >> 1);
}
__device__ __forceinline__ int cb_col(int n0, int nt, int e) {
  return n0 + 8 * nt + 2 * (threadIdx.x & 3) + (e & 1);
}

// Rows i < len of a tile to row(i) (a global row pointer, f32 or bf16; columns n0..), each
// element times scale(i); add (f32 rows only): atomically added to what is there instead, as
// 16-byte adds: lanes 2p, 2p + 1 of a quad swap pairs, so lane 2p holds four adjacent columns of
// its upper row and lane 2p + 1 four of its lower row (half the requests of 8-byte adds).
template <typename Row, typename Scale>
__device__ __forceinline__ void cb_store_rows(const float (&acc)[4][4], int len, int m0, int n0,
                                              Row row, Scale scale, bool add = false) {
  if constexpr (std::is_same_v<std::remove_pointer_t<decltype(row(0))>, float>) {
    if (add) {
      const bool lower = threadIdx.x & 1;  // this lane keeps its lower row (e = 2, 3)
      const int i = cb_row(m0, lower ? 2 : 0);
      const float r0 = scale(cb_row(m0, 0)), r1 = scale(cb_row(m0, 2));
      float* op = i < len ? row(i) : nullptr;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        // send the pair this lane does not keep; receive the partner's pair of the kept row
        const float s0 = lower ? r0 * acc[nt][0] : r1 * acc[nt][2];
        const float s1 = lower ? r0 * acc[nt][1] : r1 * acc[nt][3];
        const float g0 = __shfl_xor_sync(0xffffffffu, s0, 1);
        const float g1 = __shfl_xor_sync(0xffffffffu, s1, 1);
        if (op != nullptr) {
          const float4 x = lower ? make_float4(g0, g1, r1 * acc[nt][2], r1 * acc[nt][3])
                                 : make_float4(r0 * acc[nt][0], r0 * acc[nt][1], g0, g1);
          atomicAdd(reinterpret_cast<float4*>(op + (cb_col(n0, nt, 0) & ~3)), x);
        }
      }
      return;
    }
  }
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int i = cb_row(m0, 2 * hf);
    if (i < len) {
      auto* op = row(i);
      const float r = scale(i);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) store2(op + cb_col(n0, nt, 0), r * acc[nt][2 * hf],
                                            r * acc[nt][2 * hf + 1]);
    }
  }
}

// Row sums s0 (row m0 + g), s1 (row m0 + g + 8) of a tile, reduced over the quad; lane q == 0
// stores them to part[row * np + n0 / 32].
__device__ __forceinline__ void cb_row_partial(float s0, float s1, float* part, int np, int m0,
                                               int n0) {
  s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
  s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
  if ((threadIdx.x & 3) == 0) {
    const int g = (threadIdx.x & 31) >> 2;
    part[(m0 + g) * np + n0 / 32] = s0;
    part[(m0 + g + 8) * np + n0 / 32] = s1;
  }
}

// A tile's row sums, then cb_row_partial of them: f(nt, e, i, j, s) adds element (nt, e)'s term
// (row i, column j) to its row's sum s (and may update the element).
template <typename F>
__device__ __forceinline__ void cb_row_sums(float* part, int np, int m0, int n0, F f) {
  float s[2] = {0.f, 0.f};
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) f(nt, e, cb_row(m0, e), cb_col(n0, nt, e), s[e >> 1]);
  cb_row_partial(s[0], s[1], part, np, m0, n0);
}

// Two bf16 values into a shared tile (pitch ld).
__device__ __forceinline__ void cb_st2(bf16* p, float a, float b) {
  *reinterpret_cast<uint32_t*>(p) = pack_bf16(a, b);
}

// This thread's bf16 elements of its NB blocks (cb_tile_pos) of a 64 x (64 NB) slab tile t, in
// the accumulator layout: p[i][nt][hf] holds elements (nt, 2 hf) and (nt, 2 hf + 1) of block i,
// adjacent columns of one 16-byte chunk, as one 4-byte load (conflict free: the 8 rows of a warp's
// load sit in 8 different chunks of their 128-byte rows, by the swizzle).
template <int NB>
__device__ __forceinline__ void cb_ld_pairs(uint32_t (&p)[NB][4][2], unsigned char* t) {
#pragma unroll
  for (int i = 0; i < NB; ++i) {
    int m0, n0;
    cb_tile_pos<NB>(i, m0, n0);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
        p[i][nt][hf] = *reinterpret_cast<const uint32_t*>(
            slab_at<kChunk>(t)(cb_row(m0, 2 * hf), cb_col(n0, nt, 0)));
  }
}

// x[] (a per-row array in shared memory) at this thread's accumulator rows of a stage (rows
// 16 (warp % 4) + g, + 8: the same for every block of the stage): out[hf] for e / 2 == hf.
__device__ __forceinline__ void cb_ld_rows(float (&out)[2], const float* x) {
  const int m0 = 16 * ((threadIdx.x >> 5) & 3);
  out[0] = x[cb_row(m0, 0)];
  out[1] = x[cb_row(m0, 2)];
}

// The same, and x at this thread's 8 columns of a 64 x 32 block at n0 (col[nt][e % 2]).
__device__ __forceinline__ void cb_ld_rows_cols(float (&row)[2], float (&col)[4][2],
                                                const float* x, int m0, int n0) {
  row[0] = x[cb_row(m0, 0)];
  row[1] = x[cb_row(m0, 2)];
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int b = 0; b < 2; ++b) col[nt][b] = x[cb_col(n0, nt, b)];
}

// Element (nt, e) from cb_ld_pairs' pairs, as float (exact).
__device__ __forceinline__ float cb_pair_at(const uint32_t (&p)[4][2], int nt, int e) {
  const float2 f = unpack2(p[nt][e >> 1]);
  return (e & 1) ? f.y : f.x;
}

// This thread's elements of its NB blocks (cb_tile_pos) of a 64 x (64 NB) f32 result into
// stage, as the boxes of a 128-byte swizzled f32 tensor map (make_tma_token_rows): box b
// holds columns 32 b.. (one 64 x 32 block) at stage + 8192 b, f32 column c of a row where a bf16
// slab keeps column 2 c (sw128_offset; a warp's 8-byte stores then fill whole 128-byte lines).
// Row r's elements are multiplied by scale(r).
template <int NB, typename Scale>
__device__ __forceinline__ void cb_stage_f32(const float (&acc)[NB][4][4], unsigned char* stage,
                                             Scale scale) {
#pragma unroll
  for (int it = 0; it < NB; ++it) {
    int m0, n0;
    cb_tile_pos<NB>(it, m0, n0);
    unsigned char* box = stage + (n0 / 32) * (kChunk * 128);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = cb_row(m0, 2 * hf), c = cb_col(0, nt, 0);  // c: column in the box
        const float sr = scale(r);
        *reinterpret_cast<float2*>(box + sw128_offset(r, 2 * c)) =
            make_float2(sr * acc[it][nt][2 * hf], sr * acc[it][nt][2 * hf + 1]);
      }
  }
}

template <typename In, int K, int V>
__global__ void __launch_bounds__(kCbThreads, 1)
    chunk_bwd_kernel(const In* __restrict__ q, const In* __restrict__ k, const In* __restrict__ v,
                     const float* __restrict__ beta, const float* __restrict__ G,
                     const __grid_constant__ CUtensorMap A_map,  // 64 x 64 boxes
                     const __grid_constant__ CUtensorMap h_map,  // K x 64 boxes
                     const bf16* __restrict__ v_new,
                     const __grid_constant__ CUtensorMap dS_end_map,  // K x 64 boxes
                     const __grid_constant__ CUtensorMap dvn_map,     // 64 x 64 boxes
                     const In* __restrict__ dout,
                     const __grid_constant__ CUtensorMap dQ_map,  // 32 x 64 boxes (f32)
                     const __grid_constant__ CUtensorMap dK_map,
                     const __grid_constant__ CUtensorMap dV_map,  // 128-byte x 64 boxes
                     const float* __restrict__ rstd_q,  // nullable
                     const float* __restrict__ rstd_k,                              // nullable
                     const int32_t* __restrict__ cstart, const int32_t* __restrict__ clen,
                     float* __restrict__ dQ, float* __restrict__ dK, In* __restrict__ dV,
                     float* __restrict__ dg, float* __restrict__ dbeta, int64_t num_tokens, int H,
                     int HV, bool sum_groups, float scale, Handoff handoff) {
  using Sm = ChunkBwdSmem<In, K, V>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = align_1024(smem_raw);
  unsigned char* Ks = smem + Sm::oKs;
  unsigned char* Du = smem + Sm::oDu;
  float* sG = reinterpret_cast<float*>(smem + Sm::oSmall);
  float* sB = sG + kChunk;
  float* pa = sB + kChunk;       // [64][4] rowsum(dQg o Q e^G)
  float* pb = pa + 4 * kChunk;   // [64][4] rowsum(dKd o K dec)
  float* pc = pb + 4 * kChunk;   // [64][4] rowsum(dbV o V)
  float* pd = pc + 4 * kChunk;   // [64][4] rowsum(dbK o K)
  float* pe = pd + 4 * kChunk;   // [64][2] rowsum(N)
  float* pmr = pe + 2 * kChunk;  // [64][2] M's row sums, a warpgroup's 32 columns each
  float* pmc = pmr + 2 * kChunk;  // [4][64] M's column sums, 16 rows each
  float* sdG = pmc + 4 * kChunk;  // [64]
  float* sRed = sdG + kChunk;    // [32]
  float* sRq = sRed + 32;        // [64] rstd_q (bf16 inputs with L2 norm)
  float* sRk = sRq + kChunk;     // [64] rstd_k
  unsigned char* Qs = smem + Sm::oQ;
  unsigned char* DOs = smem + Sm::oDO;
  unsigned char* VNs = smem + Sm::oVN;
  unsigned char* Hs = smem + Sm::oH;
  unsigned char* DSs = smem + Sm::oDS;
  unsigned char* DGm = smem + Sm::oDG;
  unsigned char* Dw = smem + Sm::oDw;
  unsigned char* As = smem + Sm::oA;
  unsigned char* Vs = smem + Sm::oV;
  unsigned char* DA = smem + Sm::oDA;
  unsigned char* DKK = smem + Sm::oDA;
  unsigned char* Xs = smem + Sm::oX;
  unsigned char* Stage = smem + Sm::oStage;
  // element (r, c) of a [64][*] or [K][*] slab tile
  auto at64 = [](unsigned char* t, int r, int c) { return slab_at<kChunk>(t)(r, c); };
  auto atK = [](unsigned char* t, int r, int c) { return slab_at<K>(t)(r, c); };

  // items (chunk, value head) = c HV + hv; behind the walk: last chunk first, as it publishes them
  const int item = handoff.data != nullptr ? static_cast<int>(gridDim.x - 1 - blockIdx.x)
                                           : static_cast<int>(blockIdx.x);
  const int hv = item % HV, c = item / HV;
  const int hk = hv / (HV / H);
  // dQ, dK rows: per value head, or (sum_groups, H < HV) the group's sum by f32 atomic adds
  const int dqk_heads = sum_groups ? H : HV, dqk_head = sum_groups ? hk : hv;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const ChunkSpan cs = chunk_span(cstart, clen, c, num_tokens);
  const int len = cs.len;
  if (len == 0) return;  // unused chunk: no token rows

  // dQ or dK rows of this thread's blocks (K / 64 of a 64 x K result) to dst: stored, or with
  // sum_groups added atomically. A full chunk's go through Stage and leave by TMA instead
  // (cb_stage_f32 here; the barrier after it, then tma_dqk)
  const bool full = len == kChunk;
  auto store_dqk = [&](const float (&acc)[K / 64][4][4], float* dst) {
    if (full) {
      cb_stage_f32(acc, Stage, [](int) { return 1.f; });
      fence_proxy_async();
      return;
    }
#pragma unroll
    for (int it = 0; it < K / 64; ++it) {
      int m0, n0;
      cb_tile_pos<K / 64>(it, m0, n0);
      cb_store_rows(
          acc[it], len, m0, n0,
          [&](int i) { return dst + ((cs.start + i) * dqk_heads + dqk_head) * K; },
          [](int) { return 1.f; }, sum_groups);
    }
  };
  auto tma_dqk = [&](const CUtensorMap* map) {  // one thread, after the barrier
#pragma unroll
    for (int b = 0; b < K / 32; ++b) {
      if (sum_groups)
        tma_reduce_add_3d(map, Stage + b * (kChunk * 128), 32 * b, dqk_head, cs.start);
      else
        tma_store_3d(map, Stage + b * (kChunk * 128), 32 * b, dqk_head, cs.start);
    }
  };
  const int64_t qk_off = cs.start * H * K + hk * K;
  const int64_t v_off = (cs.start * HV + hv) * V;

  // ---- stage 0: operands into shared memory (bf16), G, beta
  // v_new is bf16 (as the walk wrote it): 16-byte cp.async pieces straight into its slabs
  // (cp_async_tile_at: the TilePieces mapping). Two groups: what stage 1 reads (vn, and bf16 q,
  // k, dO with their rstd rows), then bf16 V, which lands while stage 1 runs; h, A, dS_end and
  // dvn (whole tiles) by TMA (below).
  using PH = TilePieces<K, V, kCbThreads>;
  {
    cp_async_tile_at<kChunk, V, kCbThreads>(slab_at<kChunk>(VNs), v_new + v_off,
                                            int64_t{HV} * V, len);
    if constexpr (Sm::kRaw) {  // bf16 q, k, dO as they are (q, k scaled in place below)
      cp_async_tile_at<kChunk, K, kCbThreads>(slab_at<kChunk>(Qs), q + qk_off, int64_t{H} * K,
                                              len);
      cp_async_tile_at<kChunk, K, kCbThreads>(slab_at<kChunk>(Ks), k + qk_off, int64_t{H} * K,
                                              len);
      cp_async_tile_at<kChunk, V, kCbThreads>(slab_at<kChunk>(DOs), dout + v_off,
                                              int64_t{HV} * V, len);
    }
    if (Sm::kRaw && tid < 2 * kChunk) {  // rstd of the chunk's rows, for the in-place scaling
      const float* r = tid < kChunk ? rstd_q : rstd_k;
      const int t = tid % kChunk;
      const bool ok = r != nullptr && t < len;
      cp_async4((tid < kChunk ? sRq : sRk) + t, ok ? r + (cs.start + t) * H + hk : G, ok);
    }
    cp_async_commit();
    // bf16 V, for stage 5 on
    if constexpr (Sm::kRaw)
      cp_async_tile_at<kChunk, V, kCbThreads>(slab_at<kChunk>(Vs), v + v_off, int64_t{HV} * V,
                                              len);
    cp_async_commit();
  }
  __shared__ __align__(8) uint64_t tiles_bar;  // h, A, dS_end and dvn landed (TMA)
  if (tid == kCbThreads - 1) {
    mbar_init(&tiles_bar, 1);
    mbar_init_fence();
    mbar_arrive_expect_tx(&tiles_bar, (2 * K + kChunk) * V * 2 + kChunk * kChunk * 2);
    tma_load_2d(As, &A_map, 0, item * kChunk, &tiles_bar);  // A as stored, for stage 5 on
#pragma unroll
    for (int j = 0; j < V / 64; ++j) tma_load_2d(Hs + j * (K * 128), &h_map, 64 * j, item * K,
                                                 &tiles_bar);
    if (handoff.data != nullptr) handoff_wait(handoff, item);  // the walk has stored them
#pragma unroll
    for (int j = 0; j < V / 64; ++j) {
      tma_load_2d(DSs + j * (K * 128), &dS_end_map, 64 * j, item * K, &tiles_bar);
      tma_load_2d(Du + j * (kChunk * 128), &dvn_map, 64 * j, item * kChunk, &tiles_bar);
    }
  }
  if constexpr (!Sm::kRaw) {
    load_tile_bf16_at<kChunk, K, 8, kCbThreads>(slab_at<kChunk>(Qs), q + qk_off, int64_t{H} * K,
                                                len, ScaleRstd{rstd_q, cs.start, H, hk});
    load_tile_bf16_at<kChunk, K, 8, kCbThreads>(slab_at<kChunk>(Ks), k + qk_off, int64_t{H} * K,
                                                len, ScaleRstd{rstd_k, cs.start, H, hk});
    load_tile_bf16_at<kChunk, V, 8, kCbThreads>(slab_at<kChunk>(DOs), dout + v_off,
                                                int64_t{HV} * V, len, ScaleOne{});
  }
  if (tid < kChunk) {
    sG[tid] = G[(cs.start + min(tid, len - 1)) * HV + hv];  // padding rows: G = G_C (as xla)
    sB[tid] = tid < len ? beta[(cs.start + tid) * HV + hv] : 0.f;
  }
  // the rstd scaling of this thread's own q, k pieces (its cp.async writes are visible to it
  // after the wait)
  cp_async_wait<1>();
  if constexpr (Sm::kRaw) {
    if (rstd_q != nullptr || rstd_k != nullptr) __syncthreads();  // sRq, sRk from other threads
    const auto q_at = slab_at<kChunk>(Qs), k_at = slab_at<kChunk>(Ks);
    if (rstd_q != nullptr) scale_tile_bf16_at<kChunk, K, kCbThreads>(q_at, len, sRq);
    if (rstd_k != nullptr) scale_tile_bf16_at<kChunk, K, kCbThreads>(k_at, len, sRk);
  }
  fence_proxy_async();
  __syncthreads();

  const float GC = sG[len - 1];

  // ---- stage 1: Att (registers), datt -> M = datt o Att (f32, registers until stage 7: this
  // thread's elements of the stage's 64 x 64 block), dGam (bf16)
  float mm[4][4];
  {
    int m0, n0;
    cb_tile_pos<1>(0, m0, n0);
    float att[4][4], dd[4][4];
    zero_acc(att);
    zero_acc(dd);
    float gr[2], gc[4][2];  // G of this thread's rows and columns
    cb_ld_rows_cols(gr, gc, sG, m0, n0);
    cb_begin(att, dd);
    cb_mma<K, false, true>(att, Qs, Ks, n0);
    cb_mma<V, false, true>(dd, DOs, VNs, n0);
    wgmma_commit();
    float gm[4][4];  // e^{G_i - G_j} of this thread's elements (Gam where j <= i), while the
                     // chains run: made for every element, so no predicate is held across
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) gm[nt][e] = exp_ftz(gr[e >> 1] - gc[nt][e & 1]);
    cb_wait(att, dd);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = cb_row(m0, e), j = cb_col(n0, nt, e);
        const float gam = j <= i ? gm[nt][e] : 0.f;
        const float a = gam * att[nt][e];
        const float datt = j <= i ? scale * dd[nt][e] : 0.f;
        dd[nt][e] = datt * gam;
        mm[nt][e] = datt * a;
      }
      const int i0 = cb_row(m0, 0), i1 = cb_row(m0, 2), j = cb_col(n0, nt, 0);
      cb_st2(at64(DGm, i0, j), dd[nt][0], dd[nt][1]);
      cb_st2(at64(DGm, i1, j), dd[nt][2], dd[nt][3]);
    }
  }
  // h, A, dS_end and dvn (TMA) and the cp.async groups landed: waited for here, before the
  // barrier ahead of stage 2 (whose products read Hs; the sum(dS o h) in its window reads Hs and
  // DSs)
  cp_async_wait_all();
  mbar_wait(&tiles_bar, 0);
  fence_proxy_async();
  __syncthreads();  // M, dGam, h, dS_end, dvn (and A) complete

  // ---- stages 2 and 3, one batch each for their two halves (neither reads the other's results):
  //   dQ = diag(e^G) dQg + dGam K, dQg = scale dO h^T  (written to global)
  //   dK (registers) = diag(dec) vn dS^T + dGam^T Q
  // (these stages and the next ones issue the chains of all their blocks as one batch)
  float dk[K / 64][4][4];
  {
    float acc[K / 64][4][4];
#pragma unroll
    for (int it = 0; it < K / 64; ++it) {
      zero_acc(acc[it]);
      zero_acc(dk[it]);
    }
    // Q's and K's elements, e^G and e^{G_C - G} of the rows: loaded while the chains run
    uint32_t qp[K / 64][4][2], kp[K / 64][4][2];
    float gr[2], egr[2], decr[2];
    cb_ld_rows(gr, sG);
    cb_batch_pre(
        [&](int n0) {
          cb_mma<V, false, true, K>(acc, DOs, Hs, n0);
          cb_mma<V, false, true, K>(dk, VNs, DSs, n0);
        },
        [&] {
          cb_ld_pairs(qp, Qs);
          cb_ld_pairs(kp, Ks);
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            egr[hf] = exp_ftz(gr[hf]);
            decr[hf] = exp_ftz(GC - gr[hf]);
          }
          // sum(dS o h) of the bf16 values, f32 arithmetic: each thread over its TilePieces of
          // the two, in a fixed order (h, dS_end stay until stage 4 overwrites dS_end, after a
          // barrier)
          float hds = 0.f;
#pragma unroll 2
          for (int j = 0; j < PH::kPer; ++j) {
            const int r = PH::row0() + j * PH::kRowStep, c8 = PH::col();
            float fh[8], fs[8];
            lds8(atK(Hs, r, c8), fh);
            lds8(atK(DSs, r, c8), fs);
#pragma unroll
            for (int e = 0; e < 8; ++e) hds = fmaf(fh[e], fs[e], hds);
          }
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) hds += __shfl_xor_sync(0xffffffffu, hds, o);
          if (lane == 0) sRed[warp] = hds;
        },
        acc, dk);
#pragma unroll
    for (int it = 0; it < K / 64; ++it) {
      int m0, n0;
      cb_tile_pos<K / 64>(it, m0, n0);
      cb_row_sums(pa, 4, m0, n0, [&](int nt, int e, int, int, float& s) {
        const float eg = egr[e >> 1];
        const float dqg = scale * acc[it][nt][e];
        s += dqg * cb_pair_at(qp[it], nt, e) * eg;
        acc[it][nt][e] = dqg * eg;
      });
      cb_row_sums(pb, 4, m0, n0, [&](int nt, int e, int, int, float& s) {
        const float dec = decr[e >> 1];
        s += dk[it][nt][e] * cb_pair_at(kp[it], nt, e) * dec;
        dk[it][nt][e] *= dec;
      });
    }
    cb_batch(
        [&](int n0) {
          cb_mma<kChunk, false, false>(acc, DGm, Ks, n0);
          cb_mma<kChunk, true, false>(dk, DGm, Qs, n0);
        },
        acc, dk);
    store_dqk(acc, dQ);
  }
  fence_proxy_async();
  __syncthreads();  // Q, dO, vn, dS, dGam dead; dQ staged
  if (full && tid == 0) tma_dqk(&dQ_map);

  // ---- stage 4: dw = -dvn h^T -> Dw (bf16, dS's slot); f32 inputs: V through registers
  if constexpr (!Sm::kRaw)
    load_tile_bf16_at<kChunk, V, 8, kCbThreads>(slab_at<kChunk>(Vs), v + v_off, int64_t{HV} * V,
                                                len, ScaleOne{});
  {
    float acc[K / 64][4][4];
#pragma unroll
    for (int it = 0; it < K / 64; ++it) zero_acc(acc[it]);
    cb_batch([&](int n0) { cb_mma<V, false, true, K>(acc, Du, Hs, n0); }, acc);
#pragma unroll
    for (int it = 0; it < K / 64; ++it) {
      int m0, n0;
      cb_tile_pos<K / 64>(it, m0, n0);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = cb_row(m0, 2 * hf), j = cb_col(n0, nt, 0);
          cb_st2(at64(Dw, i, j), -acc[it][nt][2 * hf], -acc[it][nt][2 * hf + 1]);
        }
      }
    }
  }
  fence_proxy_async();
  if (full && tid == 0) tma_store_wait_read();  // Stage free again for dV
  __syncthreads();

  // ---- stage 5: dA = diag-col(beta) (du V^T + diag-col(e^G) dw K^T) -> DA (bf16);
  //               dV = diag(beta) A^T du (global); dbK = A^T dw -> dK
  {
    int m0, n0;
    cb_tile_pos<1>(0, m0, n0);
    float a1[4][4], a2[4][4];
    zero_acc(a1);
    zero_acc(a2);
    float bc[4][2], gc[4][2], ec[4][2];  // beta, G and (while the chains run) e^G of the columns
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int j = cb_col(n0, nt, b);
        bc[nt][b] = sB[j];
        gc[nt][b] = sG[j];
      }
    cb_begin(a1, a2);
    cb_mma<V, false, true>(a1, Du, Vs, n0);
    cb_mma<K, false, true>(a2, Dw, Ks, n0);
    wgmma_commit();
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int b = 0; b < 2; ++b) ec[nt][b] = exp_ftz(gc[nt][b]);
    cb_wait(a1, a2);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      float x[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) x[e] = bc[nt][e & 1] * (a1[nt][e] + ec[nt][e & 1] * a2[nt][e]);
      const int i0 = cb_row(m0, 0), i1 = cb_row(m0, 2), j = cb_col(n0, nt, 0);
      cb_st2(at64(DA, i0, j), x[0], x[1]);
      cb_st2(at64(DA, i1, j), x[2], x[3]);
    }
  }
  {  // dbV = A^T du -> dV, dbK = A^T dw -> dK: one batch
    float av[V / 64][4][4], ak[K / 64][4][4];
#pragma unroll
    for (int it = 0; it < V / 64; ++it) zero_acc(av[it]);
#pragma unroll
    for (int it = 0; it < K / 64; ++it) zero_acc(ak[it]);
    // V's and K's elements, beta e^G of the rows: while the chains run
    uint32_t vp[V / 64][4][2], kp[K / 64][4][2];
    float gr[2], br[2], bgr[2];
    cb_ld_rows(gr, sG);
    cb_ld_rows(br, sB);
    cb_batch_mixed(
        [&] {
          cb_mma<kChunk, true, false>(av, As, Du, cb_n0<V / 64>());
          cb_mma<kChunk, true, false>(ak, As, Dw, cb_n0<K / 64>());
        },
        [&] {
          cb_ld_pairs(vp, Vs);
          cb_ld_pairs(kp, Ks);
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) bgr[hf] = br[hf] * exp_ftz(gr[hf]);
        },
        av, ak);
#pragma unroll
    for (int it = 0; it < V / 64; ++it) {
      int m0, n0;
      cb_tile_pos<V / 64>(it, m0, n0);
      cb_row_sums(pc, 4, m0, n0, [&](int nt, int e, int, int, float& s) {
        s += av[it][nt][e] * cb_pair_at(vp[it], nt, e);
      });
      if (!full) {
        cb_store_rows(
            av[it], len, m0, n0, [&](int i) { return dV + ((cs.start + i) * HV + hv) * V; },
            [&](int i) { return sB[i]; });
      } else if constexpr (Sm::kRaw) {  // bf16 slabs of 64 columns, as the TMA boxes
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int i = cb_row(m0, 2 * hf), j = cb_col(n0, nt, 0);
            cb_st2(at64(Stage, i, j), sB[i] * av[it][nt][2 * hf], sB[i] * av[it][nt][2 * hf + 1]);
          }
      }
    }
    if constexpr (!Sm::kRaw) {
      if (full) cb_stage_f32(av, Stage, [&](int i) { return sB[i]; });
    }
#pragma unroll
    for (int it = 0; it < K / 64; ++it) {
      int m0, n0;
      cb_tile_pos<K / 64>(it, m0, n0);
      cb_row_sums(pd, 4, m0, n0, [&](int nt, int e, int, int, float& s) {
        s += ak[it][nt][e] * cb_pair_at(kp[it], nt, e);
        dk[it][nt][e] += bgr[e >> 1] * ak[it][nt][e];
      });
    }
  }
  fence_proxy_async();
  // DA complete for this warpgroup: of what stage 5 wrote, stage 6 reads only DA's columns n0..
  // (its B operand), the 32 columns this warpgroup wrote; stage 6 writes X into dGam's slot, which
  // stage 5 does not read. The CTA barrier after stage 6 joins the warpgroups again.
  warpgroup_sync(warp >> 2);

  // ---- stage 6: X = A^T dA (bf16)
  {
    int m0, n0;
    cb_tile_pos<1>(0, m0, n0);
    float acc[4][4];
    zero_acc(acc);
    cb_begin(acc);
    cb_mma<kChunk, true, false>(acc, As, DA, n0);
    cb_end(acc);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int i0 = cb_row(m0, 0), i1 = cb_row(m0, 2), j = cb_col(n0, nt, 0);
      cb_st2(at64(Xs, i0, j), acc[nt][0], acc[nt][1]);
      cb_st2(at64(Xs, i1, j), acc[nt][2], acc[nt][3]);
    }
  }
  fence_proxy_async();
  __syncthreads();  // X complete; DA dead; dV staged
  if (full && tid == 0) {
#pragma unroll
    for (int b = 0; b < V * int{sizeof(In)} / 128; ++b)
      tma_store_3d(&dV_map, Stage + b * (kChunk * 128), b * (128 / int{sizeof(In)}), hv, cs.start);
  }

  // ---- stage 7: dL = -tril(X A^T, -1), dLG = dL o Gam, N = dLG o K K^T:
  //               M += diag(beta) N (same thread, same elements as stage 1), rowsum(N), dKK
  {
    int m0, n0;
    cb_tile_pos<1>(0, m0, n0);
    float acc[4][4], kk[4][4];
    zero_acc(acc);
    zero_acc(kk);
    float gr[2], gc[4][2], br[2];  // G of this thread's rows and columns, beta of its rows
    cb_ld_rows_cols(gr, gc, sG, m0, n0);
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) br[hf] = sB[cb_row(m0, 2 * hf)];
    cb_begin(acc, kk);
    cb_mma<kChunk, false, true>(acc, Xs, As, n0);
    cb_mma<K, false, true>(kk, Ks, Ks, n0);
    wgmma_commit();
    float ng[4][4];  // -Gam (used where j < i), while the chains run
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) ng[nt][e] = -exp_ftz(gr[e >> 1] - gc[nt][e & 1]);
    cb_wait(acc, kk);
    float s[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = cb_row(m0, e), j = cb_col(n0, nt, e);
        const float dlg = j < i ? ng[nt][e] * acc[nt][e] : 0.f;
        const float n = dlg * kk[nt][e];
        s[e >> 1] += n;
        mm[nt][e] += br[e >> 1] * n;
        acc[nt][e] = br[e >> 1] * dlg;
      }
      const int i0 = cb_row(m0, 0), i1 = cb_row(m0, 2), j = cb_col(n0, nt, 0);
      cb_st2(at64(DKK, i0, j), acc[nt][0], acc[nt][1]);
      cb_st2(at64(DKK, i1, j), acc[nt][2], acc[nt][3]);
    }
    cb_row_partial(s[0], s[1], pe, 2, m0, n0);
    // M's partial sums: rows over this warpgroup's 32 columns (quad shuffles), columns over this
    // warp's 16 rows (shuffles over g), each in a fixed order
    float r[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) r[e >> 1] += mm[nt][e];
    cb_row_partial(r[0], r[1], pmr, 2, m0, n0);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        float c = mm[nt][b] + mm[nt][2 + b];
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
        if (lane < 4) pmc[(m0 / 16) * kChunk + cb_col(n0, nt, b)] = c;
      }
  }
  fence_proxy_async();
  if (full && tid == 0) tma_store_wait_read();  // Stage free again for dK
  __syncthreads();  // dKK, M, partial sums complete

  // ---- stage 8: dK += dKK K + dKK^T K (global); per-row reductions (they need none of the
  // products: warps 0-2 make them while the chains run)
  cb_batch_pre(
      [&](int n0) {
        cb_mma<kChunk, false, false>(dk, DKK, Ks, n0);
        cb_mma<kChunk, true, false>(dk, DKK, Ks, n0);
      },
      [&] {
        if (tid < kChunk) {
          // each row's partial sums as 16- and 8-byte loads (scalar loads at these strides were
          // 4- and 2-way bank conflicts); the same values added in the same order
          const int i = tid;
          const float2 mr = *reinterpret_cast<const float2*>(pmr + i * 2);
          const float rs = mr.x + mr.y;
          const float cs_ =
              (pmc[i] + pmc[kChunk + i]) + (pmc[2 * kChunk + i] + pmc[3 * kChunk + i]);
          const float4 va = *reinterpret_cast<const float4*>(pa + i * 4);
          const float4 vb = *reinterpret_cast<const float4*>(pb + i * 4);
          const float4 vc = *reinterpret_cast<const float4*>(pc + i * 4);
          const float4 vd = *reinterpret_cast<const float4*>(pd + i * 4);
          const float fa[4] = {va.x, va.y, va.z, va.w}, fb[4] = {vb.x, vb.y, vb.z, vb.w};
          const float fc[4] = {vc.x, vc.y, vc.z, vc.w}, fd[4] = {vd.x, vd.y, vd.z, vd.w};
          float a = 0.f, b = 0.f, cc = 0.f, d = 0.f;
#pragma unroll
          for (int p = 0; p < K / 32; ++p) {
            a += fa[p];
            b += fb[p];
            d += fd[p];
          }
#pragma unroll
          for (int p = 0; p < V / 32; ++p) cc += fc[p];
          const float2 pe2 = *reinterpret_cast<const float2*>(pe + i * 2);
          const float e = pe2.x + pe2.y;
          const float eg = exp_ftz(sG[i]);
          sdG[i] = i < len ? a - b + rs - cs_ + sB[i] * eg * d : 0.f;
          if (i < len) dbeta[(cs.start + i) * HV + hv] = cc + eg * d + e;
        } else if (warp == kChunk / 32) {
          // dG_C = sum(dKd o K dec) + e^{G_C} sum(dS o h): lane l sums rows l and l + 32, then a
          // fixed shuffle tree (deterministic)
          float b = 0.f;
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            const float4 v = *reinterpret_cast<const float4*>(pb + (lane + 32 * h2) * 4);
            const float f[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int p = 0; p < K / 32; ++p) b += f[p];
          }
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) b += __shfl_xor_sync(0xffffffffu, b, o);
          if (lane == 0) {
            float hs = 0.f;
            for (int w = 0; w < kCbWarps; ++w) hs += sRed[w];
            sRed[kCbWarps] = b + exp_ftz(GC) * hs;
          }
        }
      },
      dk);
  store_dqk(dk, dK);
  __syncthreads();  // dK staged
  if (full && tid == 0) tma_dqk(&dK_map);
  if (warp == 0) {
    // dg_t = dG_C + sum_{t <= i < len} dG_i (reverse in-chunk cumsum, sdG = 0 past len): lane l
    // holds rows 2l, 2l + 1; suffix sums of the pairs over lanes by shuffles, then each row
    const float2 x01 = *reinterpret_cast<const float2*>(sdG + 2 * lane);
    const float x0 = x01.x, x1 = x01.y;
    float suf = x0 + x1;  // becomes the sum of pairs l..31
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float up = __shfl_down_sync(0xffffffffu, suf, o);
      if (lane + o < 32) suf += up;
    }
    float after = __shfl_down_sync(0xffffffffu, suf, 1);  // pairs l + 1..31
    if (lane == 31) after = 0.f;
    const float r1 = sRed[kCbWarps] + after + x1;
    const int i0 = 2 * lane;
    if (i0 < len) dg[(cs.start + i0) * HV + hv] = r1 + x0;
    if (i0 + 1 < len) dg[(cs.start + i0 + 1) * HV + hv] = r1;
  }
  if (full && tid == 0) tma_store_wait();
}

}  // namespace jax_cake_gdn
