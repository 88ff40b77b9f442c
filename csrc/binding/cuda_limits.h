// What the CUDA kernels and their plain-data view (cosa_params.h) need of the ops' arguments beyond
// the contract: CUDA tensors, aligned rows, int32 sizes, KAP's size limits. CUDA build only.
#pragma once

#include <cstdint>
#include <limits>

#include "binding/contract.h"
#include "cosa_params.h"

namespace cosa::binding {

// The kernels hold sizes and offsets in int32.
constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();

// The contract, then the kernels' limits; the contents of the index tensors are checked later,
// on the device (enqueue_device_checks).
Sizes check_cuda_args(const OpArgs& a);

}  // namespace cosa::binding
