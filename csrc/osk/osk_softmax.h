// The consumer's per-row arithmetic on one 64 x 128 slice of S = Q K^T held in wgmma accumulator
// registers: where each register sits, the causal / key-length mask, the row maxima, and the
// online softmax (exp2 against the running max, row sums, the rescale of O).
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

namespace cosa::osk {

// Accumulator register v of a thread holds row (v >> 1) & 1 of the thread's two rows (8 apart)
// and column 8 * (v >> 2) + 2 * (lane % 4) + (v & 1) of the warpgroup's slice. The same order
// holds for O (columns are head-dim entries there).
struct AccumulatorLayout {
  __device__ static constexpr int row_half(int v) { return (v >> 1) & 1; }
  __device__ static int column(int v, int lane) { return 8 * (v >> 2) + 2 * (lane % 4) + (v & 1); }
  // Row of the 128-row tile held by row_half `rh` of a thread (warp 0..7 over both warpgroups).
  __device__ static int tile_row(int warp, int lane, int rh) { return warp * 16 + rh * 8 + lane / 4; }
};

// Masks a block of S: keys after a row's query (causal, bottom-right aligned) and keys at or past
// Lk. Only the block holding Lk and the blocks from the tile's first diagonal block on need it: a
// block before it ends before the tile's first query, so every row sees all of its keys, while
// from it on (both diagonal blocks where the prefix is not a multiple of 128) some row's query
// may precede some of its keys.
struct TileMask {
  int query_pos[2];  // key coordinate of each row's query: P_b + i * 128 + row
  int seqlen_k;
  int first_diagonal;

  __device__ bool needed(int block, int block_size) const {
    return block >= first_diagonal || (block + 1) * block_size > seqlen_k;
  }

  template <class FragS>
  __device__ void apply(FragS& tSrS, int block, int block_size, int lane) const {
    const int key_limit = seqlen_k - 1 - block * block_size;  // last live key, block-relative
    CUTE_UNROLL
    for (int v = 0; v < cute::size(tSrS); ++v) {
      const int col = AccumulatorLayout::column(v, lane);
      const int causal_limit = query_pos[AccumulatorLayout::row_half(v)] - block * block_size;
      if (col > causal_limit || col > key_limit) { tSrS(v) = -INFINITY; }
    }
  }
};

// Online softmax state of a thread's two rows, in raw-logit units (scaled by softmax_scale *
// log2(e) only inside the exponent). Sums are partial (this thread's columns) until finalised.
struct OnlineSoftmax {
  // Independent accumulators per row for the row sum: a 32-long chain of dependent additions per
  // row would sit on the critical path between S and P V.
  static constexpr int kChains = 4;
  static_assert(kChains == 4, "update() combines exactly four partials per row");

  // Headroom of the exponentials taken before a block's maximum is known (exp_against_max): a row
  // keeps its running max while the block's maximum exceeds it by at most this many powers of two,
  // so that P <= 2^8 (the same relative precision in bf16 and fp16, and no overflow of the sums).
  static constexpr float kHeadroomLog2 = 8.f;
  // Past this exponent above the running max the exponentials taken before the block's maximum
  // was known, or their sums, may have overflowed: such a row needs S again. A thread adds 32 of a
  // row's exponentials (block_sums) before rebase() scales them down, and 32 * 2^122 = 2^127 is the
  // largest such sum below fp32's inf (2^128).
  static constexpr float kOverflowLog2 = 122.f;

  // The max each row's exponentials and sums are taken against: the running max, or, after
  // exp_against_max(), up to kHeadroomLog2 powers of two below it. The epilogue's LSE is
  // max * softmax_scale + ln(sum) either way.
  float max[2] = {-INFINITY, -INFINITY};
  float sum[2] = {0.f, 0.f};

  // The exponent's offset for a row with running max m: sigma' m, or 0 for a row with no live key
  // yet (max -inf), whose exponentials are then taken against 0.
  __device__ static float reference_exponent(float m, float scale_log2) {
    return m == -INFINITY ? 0.f : m * scale_log2;
  }

