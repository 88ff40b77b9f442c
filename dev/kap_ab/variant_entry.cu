// One source tree's KAP (the whole launch chain: index, key range, quantisation, scoring and
// selection) under its own namespace, for the side-by-side harness (dev/kernel_ab.py compiles
// this file once per tree with -I<tree>/csrc, -DAB_NAMESPACE and -DAB_LABEL). The harness passes
// its own cosa::KapParams: the trees compared must agree on that struct's layout.
#define cosa AB_NAMESPACE
#include "kap/kap_api.cu"
#include "kap/kap_score_bf16.cu"
#include "kap/kap_score_e4m3.cu"
#include "kap/kap_score_fp16.cu"
#undef cosa

#define AB_CONCAT2(a, b) a##b
#define AB_CONCAT(a, b) AB_CONCAT2(a, b)

cudaError_t AB_CONCAT(run_kap_, AB_LABEL)(const void* params, cudaStream_t stream) {
  return AB_NAMESPACE::run_kap(*static_cast<const AB_NAMESPACE::KapParams*>(params), stream);
}

size_t AB_CONCAT(kap_workspace_bytes_, AB_LABEL)(const void* params) {
  return AB_NAMESPACE::kap_workspace_bytes(*static_cast<const AB_NAMESPACE::KapParams*>(params));
}
