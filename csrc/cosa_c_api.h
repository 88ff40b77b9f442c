/* C entry points to the CoSA kernels, for callers without torch: C and C++ programs, Python ctypes,
 * other languages' foreign-function interfaces. Plain C (C99 or later); needs no CUDA header.
 *
 * The structs below are the launch parameters of cosa_params.h (cosa::PagedLayout, cosa::KapParams,
 * cosa::OskParams) field for field: libcosa_c_api is compiled with a check of every field's offset
 * and size against them, so the two cannot drift apart. Fill one with cosa_kap_params_init() /
 * cosa_osk_params_init() (the tuning defaults of cosa/defaults.py, everything else zero), then set
 * the layout, the pointers and the outputs. Semantics: docs/spec.md (the layout of section 1, KAP of
 * section 2, OSK of section 3).
 *
 * cosa_run_kap and cosa_run_osk refuse plain data the kernels cannot run (valid_kap_params and
 * valid_osk_params of cosa_params.h: null pointers, unaligned rows, head dims, page sizes, strides,
 * scalars out of range, and KAP's size limits) with cudaErrorInvalidValue (1) before any launch. The
 * contents of the index arrays (lengths, page table, lists) are not checked: give the kernels what
 * the torch binding's checks (spec section 1) would accept. Return values are cudaError_t codes
 * (0 = cudaSuccess); launches are asynchronous on `stream` (a cudaStream_t, null = legacy stream).
 */
#ifndef COSA_C_API_H_
#define COSA_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types of q, the caches and out (the dtype field). */
enum { COSA_DTYPE_BFLOAT16 = 0, COSA_DTYPE_FLOAT16 = 1 };
/* What KAP's proxy GEMM multiplies (the precision field): q and k as given, their e4m3 copies, or
 * e4m3 from COSA_FP8_PROXY_MIN_KEYS keys of the longest sequence (cosa_tuning.h) on. */
enum { COSA_PROXY_NATIVE = 0, COSA_PROXY_E4M3 = 1, COSA_PROXY_AUTO = 2 };
/* Who votes to skip a block's P V work (the vote field): the whole 128-row tile or each 64-row half. */
enum { COSA_VOTE_TILE = 0, COSA_VOTE_WARPGROUP = 1 };

/* The paged, varlen, GQA, prefix layout (spec section 1). Strides count elements. */
typedef struct cosa_paged_layout {
  const void* q; /* [total_q, num_heads_q, head_dim], head_dim contiguous */
  int64_t q_row_stride;
  int64_t q_head_stride;
  const void* k_cache; /* [num_pages, page_size, num_heads_kv, head_dim], head_dim contiguous */
  int64_t k_page_stride, k_row_stride, k_head_stride;
  const void* v_cache; /* as k_cache; unused by KAP */
  int64_t v_page_stride, v_row_stride, v_head_stride;
  const int32_t* page_table; /* [batch, max_pages_per_seq] */
  int64_t page_table_stride;
  const int32_t* cu_seqlens_q; /* [batch + 1] */
  const int32_t* seqused_k;    /* [batch] */
  int32_t batch;
  int32_t num_heads_q;
  int32_t num_heads_kv;
  int32_t head_dim;  /* 64 or 128 */
  int32_t page_size; /* a power of two, 16..256 */
  int32_t num_pages;
  int32_t max_pages_per_seq;
  int32_t total_q;
  int32_t max_seqlen_q;
  int32_t max_seqlen_k;
  int32_t num_q_blocks; /* rows of order, counts and skipped: at least the query blocks of the batch */
  int32_t max_k_blocks; /* last dim of order: at least ceil(max_seqlen_k / 128) */
  int32_t dtype;        /* COSA_DTYPE_* */
  float softmax_scale;  /* sigma, usually 1 / sqrt(head_dim) */
  const unsigned long long* input_report; /* null, or the report of the binding's device checks */
} cosa_paged_layout;

/* KAP: the ordered block lists of every (query head, query block). */
typedef struct cosa_kap_params {
  cosa_paged_layout layout;
  int32_t stride;    /* 4, 8 or 16 */
  float top_p;       /* [0, 1] */
  int32_t precision; /* COSA_PROXY_* */
  int32_t* order;    /* out: [num_heads_q, num_q_blocks, max_k_blocks], each list then -1 padding */
  int32_t* counts;   /* out: [num_heads_q, num_q_blocks] */
  void* workspace;   /* cosa_kap_workspace_bytes() bytes, 256-byte aligned */
} cosa_kap_params;

/* OSK: attention over the lists. */
typedef struct cosa_osk_params {
  cosa_paged_layout layout;
  const int32_t* order;  /* [num_heads_q, num_q_blocks, max_k_blocks] */
  const int32_t* counts; /* [num_heads_q, num_q_blocks] */
  float delta;           /* finite; <= 0 turns the in-kernel skip off, else at least FLT_MIN */
  int32_t vote;          /* COSA_VOTE_* */
  void* out;             /* [total_q, num_heads_q, head_dim], q's dtype, 16-byte rows */
  int64_t out_row_stride, out_head_stride;
  float* lse;       /* [num_heads_q, total_q] */
  int32_t* skipped; /* [num_heads_q, num_q_blocks] */
} cosa_osk_params;

/* sizeof of the structs above as the library was built (a foreign-function mirror can compare). */
size_t cosa_kap_params_size(void);
size_t cosa_osk_params_size(void);

/* Every field of *params to its default: the tuning arguments of cosa/defaults.py (stride, top_p,
 * proxy precision; delta, vote), every pointer, size and stride 0, and softmax_scale 0, which the
 * caller must set. */
void cosa_kap_params_init(cosa_kap_params* params);
void cosa_osk_params_init(cosa_osk_params* params);

/* Bytes of scratch memory that cosa_run_kap needs in params->workspace (0 for parameters that
 * cosa_run_kap refuses). Needs no GPU. */
size_t cosa_kap_workspace_bytes(const cosa_kap_params* params);

/* workspace_bytes: the size of the buffer at params->workspace; cudaErrorInvalidValue if it is
 * smaller than cosa_kap_workspace_bytes(params), or if params->workspace is not 256-byte aligned
 * (cudaMalloc's alignment: the kernels copy from it in 16-byte and TMA units). */
int cosa_run_kap(const cosa_kap_params* params, size_t workspace_bytes, void* stream);
int cosa_run_osk(const cosa_osk_params* params, void* stream);

/* cudaGetErrorString of a code returned above. */
const char* cosa_error_string(int error);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* COSA_C_API_H_ */
