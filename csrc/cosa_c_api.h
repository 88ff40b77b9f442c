// C entry points to the CoSA kernels, for callers without torch (C programs, Python ctypes).
// The parameter structs are those of cosa_params.h (cosa::KapParams, cosa::OskParams); C callers
// mirror their layout and may compare sizeof with cosa_kap_params_size()/cosa_osk_params_size().
// cosa_run_kap and cosa_run_osk refuse plain data the kernels cannot run (valid_kap_params and
// valid_osk_params of cosa_params.h: null pointers, unaligned rows, head dims, page sizes, strides,
// scalars out of range) with cudaErrorInvalidValue before any launch; the contents of the index
// arrays (lengths, page table, lists) are not checked: give the kernels what the torch binding's
// checks (csrc/torch_binding.cpp, spec section 1) would accept. Return values are cudaError_t codes
// (0 = cudaSuccess); launches are asynchronous on `stream` (a cudaStream_t, null = legacy stream).
#pragma once

#include <stddef.h>

#ifdef __cplusplus
#include "cosa_params.h"
typedef cosa::KapParams cosa_kap_params;
typedef cosa::OskParams cosa_osk_params;
extern "C" {
#else
typedef struct cosa_kap_params cosa_kap_params;
typedef struct cosa_osk_params cosa_osk_params;
#endif

size_t cosa_kap_params_size(void);
size_t cosa_osk_params_size(void);

// Every field of *params to its default: the tuning arguments of cosa/defaults.py (stride, top_p,
// proxy precision; delta, vote), every pointer, size and stride 0, and softmax_scale 0, which the
// caller must set (1 / sqrt(head_dim) is the usual value).
void cosa_kap_params_init(cosa_kap_params* params);
void cosa_osk_params_init(cosa_osk_params* params);

// Bytes of scratch memory that cosa_run_kap needs in params->workspace (0 when none, and for
// parameters that cosa_run_kap refuses).
size_t cosa_kap_workspace_bytes(const cosa_kap_params* params);

// workspace_bytes: the size of the buffer at params->workspace; cudaErrorInvalidValue if it is
// smaller than cosa_kap_workspace_bytes(params), or if params->workspace is not 256-byte aligned
// (cudaMalloc's alignment: the kernels copy from it in 16-byte and TMA units).
int cosa_run_kap(const cosa_kap_params* params, size_t workspace_bytes, void* stream);
int cosa_run_osk(const cosa_osk_params* params, void* stream);

// cudaGetErrorString of a code returned above.
const char* cosa_error_string(int error);

#ifdef __cplusplus
}  // extern "C"
#endif
