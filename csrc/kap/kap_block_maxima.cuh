// The scoring kernels' reduction of a wgmma accumulator to key-block maxima, shared by the row-split
// kernel (kap_score_kernel.cuh) and the resident-query kernel (kap_score_resident_kernel.cuh).
//
// In a 64-row accumulator (kap_mma.cuh) a key block of kRowsPerBlock stride columns is
// kRowsPerBlock / 8 fragments of 8 columns, and each fragment is spread over the four lanes of a
// quad (two columns each). The lanes reduce by halving exchanges: after the xor-1 step a lane keeps
// the blocks with bit 0 equal to its own, after the xor-2 step those with bits 0-1 equal to
// (lane & 3), so that lane owns blocks 4q + (lane & 3), at 1.5 shuffles per block instead of 4.
#pragma once

#include <cmath>

namespace cosa::kap {

// Row half `half` (rows lane / 4 and lane / 4 + 8 of the warp's 16) of accumulator `acc` over
// kGroups key blocks: the max over this thread's columns of each block (kMasked: columns past
// `col_limit`, relative to the accumulator's first column, count as -inf), then the xor-1 exchange;
// pair[g / 2] holds block g or g + 1, whichever has bit 0 equal to the lane's.
template <int kGroups, int kFragsPerGroup, bool kMasked, int kRegs>
__device__ __forceinline__ void pair_block_maxima(const float (&acc)[kRegs], int half, int col_limit,
                                                  int lane, float (&pair)[kGroups / 2]) {
  static_assert(kRegs == 4 * kGroups * kFragsPerGroup, "the accumulator's columns are the blocks'");
  float group_max[kGroups];  // this thread's columns only
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    float m = -INFINITY;
#pragma unroll
    for (int f = 0; f < kFragsPerGroup; ++f) {
      const int frag = g * kFragsPerGroup + f;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = acc[4 * frag + 2 * half + e];
        if (kMasked && 8 * frag + 2 * (lane % 4) + e > col_limit) v = -INFINITY;
        m = fmaxf(m, v);
      }
    }
    group_max[g] = m;
  }
#pragma unroll
  for (int g = 0; g < kGroups; g += 2) {
    const bool odd = lane & 1;
    const float other = __shfl_xor_sync(0xffffffffu, odd ? group_max[g] : group_max[g + 1], 1);
    pair[g / 2] = fmaxf(odd ? group_max[g + 1] : group_max[g], other);
  }
}

// The xor-2 exchange: quad[q] is the max of key block 4q + (lane & 3) over the row's columns.
template <int kGroups>
__device__ __forceinline__ void quad_block_maxima(const float (&pair)[kGroups / 2], int lane,
                                                  float (&quad)[kGroups / 4]) {
#pragma unroll
  for (int k = 0; k < kGroups / 2; k += 2) {
    const bool high = lane & 2;
    const float other = __shfl_xor_sync(0xffffffffu, high ? pair[k] : pair[k + 1], 2);
    quad[k / 2] = fmaxf(high ? pair[k + 1] : pair[k], other);
  }
}

}  // namespace cosa::kap
