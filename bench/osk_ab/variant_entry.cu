// One source tree's hdim-128 bf16 OSK under its own namespace, for the side-by-side harness
// (bench/osk_ab.py compiles this file once per tree with -I<tree>/csrc, -DOSK_AB_NAMESPACE and
// -DOSK_AB_LABEL). The harness passes its own cosa::OskParams: the trees compared must agree on
// that struct's layout.
#define cosa OSK_AB_NAMESPACE
#include "osk/osk_launch.h"
#undef cosa

#define OSK_AB_CONCAT2(a, b) a##b
#define OSK_AB_CONCAT(a, b) OSK_AB_CONCAT2(a, b)

cudaError_t OSK_AB_CONCAT(run_osk_, OSK_AB_LABEL)(const void* params, cudaStream_t stream) {
  return OSK_AB_NAMESPACE::osk::run_osk_config<128, cutlass::bfloat16_t>(
      *static_cast<const OSK_AB_NAMESPACE::OskParams*>(params), stream);
}
