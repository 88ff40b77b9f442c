// The two places where OSK's consumer warpgroups coordinate inside the main loop: the skip vote
// (spec section 3) and the turns in which they issue their GEMMs.
#pragma once

#include <cstdint>

#include "cosa_params.h"
#include "osk/osk_sync.h"

namespace cosa::osk {

// Whether a listed block's P V work is skipped, decided by the rows that share the decision:
// the whole 128-row tile (both warpgroups meet at one barrier per block) or one 64-row warpgroup
// (each half decides alone, so the halves never wait for each other).
class SkipVote {
 public:
  // The scope only picks the barrier and its thread count, so that both scopes run the same
  // single barrier instruction (two predicated ones, one per scope, had each its own convergence
  // check on the step's path).
  __device__ SkipVote(VoteScope scope, int warpgroup)
      : barrier_(scope == VoteScope::kTile ? uint32_t(kTileVoteBarrier)
                                           : uint32_t(kWarpgroupVoteBarrier + warpgroup)),
        voters_(scope == VoteScope::kTile ? 256u : 128u) {}

  // Every voter must call this with its rows' verdict; all of them get the same answer. The
  // barrier reduces the verdicts itself (bar.red.and), so consecutive votes need no buffers.
  __device__ bool decide(bool rows_skip) const { return named_barrier_all(barrier_, voters_, rows_skip); }

 private:
  uint32_t barrier_;
  uint32_t voters_;
};

// Ping-pong between the consumer warpgroups (as FlashAttention-3 schedules them): a warpgroup issues
// its GEMMs of a block only in its turn, then hands the turn over, so that one warpgroup's GEMMs
// run on the tensor cores while the other's softmax runs, rather than both contending at once
// (measured on the H200: 1.5-3% faster than without, geometric mean over dense and random lists).
// Turn i is barrier kSchedulerBarrier + i over 256 threads: 128 waiting, 128 handing over.
class GemmTurns {
 public:
  __device__ explicit GemmTurns(int warpgroup) : warpgroup_(warpgroup) {}

  // Warpgroup 0 gives itself the first turn. Each warpgroup then waits once and hands over once
  // per list entry; the one turn left over at the end dies with the CTA.
  __device__ void start() const {
    if (warpgroup_ == 0) { named_barrier_arrive(kSchedulerBarrier, 256); }
  }
  __device__ void wait_mine() const { named_barrier_sync(kSchedulerBarrier + warpgroup_, 256); }
  __device__ void pass() const { named_barrier_arrive(kSchedulerBarrier + (1 - warpgroup_), 256); }

 private:
  int warpgroup_;
};

}  // namespace cosa::osk
