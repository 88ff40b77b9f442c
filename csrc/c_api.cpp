// C wrappers around the launchers of cosa_params.h (see cosa_c_api.h).
#include "cosa_c_api.h"

extern "C" {

size_t cosa_kap_params_size(void) { return sizeof(cosa::KapParams); }

size_t cosa_osk_params_size(void) { return sizeof(cosa::OskParams); }

void cosa_kap_params_init(cosa_kap_params* params) {
  if (params) *params = cosa::KapParams{};
}

void cosa_osk_params_init(cosa_osk_params* params) {
  if (params) *params = cosa::OskParams{};
}

size_t cosa_kap_workspace_bytes(const cosa_kap_params* params) {
  return params ? cosa::kap_workspace_bytes(*params) : 0;
}

int cosa_run_kap(const cosa_kap_params* params, size_t workspace_bytes, void* stream) {
  if (!params) return cudaErrorInvalidValue;
  const size_t needed = cosa::kap_workspace_bytes(*params);
  if (needed > 0 && (!params->workspace || workspace_bytes < needed)) return cudaErrorInvalidValue;
  return cosa::run_kap(*params, static_cast<cudaStream_t>(stream));
}

int cosa_run_osk(const cosa_osk_params* params, void* stream) {
  if (!params) return cudaErrorInvalidValue;
  return cosa::run_osk(*params, static_cast<cudaStream_t>(stream));
}

const char* cosa_error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // extern "C"
