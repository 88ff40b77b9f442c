// Shared-memory addresses and 16-byte cp.async copies: the copy primitives that both KAP's scoring
// kernel and OSK's producer warpgroup use, as thin PTX wrappers (sm_80 and later).
#pragma once

#include <cstdint>

namespace cosa {

// The 32-bit shared-window address of a pointer into shared memory, the operand form that PTX's
// shared-memory instructions take.
__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16-byte global -> shared copy that writes zeros instead when `valid` is false (src-size 0:
// nothing is read, so `src` only has to be some address of the same allocation).
__device__ __forceinline__ void cp_async_16_zfill(uint32_t dst_smem, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_smem), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

// Closes the group of the cp.async issued by this thread since the previous commit.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Waits for every cp.async this thread has issued, committed or not.
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

}  // namespace cosa
