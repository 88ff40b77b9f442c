// Host side of programmatic dependent launch (PDL), the way every kernel of the KAP -> OSK chain
// is enqueued: the kernel's CTAs may be scheduled while the kernel before it on the stream is
// still running (once every CTA of that one has called cudaTriggerProgrammaticLaunchCompletion()
// or exited), so that its launch and prologue overlap the predecessor's tail instead of waiting
// for the GPU to drain.
//
// The device side's part of the contract: a kernel launched this way calls
// cudaGridDependencySynchronize() before its first global-memory access, since its predecessor
// may be any kernel and that kernel's writes are visible only past the wait; and it calls it in
// every CTA, unconditionally, so that it never completes before its predecessor has, which keeps
// the guarantee transitive along the chain. One exception, within KAP's chain, where the
// predecessor is known: every CTA of a KAP kernel triggers its dependents only past its own wait,
// so a dependent CTA runs only after every kernel before its predecessor has completed, and may
// read what those wrote before its own wait (the quantisation kernel's query blocks read q while
// the range kernel runs; the select kernels read the prefix sums and wait for their own rows'
// scoring through counters), still calling the wait before it exits. The wait returns at once when
// no kernel precedes, and stream capture records the attribute as a programmatic graph edge, so the
// same code runs eagerly and inside a CUDA graph.
#pragma once

#include <utility>

#include <cuda_runtime.h>

namespace cosa {

template <class... KernelParams, class... Args>
cudaError_t launch_dependent(void (*kernel)(KernelParams...), dim3 grid, dim3 block,
                             size_t smem_bytes, cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  const cudaError_t launch_error =
      cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  // Read and cleared as after kernel<<<...>>>, so that a failed launch is reported once.
  const cudaError_t last_error = cudaGetLastError();
  return launch_error != cudaSuccess ? launch_error : last_error;
}

}  // namespace cosa
