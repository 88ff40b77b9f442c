// The synchronisation and copy primitives of the OSK kernel, as thin PTX wrappers: CTA-local
// mbarriers (the K/V stage pipeline), named barriers (between the consumer warpgroups) and TMA box
// loads (whole K/V blocks) here; smem_addr and the 16-byte cp.async with zero fill (Q and partial
// K/V blocks) come from common/async_copy.cuh, which KAP's scoring kernel shares.
#pragma once

#include <cstdint>

#include "common/async_copy.cuh"

namespace cosa::osk {

struct MBarrier {
  __device__ __forceinline__ static void init(uint64_t* bar, int arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrivals));
  }
  // Makes the initialisations visible to the async proxy and the other threads (followed by a
  // CTA-wide barrier at the call site).
  __device__ __forceinline__ static void fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __device__ __forceinline__ static void arrive(uint64_t* bar) {
    asm volatile(
        "{\n\t.reg .b64 state;\n\t"
        "mbarrier.arrive.shared::cta.b64 state, [%0];\n\t}\n" ::"r"(smem_addr(bar))
        : "memory");
  }
  // Arrives and adds `bytes` to the transaction count the current phase waits for (TMA).
  __device__ __forceinline__ static void arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
                 "r"(bytes)
                 : "memory");
  }
  // Arrives once all cp.async issued so far by this thread have landed; counts as one of the
  // barrier's expected arrivals (noinc).
  __device__ __forceinline__ static void arrive_on_cp_async(uint64_t* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar))
                 : "memory");
  }
  // Holds the current phase open until all cp.async issued so far by this thread have landed,
  // without counting as an arrival (a separate arrive() does that).
  __device__ __forceinline__ static void hold_for_cp_async(uint64_t* bar) {
    asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar))
                 : "memory");
  }
  // Blocks until the phase with parity `parity` has completed.
  __device__ __forceinline__ static void wait(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n\t.reg .pred done;\n"
        "OSK_WAIT_%=:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
        "@!done bra OSK_WAIT_%=;\n\t}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
  }
};

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

// TMA: one box of a 4-D tensor map (coordinates innermost first) into shared memory, completing
// `bytes` of the barrier's transaction count.
__device__ __forceinline__ void tma_load_4d(uint32_t dst_smem, const void* tensor_map, uint64_t* bar,
                                            int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst_smem),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
      "r"(smem_addr(bar))
      : "memory");
}

}  // namespace cosa::osk
