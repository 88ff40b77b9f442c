/* The C API from C: the structs of cosa_c_api.h filled by a C program, and every check that
 * cosa_run_kap / cosa_run_osk make before a launch, so it needs no GPU: parameters the kernels
 * cannot run (KAP's size limits among them) get cudaErrorInvalidValue and no workspace, and a KAP
 * problem within the limits gets a workspace size. Nothing here launches a kernel. Built and run by
 * CTest (CMakeLists.txt); exits non-zero at the first failed check. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "cosa_c_api.h"

enum { kInvalidValue = 1 }; /* cudaErrorInvalidValue */

static int failures = 0;
static int checks = 0;

static void expect(int ok, const char* what) {
  ++checks;
  if (!ok) {
    ++failures;
    fprintf(stderr, "FAILED: %s\n", what);
  }
}

/* Stands in for every device pointer: aligned, never dereferenced (no check reads the data). */
static _Alignas(256) unsigned char fake_device_memory[256];

/* One sequence of `tokens` tokens, 32 query heads, 8 KV heads, d 128, bf16, pages of 128 tokens,
 * dense strides: what the torch binding would lay out for contiguous tensors. */
static cosa_paged_layout layout_of(int32_t tokens) {
  cosa_paged_layout l;
  memset(&l, 0, sizeof l);
  l.batch = 1;
  l.num_heads_q = 32;
  l.num_heads_kv = 8;
  l.head_dim = 128;
  l.page_size = 128;
  l.total_q = tokens;
  l.max_seqlen_q = tokens;
  l.max_seqlen_k = tokens;
  l.num_q_blocks = (tokens + 127) / 128;
  l.max_k_blocks = (tokens + 127) / 128;
  l.num_pages = l.max_k_blocks;
  l.max_pages_per_seq = l.max_k_blocks;
  l.dtype = COSA_DTYPE_BFLOAT16;
  l.softmax_scale = 0.08838834764831845f; /* 1 / sqrt(128) */
  l.q = fake_device_memory;
  l.q_head_stride = l.head_dim;
  l.q_row_stride = (int64_t)l.num_heads_q * l.head_dim;
  l.k_cache = l.v_cache = fake_device_memory;
  l.k_head_stride = l.v_head_stride = l.head_dim;
  l.k_row_stride = l.v_row_stride = (int64_t)l.num_heads_kv * l.head_dim;
  l.k_page_stride = l.v_page_stride = l.k_row_stride * l.page_size;
  l.page_table = (const int32_t*)fake_device_memory;
  l.page_table_stride = l.max_pages_per_seq;
  l.cu_seqlens_q = (const int32_t*)fake_device_memory;
  l.seqused_k = (const int32_t*)fake_device_memory;
  return l;
}

static cosa_kap_params kap_of(cosa_paged_layout layout, int32_t precision) {
  cosa_kap_params p;
  cosa_kap_params_init(&p);
  p.layout = layout;
  p.precision = precision;
  p.order = (int32_t*)fake_device_memory;
  p.counts = (int32_t*)fake_device_memory;
  return p;
}

/* A KAP problem the launcher must refuse: no workspace, and cudaErrorInvalidValue before a launch. */
static void expect_kap_refused(const cosa_kap_params* p, const char* what) {
  char message[256];
  snprintf(message, sizeof message, "%s: cosa_kap_workspace_bytes is 0", what);
  expect(cosa_kap_workspace_bytes(p) == 0, message);
  snprintf(message, sizeof message, "%s: cosa_run_kap refuses it", what);
  expect(cosa_run_kap(p, sizeof fake_device_memory, NULL) == kInvalidValue, message);
}

static void expect_kap_accepted(const cosa_kap_params* p, const char* what) {
  char message[256];
  snprintf(message, sizeof message, "%s: cosa_kap_workspace_bytes is positive", what);
  expect(cosa_kap_workspace_bytes(p) > 0, message);
}

