#include "kap/kap_score_launch.cuh"

namespace cosa::kap {
COSA_KAP_INSTANTIATE_SCORE(ProxyElement::kFloat16)
}  // namespace cosa::kap
