#include "kap/kap_score_launch.cuh"

namespace cosa::kap {
COSA_KAP_INSTANTIATE_SCORE(ProxyElement::kE4M3)
}  // namespace cosa::kap
