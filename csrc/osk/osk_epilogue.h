// OSK epilogue: out = O / l (rows past Lq not written), lse = m + ln(l) in natural-log units, and
// skipped[h, g] (the two warpgroups' counts of skipped 64-row halves, summed). A row that saw no
// live key (l == 0, e.g. a tile with an empty list) gets out = 0 and lse = -inf. O reaches global
// memory through shared memory, in whole 16-byte chunks of its rows.
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/array.h>

#include "osk/osk_params.h"
#include "osk/osk_shared_storage.h"
#include "osk/osk_softmax.h"
#include "osk/osk_sync.h"

namespace cosa::osk {

template <class Traits>
struct OskEpilogue {
  using Element = typename Traits::Element;
  using Storage = OskSharedStorage<Traits>;

  template <class FragO>
  __device__ static void store(const OskKernelParams& kp, const OskTile& t, Storage& storage,
                               FragO& tOrO, const OnlineSoftmax& softmax, int skipped) {
    const OskParams& args = kp.args;
    const PagedLayout& layout = args.layout;
    const int thread = threadIdx.x - Traits::kNumProducerThreads;
    const int lane = thread % 32;
    const int warp = thread / 32;

    float sum[2];
    softmax.finalize_sums(sum);
    float inv_sum[2];
    float lse[2];
    bool empty[2];
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      empty[rh] = sum[rh] == 0.f;  // NaN (a NaN logit) must reach lse, not read as empty
      inv_sum[rh] = empty[rh] ? 0.f : 1.f / sum[rh];
      lse[rh] = empty[rh] ? -INFINITY : softmax.max[rh] * layout.softmax_scale + logf(sum[rh]);
    }

    // Each warpgroup stages its 64 rows of O, normalised and rounded, in its own 64 rows of the Q
    // tile (only its own S = Q K^T read them, and every wgmma has completed), then copies them out
    // one 16-byte chunk per thread and pass: a warp's store covers two whole rows instead of 16
    // bytes of each of eight rows (whole 32-byte sectors, a sixteenth of the store instructions).
    Element* staged = storage.q;
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      const int row = AccumulatorLayout::tile_row(warp, lane, rh);
      CUTE_UNROLL
      for (int n = 0; n < Traits::kHeadDim / 8; ++n) {
        cutlass::Array<Element, 2> pair;
        // An empty row is 0 even where O is NaN (P = 0 times a non-finite V).
        pair[0] = Element(empty[rh] ? 0.f : tOrO(4 * n + 2 * rh) * inv_sum[rh]);
        pair[1] = Element(empty[rh] ? 0.f : tOrO(4 * n + 2 * rh + 1) * inv_sum[rh]);
        *reinterpret_cast<cutlass::Array<Element, 2>*>(
            staged + Traits::swizzled_offset(row, n) + 2 * (lane % 4)) = pair;
      }
      const int row_in_seq = t.block_in_seq * Traits::kBlockM + row;
      if (lane % 4 == 0 && row_in_seq < t.seqlen_q) {
        args.lse[static_cast<int64_t>(t.head) * layout.total_q + t.q_start + row_in_seq] = lse[rh];
      }
    }
    const int warpgroup = thread / 128;
    named_barrier_sync(kEpilogueStageBarrier + warpgroup, 128);

    constexpr int kChunksPerRow = Traits::kChunksPerRow;
    constexpr int kRowsPerPass = Traits::kRowsPerPass;  // a warpgroup's 16-byte chunks per pass
    const int chunk = thread % kChunksPerRow;
    Element* out_head = static_cast<Element*>(args.out) +
                        static_cast<int64_t>(t.head) * args.out_head_stride + chunk * 8;
    CUTE_UNROLL
    for (int pass = 0; pass < 64 / kRowsPerPass; ++pass) {
      const int row = warpgroup * 64 + (thread % 128) / kChunksPerRow + pass * kRowsPerPass;
      const int row_in_seq = t.block_in_seq * Traits::kBlockM + row;
      if (row_in_seq < t.seqlen_q) {
        const uint4 value =
            *reinterpret_cast<const uint4*>(staged + Traits::swizzled_offset(row, chunk));
        *reinterpret_cast<uint4*>(
            out_head + static_cast<int64_t>(t.q_start + row_in_seq) * args.out_row_stride) = value;
      }
    }

    if (thread % 128 == 0) { storage.skipped[thread / 128] = skipped; }
    named_barrier_sync(kEpilogueBarrier, Traits::kNumConsumerThreads);
    if (thread == 0) {
      args.skipped[static_cast<int64_t>(t.head) * layout.num_q_blocks + t.row] =
          storage.skipped[0] + storage.skipped[1];
    }
  }
};

}  // namespace cosa::osk