int main(void) {
  expect(cosa_kap_params_size() == sizeof(cosa_kap_params), "sizeof(cosa_kap_params) is the library's");
  expect(cosa_osk_params_size() == sizeof(cosa_osk_params), "sizeof(cosa_osk_params) is the library's");

  /* The defaults of cosa/defaults.py. */
  cosa_kap_params kap;
  cosa_kap_params_init(&kap);
  expect(kap.stride == 8 && kap.top_p == 0.95f && kap.precision == COSA_PROXY_AUTO, "KAP defaults");
  cosa_osk_params osk;
  cosa_osk_params_init(&osk);
  expect(osk.delta == 2000.0f && osk.vote == COSA_VOTE_WARPGROUP, "OSK defaults");

  /* Zeroed, and only the defaults: refused. */
  memset(&kap, 0, sizeof kap);
  expect_kap_refused(&kap, "a zeroed KAP struct");
  cosa_kap_params_init(&kap);
  expect_kap_refused(&kap, "a KAP struct with only the defaults");
  memset(&osk, 0, sizeof osk);
  expect(cosa_run_osk(&osk, NULL) == kInvalidValue, "a zeroed OSK struct is refused");
  cosa_osk_params_init(&osk);
  expect(cosa_run_osk(&osk, NULL) == kInvalidValue, "an OSK struct with only the defaults is refused");
  expect(cosa_run_kap(NULL, 0, NULL) == kInvalidValue && cosa_run_osk(NULL, NULL) == kInvalidValue,
         "null parameters are refused");

  /* Within the limits: 32K tokens, every proxy. */
  const cosa_paged_layout base = layout_of(32768);
  for (int32_t precision = COSA_PROXY_NATIVE; precision <= COSA_PROXY_AUTO; ++precision) {
    kap = kap_of(base, precision);
    expect_kap_accepted(&kap, "32K tokens");
  }
  kap = kap_of(base, COSA_PROXY_AUTO);
  expect(cosa_run_kap(&kap, cosa_kap_workspace_bytes(&kap) - 1, NULL) == kInvalidValue,
         "a workspace one byte short is refused");

  /* Plain data out of range. */
  cosa_paged_layout l = base;
  l.head_dim = 96;
  kap = kap_of(l, COSA_PROXY_AUTO);
  expect_kap_refused(&kap, "head_dim 96");
  l = base;
  l.page_size = 48;
  kap = kap_of(l, COSA_PROXY_AUTO);
  expect_kap_refused(&kap, "page_size 48");
  l = base;
  l.num_heads_q = 30;
  kap = kap_of(l, COSA_PROXY_AUTO);
  expect_kap_refused(&kap, "30 query heads over 8 KV heads");
  l = base;
  l.q_row_stride = -l.q_row_stride;
  kap = kap_of(l, COSA_PROXY_AUTO);
  expect_kap_refused(&kap, "a negative q row stride");
  l = base;
  l.k_row_stride += 4;
  kap = kap_of(l, COSA_PROXY_AUTO);
  expect_kap_refused(&kap, "a k_cache row stride that is not a multiple of 8");
  kap = kap_of(base, COSA_PROXY_AUTO);
  kap.stride = 32;
  expect_kap_refused(&kap, "stride 32");
  kap = kap_of(base, COSA_PROXY_AUTO);
  kap.top_p = 1.5f;
  expect_kap_refused(&kap, "top_p 1.5");
  kap = kap_of(base, 7);
  expect_kap_refused(&kap, "proxy precision 7");

  /* The lists must hold every candidate block. */
  l = base;
  l.max_k_blocks -= 1;
  kap = kap_of(l, COSA_PROXY_AUTO);
  expect_kap_refused(&kap, "max_k_blocks below ceil(max_seqlen_k / 128)");

  /* KAP sorts at most 16384 key blocks a list. */
  l = layout_of(16384 * 128);
  kap = kap_of(l, COSA_PROXY_NATIVE);
  expect_kap_accepted(&kap, "16384 key blocks");
  l = layout_of(16384 * 128 + 1);
  kap = kap_of(l, COSA_PROXY_NATIVE);
  expect_kap_refused(&kap, "16385 key blocks");

  /* q and the key cache each span at most 2^35 elements (2^32 16-byte units). */
  l = base;
  /* The largest row stride (a multiple of 8) whose last row still ends within 2^35 elements. */
  l.q_row_stride = (((int64_t)1 << 35) - (int64_t)l.num_heads_q * l.head_dim) / (l.total_q - 1) / 8 * 8;
  kap = kap_of(l, COSA_PROXY_AUTO);
  expect_kap_accepted(&kap, "q spanning just under 2^35 elements");
  l.q_row_stride += 8;
  kap = kap_of(l, COSA_PROXY_AUTO);
  expect_kap_refused(&kap, "q spanning more than 2^35 elements");
  l = base;
  l.k_page_stride = ((int64_t)1 << 35) / (l.num_pages - 1);
  kap = kap_of(l, COSA_PROXY_AUTO);
  expect_kap_refused(&kap, "a key cache spanning more than 2^35 elements");

  /* The fp8 proxy's copy of the keys holds at most 2^36 bytes: batch x max_k_blocks x 128 x Hkv x d
   * (sequences that share one cache's pages each get their own rows there). 64 sequences of 2^20
   * keys, 8 KV heads of 128 are 2^36 bytes; 65 are more. */
  l = layout_of(1 << 20);
  l.max_seqlen_q = 128;
  l.num_q_blocks = 64;
  l.total_q = 64 * 128;
  l.q_row_stride = (int64_t)l.num_heads_q * l.head_dim;
  l.batch = 64;
  kap = kap_of(l, COSA_PROXY_E4M3);
  expect_kap_accepted(&kap, "an fp8 key copy of 2^36 bytes");
  l.batch = 65;
  l.num_q_blocks = 65;
  l.total_q = 65 * 128;
  kap = kap_of(l, COSA_PROXY_E4M3);
  expect_kap_refused(&kap, "an fp8 key copy past 2^36 bytes");
  kap = kap_of(l, COSA_PROXY_AUTO);
  expect_kap_refused(&kap, "an fp8 key copy past 2^36 bytes, chosen by auto");
  kap = kap_of(l, COSA_PROXY_NATIVE);
  expect_kap_accepted(&kap, "the same problem with the native proxy");

  /* At most 65535 scoring tiles (CUDA's grid z): 65536 one-token sequences are too many. */
  l = layout_of(1);
  l.batch = 65535;
  l.total_q = 65535;
  l.num_q_blocks = 65535;
  kap = kap_of(l, COSA_PROXY_NATIVE);
  expect_kap_accepted(&kap, "65535 one-token sequences");
  l.batch = 65536;
  l.total_q = 65536;
  l.num_q_blocks = 65536;
  kap = kap_of(l, COSA_PROXY_NATIVE);
  expect_kap_refused(&kap, "65536 one-token sequences");

  /* OSK refuses what it cannot address before any launch. */
  cosa_osk_params_init(&osk);
  osk.layout = base;
  osk.order = osk.counts = (const int32_t*)fake_device_memory;
  osk.out = fake_device_memory;
  osk.out_head_stride = base.head_dim;
  osk.out_row_stride = -(int64_t)base.num_heads_q * base.head_dim;
  osk.lse = (float*)fake_device_memory;
  osk.skipped = (int32_t*)fake_device_memory;
  expect(cosa_run_osk(&osk, NULL) == kInvalidValue, "OSK with a negative out row stride is refused");
  osk.out_row_stride = -osk.out_row_stride;
  osk.vote = 2;
  expect(cosa_run_osk(&osk, NULL) == kInvalidValue, "OSK with vote scope 2 is refused");
  osk.vote = COSA_VOTE_TILE;
  osk.layout.v_cache = NULL;
  expect(cosa_run_osk(&osk, NULL) == kInvalidValue, "OSK without a value cache is refused");

  printf("%d passed, %d failed\n", checks - failures, failures);
  return failures == 0 ? 0 : 1;
}
