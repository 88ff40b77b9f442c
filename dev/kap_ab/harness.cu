// KAP side by side: the whole KAP launch chain of several source trees (dev/kernel_ab.py builds
// each under its own namespace, variant_entry.cu) run on the same inputs in one process. Inputs:
// one sequence, random normal bf16 q and k, d 128, pages of 128 tokens shuffled, stride 8 (4 and
// 16 in two cases), top_p 0.95; the fp8 and the native proxy at 4K to 128K tokens with 32 query
// and 8 KV heads (4 query heads per KV head), and at 32K with 24 and 4 (6 per KV head) and with 12
// and 2. Every variant's lists
// (order and counts, poisoned before the first run) are compared entry by entry with the first
// variant's; times are medians of CUDA-event timings, repeated in interleaved rounds. Torch-free.
//
//   kap_ab_harness ROUNDS [CASE_FILTER]
//
// Prints one "ROW" line per (case, variant) for dev/kernel_ab.py, and a table.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "ab_common.cuh"
#include "cosa_params.h"

using RunKap = cudaError_t (*)(const void*, cudaStream_t);
using KapWorkspaceBytes = size_t (*)(const void*);
// AB_VARIANTS(X) expands X(label) once per built tree; each tree defines run_kap_<label> and
// kap_workspace_bytes_<label>.
#define KAP_AB_DECLARE(label)                                     \
  cudaError_t run_kap_##label(const void*, cudaStream_t);         \
  size_t kap_workspace_bytes_##label(const void*);
AB_VARIANTS(KAP_AB_DECLARE)
#define KAP_AB_ENTRY(label) {#label, run_kap_##label, kap_workspace_bytes_##label},
struct Variant {
  const char* label;
  RunKap run;
  KapWorkspaceBytes workspace_bytes;
};
static const Variant kVariants[] = {AB_VARIANTS(KAP_AB_ENTRY)};
static const int kNumVariants = sizeof(kVariants) / sizeof(kVariants[0]);

struct Case {
  const char* name;
  int tokens;
  int heads_q;
  int heads_kv;
  cosa::ProxyPrecision precision;
  int stride = 8;
};

static const Case kCases[] = {
    {"fp8-8K", 8192, 32, 8, cosa::ProxyPrecision::kE4M3},
    {"fp8-32K", 32768, 32, 8, cosa::ProxyPrecision::kE4M3},
    {"fp8-128K", 131072, 32, 8, cosa::ProxyPrecision::kE4M3},
    {"fp8-32K-6-per-kv", 32768, 24, 4, cosa::ProxyPrecision::kE4M3},
    {"fp8-16K", 16384, 32, 8, cosa::ProxyPrecision::kE4M3},
    // The attention shape of Qwen2.5-1.5B (12 query heads, 2 KV heads); at 8K and 16K with both
    // proxies, where "auto" switches from one to the other.
    {"fp8-32K-12q-2kv", 32768, 12, 2, cosa::ProxyPrecision::kE4M3},
    {"fp8-8K-12q-2kv", 8192, 12, 2, cosa::ProxyPrecision::kE4M3},
    {"native-8K-12q-2kv", 8192, 12, 2, cosa::ProxyPrecision::kNative},
    {"fp8-16K-12q-2kv", 16384, 12, 2, cosa::ProxyPrecision::kE4M3},
    {"native-16K-12q-2kv", 16384, 12, 2, cosa::ProxyPrecision::kNative},
    // Both proxies at 4K and 8K: where the fp8 one starts to pay (proxy_precision "auto").
    {"fp8-4K", 4096, 32, 8, cosa::ProxyPrecision::kE4M3},
    // The other strides.
    {"fp8-32K-stride-4", 32768, 32, 8, cosa::ProxyPrecision::kE4M3, 4},
    {"fp8-32K-stride-16", 32768, 32, 8, cosa::ProxyPrecision::kE4M3, 16},
    {"native-4K", 4096, 32, 8, cosa::ProxyPrecision::kNative},
    {"native-8K", 8192, 32, 8, cosa::ProxyPrecision::kNative},
    {"native-32K", 32768, 32, 8, cosa::ProxyPrecision::kNative},
};

int main(int argc, char** argv) {
  constexpr int kHeadDim = 128, kPageSize = 128;
  Harness harness(argc, argv, kVariants);
  const std::vector<const char*>& labels = harness.labels;
  const cudaStream_t stream = harness.stream;
  for (const Case& c : kCases) {
    if (!harness.selects(c.name)) continue;
    const int n = c.tokens, blocks = n / cosa::kBlockSize;
    const size_t q_elems = size_t(n) * c.heads_q * kHeadDim, k_elems = size_t(n) * c.heads_kv * kHeadDim;
    const size_t list_entries = size_t(c.heads_q) * blocks * blocks, count_entries = size_t(c.heads_q) * blocks;
    __nv_bfloat16 *q, *k_cache;
    CUDA_CHECK(cudaMalloc(&q, q_elems * 2));
    CUDA_CHECK(cudaMalloc(&k_cache, k_elems * 2));
    fill_normal<<<1024, 256, 0, stream>>>(q, q_elems, 1);
    fill_normal<<<1024, 256, 0, stream>>>(k_cache, k_elems, 2);
    CUDA_CHECK(cudaGetLastError());
    const OneSequence sequence(n, c.heads_q, c.heads_kv, kHeadDim, kPageSize, q, k_cache, nullptr, harness.rng);
    int *order, *counts;
    CUDA_CHECK(cudaMalloc(&order, list_entries * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&counts, count_entries * sizeof(int)));

    cosa::KapParams params;
    params.layout = sequence.layout;
    params.stride = c.stride;
    params.top_p = 0.95f;
    params.precision = c.precision;
    params.order = order;
    params.counts = counts;
    size_t workspace_bytes = 0;
    for (const Variant& v : kVariants) workspace_bytes = std::max(workspace_bytes, v.workspace_bytes(&params));
    CUDA_CHECK(cudaMalloc(&params.workspace, std::max<size_t>(workspace_bytes, 1)));

    // Output check: each variant's first lists against the first variant's, entry by entry.
    std::vector<long long> mismatches(kNumVariants, 0);
    std::vector<int> reference(list_entries + count_entries), candidate(list_entries + count_entries);
    for (int v = 0; v < kNumVariants; ++v) {
      CUDA_CHECK(cudaMemsetAsync(order, 0x7f, list_entries * sizeof(int), stream));
      CUDA_CHECK(cudaMemsetAsync(counts, 0x7f, count_entries * sizeof(int), stream));
      CUDA_CHECK(kVariants[v].run(&params, stream));
      CUDA_CHECK(cudaStreamSynchronize(stream));
      CUDA_CHECK(cudaGetLastError());
      std::vector<int>& lists = v == 0 ? reference : candidate;
      CUDA_CHECK(cudaMemcpy(lists.data(), order, list_entries * sizeof(int), cudaMemcpyDeviceToHost));
      CUDA_CHECK(cudaMemcpy(lists.data() + list_entries, counts, count_entries * sizeof(int),
                            cudaMemcpyDeviceToHost));
      if (v == 0) continue;
      for (size_t i = 0; i < reference.size(); ++i) mismatches[v] += reference[i] != candidate[i];
    }
    time_and_report(c.name, labels, harness.rounds, stream, mismatches,
                    [&](int v) { CUDA_CHECK(kVariants[v].run(&params, stream)); });
    for (void* p : {(void*)q, (void*)k_cache, (void*)order, (void*)counts, params.workspace}) {
      CUDA_CHECK(cudaFree(p));
    }
  }
  print_footer(kVariants[0].label);
  return 0;
}
