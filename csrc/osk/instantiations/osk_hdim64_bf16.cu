// One OSK configuration per file keeps builds parallel and small.
#include "osk/osk_launch.h"

namespace cosa::osk {
template cudaError_t run_osk_config<64, cutlass::bfloat16_t>(const OskParams&, cudaStream_t);
}  // namespace cosa::osk
