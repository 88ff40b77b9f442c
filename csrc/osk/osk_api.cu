// cosa::run_osk: picks the compiled configuration for the head dim and dtype. The torch binding
// validates shapes and raises readable errors; valid_osk_params (cosa_params.h) refuses, before any
// launch, the plain data the kernel cannot run (cudaErrorInvalidValue).
#include "osk/osk_configs.h"

namespace cosa {

cudaError_t run_osk(const OskParams& params, cudaStream_t stream) {
  if (!valid_osk_params(params)) { return cudaErrorInvalidValue; }
  const PagedLayout& layout = params.layout;
  if (layout.num_q_blocks == 0) { return cudaSuccess; }
  if (layout.head_dim == 128) {
    return layout.dtype == DType::kBFloat16
               ? osk::run_osk_config<128, cutlass::bfloat16_t>(params, stream)
               : osk::run_osk_config<128, cutlass::half_t>(params, stream);
  }
  return layout.dtype == DType::kBFloat16  // head dim 64 (valid_osk_params)
             ? osk::run_osk_config<64, cutlass::bfloat16_t>(params, stream)
             : osk::run_osk_config<64, cutlass::half_t>(params, stream);
}

}  // namespace cosa
