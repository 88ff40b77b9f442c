// CTA-local mbarriers and TMA box loads, as thin PTX wrappers (sm_90): the stage pipelines of OSK's
// K/V producer and of KAP's e4m3 scoring kernel.
#pragma once

#include <cstdint>

#include "common/async_copy.cuh"

namespace cosa {

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
        "MBARRIER_WAIT_%=:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
        "@!done bra MBARRIER_WAIT_%=;\n\t}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
  }
};

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

}  // namespace cosa
