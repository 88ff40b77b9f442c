// What the CUDA kernels and their plain-data view (cosa_params.h) need of the ops' arguments beyond
// the contract: CUDA tensors, aligned rows, int32 sizes, KAP's size limits. CUDA build only.
#pragma once

#include <cstdint>
#include <limits>

#include <c10/util/string_view.h>

#include "binding/contract.h"
#include "cosa_params.h"

namespace cosa::binding {

// The kernels hold sizes and offsets in int32.
constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();

cosa::ProxyPrecision proxy_precision_of(c10::string_view precision);  // checked by check_scalars

// The contract, then the kernels' limits; the contents of the index tensors are checked later,
// on the device (enqueue_device_checks).
Sizes check_cuda_args(const OpArgs& a);

}  // namespace cosa::binding
