// cosa::run_osk: picks the compiled configuration for the head dim and dtype. The torch binding
// validates shapes and raises readable errors; the checks here only refuse what the kernel cannot
// run (no launch, cudaErrorInvalidValue).
#include "osk/osk_configs.h"

namespace cosa {

cudaError_t run_osk(const OskParams& params, cudaStream_t stream) {
  const PagedLayout& layout = params.layout;
  const bool page_size_ok = valid_page_size(layout.page_size);
  const bool heads_ok = layout.num_heads_kv > 0 && layout.num_heads_q % layout.num_heads_kv == 0;
  if (!page_size_ok || !heads_ok || layout.batch <= 0 || !(layout.softmax_scale > 0.f)) {
    return cudaErrorInvalidValue;
  }
  if (layout.num_q_blocks == 0 || layout.num_heads_q == 0) { return cudaSuccess; }
  if (layout.head_dim == 128) {
    return layout.dtype == DType::kBFloat16
               ? osk::run_osk_config<128, cutlass::bfloat16_t>(params, stream)
               : osk::run_osk_config<128, cutlass::half_t>(params, stream);
  }
  if (layout.head_dim == 64) {
    return layout.dtype == DType::kBFloat16
               ? osk::run_osk_config<64, cutlass::bfloat16_t>(params, stream)
               : osk::run_osk_config<64, cutlass::half_t>(params, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cosa
