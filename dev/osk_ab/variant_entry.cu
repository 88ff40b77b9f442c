// One source tree's hdim-128 bf16 OSK under its own namespace, for the side-by-side harness
// (dev/kernel_ab.py compiles this file once per tree with -I<tree>/csrc, -DAB_NAMESPACE and
// -DAB_LABEL). The harness passes its own cosa::OskParams: the trees compared must agree on
// that struct's layout.
#define cosa AB_NAMESPACE
#include "osk/osk_launch.h"
#undef cosa

#define AB_CONCAT2(a, b) a##b
#define AB_CONCAT(a, b) AB_CONCAT2(a, b)

cudaError_t AB_CONCAT(run_osk_, AB_LABEL)(const void* params, cudaStream_t stream) {
  return AB_NAMESPACE::osk::run_osk_config<128, cutlass::bfloat16_t>(
      *static_cast<const AB_NAMESPACE::OskParams*>(params), stream);
}
