// OSK epilogue: out = O / l (rows past Lq not written), lse = m + ln(l) in natural-log units,
// skipped[h, g]. A row that saw no live key (l == 0, e.g. a tile with an empty list) gets
// out = 0 and lse = -inf.
#pragma once

#include <cute/tensor.hpp>

#include "osk/osk_mainloop.h"

namespace cosa::osk {

template <class Traits>
struct OskEpilogue {
  using Element = typename Traits::Element;
  using RowState = typename OskMainloop<Traits>::RowState;

  template <class FragO>
  __device__ static void store(const OskKernelParams& kp, const OskTile& t, FragO& tOrO,
                               RowState& rows, int skipped) {
    const OskParams& args = kp.args;
    const PagedLayout& layout = args.layout;
    const int thread = threadIdx.x - Traits::kNumProducerThreads;
    const int lane = thread % 32;
    const int warp = thread / 32;

    float inv_sum[2];
    float lse[2];
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      float sum = rows.sum[rh];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const bool empty = !(sum > 0.f);
      inv_sum[rh] = empty ? 0.f : 1.f / sum;
      lse[rh] = empty ? -INFINITY : rows.max[rh] * layout.softmax_scale + logf(sum);
    }

    Element* out_head = static_cast<Element*>(args.out) +
                        static_cast<int64_t>(t.head) * args.out_head_stride;
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      const int row_in_seq = t.block_in_seq * Traits::kBlockM + warp * 16 + rh * 8 + lane / 4;
      if (row_in_seq >= t.seqlen_q) { continue; }
      const int token = t.q_start + row_in_seq;
      Element* out_row = out_head + static_cast<int64_t>(token) * args.out_row_stride;
      CUTE_UNROLL
      for (int n = 0; n < Traits::kHeadDim / 8; ++n) {
        const int col = 8 * n + 2 * (lane % 4);
        cutlass::Array<Element, 2> pair;
        pair[0] = Element(tOrO(4 * n + 2 * rh) * inv_sum[rh]);
        pair[1] = Element(tOrO(4 * n + 2 * rh + 1) * inv_sum[rh]);
        *reinterpret_cast<cutlass::Array<Element, 2>*>(out_row + col) = pair;
      }
      if (lane % 4 == 0) {
        args.lse[static_cast<int64_t>(t.head) * layout.total_q + token] = lse[rh];
      }
    }
    if (thread == 0) {
      args.skipped[static_cast<int64_t>(t.head) * layout.num_q_blocks + t.row] = skipped;
    }
  }
};

}  // namespace cosa::osk
