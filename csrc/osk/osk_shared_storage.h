// The OSK kernel's shared memory, one struct for the whole CTA: the Q tile and the K / V stage
// buffers with their mbarriers (filled by the producer, read by the consumers' main loop), and the
// epilogue's sum of the two consumer warpgroups' skip counts. The epilogue also stages O in the Q
// tile, whose reads have all completed by then.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "osk/osk_traits.h"

namespace cosa::osk {

template <class Traits>
struct OskSharedStorage {
  using Element = typename Traits::Element;
  // The 128-byte swizzle repeats every 1024 bytes: every tile starts on such a boundary.
  alignas(1024) Element q[cosize_v<typename Traits::SmemLayoutQ>];
  alignas(1024) Element k[cosize_v<typename Traits::SmemLayoutKV>];
  alignas(1024) Element v[cosize_v<typename Traits::SmemLayoutKV>];
  uint64_t q_full;
  uint64_t k_full[Traits::kStages];
  uint64_t k_empty[Traits::kStages];
  uint64_t v_full[Traits::kStages];
  uint64_t v_empty[Traits::kStages];
  // Each consumer warpgroup's count of skipped blocks, summed by the epilogue.
  int skipped[2];
};

}  // namespace cosa::osk
