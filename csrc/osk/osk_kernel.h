// The OSK kernel: one CTA of three warpgroups per (query head, 128-row query block) tile.
// Warpgroup 0 (few registers) loads Q once; then one of its warps loads the listed K blocks and
// another the V blocks through the page table (osk_paged_kv.h: TMA for whole blocks, cp.async for
// the one holding Lk) into a kStages-deep mbarrier pipeline. Warpgroups 1 and 2 (many registers) each own 64
// query rows and walk the list in order (osk_mainloop.h), then store O and LSE (osk_epilogue.h).
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "common/input_gate.cuh"
#include "osk/osk_epilogue.h"
#include "osk/osk_mainloop.h"
#include "osk/osk_paged_kv.h"
#include "osk/osk_params.h"
#include "osk/osk_shared_storage.h"
#include "osk/osk_sync.h"
#include "osk/osk_tile_scheduler.h"

namespace cosa::osk {

// kSkip: whether the launch may skip blocks (delta > 0). Without it the consumer step carries no
// vote code at all, which measured 3-5% faster than the same step with the vote present but
// switched off at run time (the vote's branch splits the step where ptxas would interleave the row
// maxima with the exponentials).
template <class Traits, bool kSkip>
__global__ void __launch_bounds__(Traits::kNumThreads, 1)
    osk_fwd_kernel(const __grid_constant__ OskKernelParams kp) {
  using Mainloop = OskMainloop<Traits>;
  using Storage = OskSharedStorage<Traits>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Storage& storage = *reinterpret_cast<Storage*>(smem_raw);

  if (threadIdx.x == 0) {
    MBarrier::init(&storage.q_full, Traits::kNumProducerThreads);
    const int kv_warps = OskPagedKV<Traits>::kv_load_warps(kp);
    for (int s = 0; s < Traits::kStages; ++s) {
      // One arrival per producer warp loading that cache (plus the TMA transaction bytes of whole
      // blocks).
      MBarrier::init(&storage.k_full[s], kv_warps);
      MBarrier::init(&storage.v_full[s], kv_warps);
      // Released by lane 0 of each consumer warp once its MMA reading the stage is done.
      MBarrier::init(&storage.k_empty[s], Traits::kNumConsumerThreads / 32);
      MBarrier::init(&storage.v_empty[s], Traits::kNumConsumerThreads / 32);
    }
    MBarrier::fence_init();
  }
  __syncthreads();
  // A dependent launch (common/dependent_launch.h): the barrier set-up above overlaps the end of
  // the kernel before this one (KAP's last select kernel in a prefill); the lists and counts that
  // KAP writes, and any global memory in the standalone op, are touched only past this wait.
  cudaGridDependencySynchronize();
  if (inputs_rejected(kp.args.layout)) return;

  const OskTile tile = OskTileScheduler::get_tile(kp);
  if (!tile.valid) {  // padding row of order/counts/skipped: only skipped is defined there
    if (threadIdx.x == 0) {
      kp.args.skipped[static_cast<int64_t>(tile.head) * kp.args.layout.num_q_blocks + tile.row] = 0;
    }
    return;
  }

  if (threadIdx.x / 128 == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    Mainloop::load(kp, tile, storage);
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
    typename Traits::TiledMmaPV mma_pv;
    Tensor tOrO = partition_fragment_C(
        mma_pv, Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{});
    clear(tOrO);
    OnlineSoftmax softmax;
    int skipped = 0;
    Mainloop::template mma<kSkip>(kp, tile, storage, tOrO, softmax, skipped);
    OskEpilogue<Traits>::store(kp, tile, storage, tOrO, softmax, skipped);
  }
}

}  // namespace cosa::osk