  // Each row's maximum over this thread's columns of the block (-inf where all of them are masked),
  // as a pairwise tree (depth 5 per row instead of chains of 8): on a skipped block the maxima
  // sit on the warpgroup's path to its next S. The -inf seed at the root keeps a column set that is
  // all NaN at -inf, as fmaxf chains seeded with -inf leave it.
  template <class FragS>
  __device__ static void thread_max(const FragS& tSrS, float (&out)[2]) {
    constexpr int kPerRow = decltype(cute::size(tSrS))::value / 2;
    float level[2][kPerRow];
    CUTE_UNROLL
    for (int v = 0; v < cute::size(tSrS); ++v) {
      // Register v is element (v >> 2) * 2 + (v & 1) of its row half.
      level[AccumulatorLayout::row_half(v)][(v >> 2) * 2 + (v & 1)] = tSrS(v);
    }
    static_assert(kPerRow == 32, "the tree below has five levels");
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      CUTE_UNROLL
      for (int i = 0; i < 16; ++i) { level[rh][i] = fmaxf(level[rh][i], level[rh][i + 16]); }
      CUTE_UNROLL
      for (int i = 0; i < 8; ++i) { level[rh][i] = fmaxf(level[rh][i], level[rh][i + 8]); }
      CUTE_UNROLL
      for (int i = 0; i < 4; ++i) { level[rh][i] = fmaxf(level[rh][i], level[rh][i + 4]); }
      CUTE_UNROLL
      for (int i = 0; i < 2; ++i) { level[rh][i] = fmaxf(level[rh][i], level[rh][i + 2]); }
      level[rh][0] = fmaxf(level[rh][0], level[rh][1]);
    }
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) { out[rh] = fmaxf(level[rh][0], -INFINITY); }
  }

  // Each row's maximum over the whole block: thread_max() reduced over the quad of threads that
  // share the row.
  __device__ static void quad_max(const float (&thread_maxima)[2], float (&out)[2]) {
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      const float m = fmaxf(thread_maxima[rh], __shfl_xor_sync(0xffffffffu, thread_maxima[rh], 1));
      out[rh] = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    }
  }

  // S becomes P = exp2(sigma' S - max_scaled) in place, each row's P summed into kChains
  // partials per row (the one exponential loop of update() and exp_against_max()).
  template <class FragS>
  __device__ static void exponentiate(FragS& tSrS, float scale_log2, const float (&max_scaled)[2],
                                      float (&partial)[2][kChains]) {
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      CUTE_UNROLL
      for (int c = 0; c < kChains; ++c) { partial[rh][c] = 0.f; }
    }
    CUTE_UNROLL
    for (int v = 0; v < cute::size(tSrS); ++v) {
      const int rh = AccumulatorLayout::row_half(v);
      const float p = exp2f(tSrS(v) * scale_log2 - max_scaled[rh]);
      tSrS(v) = p;
      partial[rh][(v >> 2) % kChains] += p;
    }
  }

  // Takes the block in: S becomes P = exp(sigma (S - m_new)) in place, the running max and sums
  // advance, and `rescale` receives exp(sigma (m_old - m_new)), the factor O must be multiplied by.
  template <class FragS>
  __device__ void update(FragS& tSrS, const float (&new_max)[2], float scale_log2,
                         float (&rescale)[2]) {
    float max_scaled[2];
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      max_scaled[rh] = reference_exponent(new_max[rh], scale_log2);
      // Exactly 1 when the max stands (rescale_o then leaves O alone).
      rescale[rh] = new_max[rh] == max[rh] ? 1.f : exp2f(max[rh] * scale_log2 - max_scaled[rh]);
      max[rh] = new_max[rh];
    }
    float partial[2][kChains];
    exponentiate(tSrS, scale_log2, max_scaled, partial);
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      sum[rh] = sum[rh] * rescale[rh] + ((partial[rh][0] + partial[rh][1]) +
                                         (partial[rh][2] + partial[rh][3]));
    }
  }

  // The exponentials of a block taken before its row maxima are known, against the running max:
  // S becomes P = exp2(sigma' S - sigma' m) in place and `block_sums` receives each row's sum over
  // this thread's columns (the running sums are left alone). Where the block's maximum does not
  // exceed m this is update()'s P exactly; where it does by more than kHeadroomLog2 powers of two,
  // the row must be rebased (rebase(), or update() on S computed again past kOverflowLog2).
  template <class FragS>
  __device__ void exp_against_max(FragS& tSrS, float scale_log2, float (&block_sums)[2]) const {
    float max_scaled[2];
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) { max_scaled[rh] = reference_exponent(max[rh], scale_log2); }
    float partial[2][kChains];
    exponentiate(tSrS, scale_log2, max_scaled, partial);
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      block_sums[rh] = (partial[rh][0] + partial[rh][1]) + (partial[rh][2] + partial[rh][3]);
    }
  }

  // After exp_against_max(): each row's exponent above its running max at this thread's largest
  // column: -inf where the thread's columns are all masked, +inf where they are not and the row has
  // no live key yet (its running max is -inf; NaN where both are -inf, which compares false).
  __device__ float exponent_above_max(float thread_max, int rh, float scale_log2) const {
    return thread_max * scale_log2 - max[rh] * scale_log2;
  }

  // After exp_against_max(), for rows whose block maximum may exceed the running max: moves each
  // row onto max(m, block max), the P of exp_against_max() and the sums with it, and gives the
  // factor O's row must be multiplied by (1 where the max stands). Needs every exponent of the
  // block below kOverflowLog2.
  template <class FragS>
  __device__ void rebase(FragS& tSrS, const float (&block_max)[2], const float (&block_sums)[2],
                         float scale_log2, float (&rescale)[2]) {
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      const float new_max = fmaxf(max[rh], block_max[rh]);
      rescale[rh] = new_max == max[rh] ? 1.f
                                       : exp2f(reference_exponent(max[rh], scale_log2) -
                                               reference_exponent(new_max, scale_log2));
      max[rh] = new_max;
      sum[rh] = (sum[rh] + block_sums[rh]) * rescale[rh];
    }
    CUTE_UNROLL
    for (int v = 0; v < cute::size(tSrS); ++v) { tSrS(v) *= rescale[AccumulatorLayout::row_half(v)]; }
  }

  // O *= rescale per row, unless no row of the warp has a new max. Past the first blocks of a
  // list that is the common case, the more so in KAP's order (blocks holding a row max first),
  // and it takes 64 multiplications per thread off the path between P V and the next GEMM turn.
  template <class FragO>
  __device__ static void rescale_o(FragO& tOrO, const float (&rescale)[2]) {
    if (!__any_sync(0xffffffffu, rescale[0] != 1.f || rescale[1] != 1.f)) { return; }
    CUTE_UNROLL
    for (int v = 0; v < cute::size(tOrO); ++v) { tOrO(v) *= rescale[AccumulatorLayout::row_half(v)]; }
  }

  // The full row sums (reduced over the quad), for the epilogue.
  __device__ void finalize_sums(float (&out)[2]) const {
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      float s = sum[rh];
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      out[rh] = s + __shfl_xor_sync(0xffffffffu, s, 2);
    }
  }
};

}  // namespace cosa::osk
