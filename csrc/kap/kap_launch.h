// Launchers of the KAP kernels, one translation unit per proxy element type for the scoring kernel
// (the expensive one to compile) and kap_api.cu for the rest.
#pragma once

#include <cuda_runtime.h>

#include "kap/kap_traits.h"

namespace cosa::kap {

template <ProxyElement kElement, int kHeadDim, int kStride>
cudaError_t launch_score(const KapDeviceArgs& args, cudaStream_t stream);

}  // namespace cosa::kap
