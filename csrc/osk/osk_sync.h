// The named barriers between OSK's consumer warpgroups, as thin PTX wrappers. The mbarriers of the
// K/V stage pipeline and the TMA box loads (whole K/V blocks) come from common/tma_pipeline.cuh, the
// 16-byte cp.async with zero fill (Q and partial K/V blocks) from common/async_copy.cuh; KAP's
// scoring kernel shares both.
#pragma once

#include <cstdint>

#include "common/async_copy.cuh"
#include "common/tma_pipeline.cuh"

namespace cosa::osk {

// Named barrier ids 0..7 are used by __syncthreads and reserved by CUTLASS; ours start at 8.
// Ids that come in pairs are indexed by consumer warpgroup (id + 0 or id + 1).
enum NamedBarrierId : uint32_t {
  kTileVoteBarrier = 8,        // both consumer warpgroups: the tile-wide vote
  kWarpgroupVoteBarrier = 9,   // 9, 10: one consumer warpgroup's own vote
  kSchedulerBarrier = 11,      // 11, 12: whose turn it is to issue its GEMMs (ping-pong)
  kEpilogueBarrier = 13,       // both consumer warpgroups: the skip counts are combined
  kEpilogueStageBarrier = 14,  // 14, 15: one consumer warpgroup's O is staged in shared memory
};

__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t num_threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(num_threads) : "memory");
}

// Counts this warp's arrival at barrier `id` without waiting for it to complete.
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t num_threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(num_threads) : "memory");
}

// Waits at barrier `id` like named_barrier_sync and returns whether `predicate` held in every
// participating thread (the reduction is done by the barrier itself: no shared memory, no vote).
__device__ __forceinline__ bool named_barrier_all(uint32_t id, uint32_t num_threads, bool predicate) {
  uint32_t all;
  asm volatile(
      "{\n\t.reg .pred mine, every;\n\t"
      "setp.ne.u32 mine, %3, 0;\n\t"
      "bar.red.and.pred every, %1, %2, mine;\n\t"
      "selp.u32 %0, 1, 0, every;\n\t}\n"
      : "=r"(all)
      : "r"(id), "r"(num_threads), "r"(static_cast<uint32_t>(predicate))
      : "memory");
  return all != 0;
}

}  // namespace cosa::osk
