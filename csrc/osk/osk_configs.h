// The compiled OSK configurations (one per instantiations/*.cu), declared without the kernel
// headers so that the dispatcher compiles quickly.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include "cosa_params.h"

namespace cosa::osk {

template <int kHeadDim, class Element>
cudaError_t run_osk_config(const OskParams& params, cudaStream_t stream);

}  // namespace cosa::osk
