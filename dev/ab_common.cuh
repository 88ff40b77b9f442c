// What the side-by-side harnesses of dev/kernel_ab.py share (osk_ab/harness.cu, kap_ab/harness.cu):
// error checks, random inputs, and the interleaved timing rounds with their report. Torch-free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cosa_params.h"

#define CUDA_CHECK(call)                                                                   \
  do {                                                                                     \
    const cudaError_t status = (call);                                                     \
    if (status != cudaSuccess) {                                                           \
      std::fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(status), __FILE__, \
                   __LINE__);                                                              \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

// Standard normal values from a counter hash and Box-Muller (no curand dependency).
__global__ void fill_normal(__nv_bfloat16* x, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned a = unsigned(i) * 2654435761u ^ seed;
    a ^= a >> 15; a *= 2246822519u; a ^= a >> 13; a *= 3266489917u; a ^= a >> 16;
    unsigned b = a * 747796405u + 2891336453u;
    b ^= b >> 17; b *= 2654435761u; b ^= b >> 11;
    const float u1 = ((a >> 8) + 1) * (1.0f / 16777217.0f);
    const float u2 = (b >> 8) * (1.0f / 16777216.0f);
    x[i] = __float2bfloat16(sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
  }
}

// What every harness starts from: its arguments (ROUNDS [CASE_FILTER]), a stream, the random source
// of its page orders (and lists), and the variants' labels, printed as the table's header.
struct Harness {
  int rounds;
  const char* case_filter;
  cudaStream_t stream;
  std::mt19937 rng{1234};
  std::vector<const char*> labels;

  // `variants`: the harness's table of built trees, each with a `label`.
  template <class Variant, size_t kCount>
  Harness(int argc, char** argv, const Variant (&variants)[kCount])
      : rounds(argc > 1 ? std::atoi(argv[1]) : 3), case_filter(argc > 2 ? argv[2] : "") {
    for (const Variant& variant : variants) labels.push_back(variant.label);
    CUDA_CHECK(cudaStreamCreate(&stream));
    std::printf("%-18s", "case");
    for (size_t v = 0; v < labels.size(); ++v) std::printf(v ? " %30s" : " %16s", labels[v]);
    std::printf("   (median ms; median of the per-round ratios to %s [quartiles]; spread = slowest /"
                " fastest round of %s)\n", labels[0], labels[0]);
  }
  bool selects(const char* case_name) const { return std::strstr(case_name, case_filter) != nullptr; }
};

// One sequence of `tokens` tokens (no prefix) over bf16 q [tokens, heads_q, d] and a paged cache k,
// v [pages, page_size, heads_kv, d] (v may be null) whose pages are listed in shuffled order: the
// device-side page table, cu_seqlens_q and seqused_k, and the cosa::PagedLayout over all of it.
struct OneSequence {
  std::vector<int> page_ids;  // page p of the sequence is page page_ids[p] of the cache
  int* page_table = nullptr;
  int* cu_seqlens_q = nullptr;
  int* seqused_k = nullptr;
  cosa::PagedLayout layout;

  OneSequence(int tokens, int heads_q, int heads_kv, int head_dim, int page_size, const void* q,
              const void* k_cache, const void* v_cache, std::mt19937& rng) {
    const int pages = tokens / page_size;
    page_ids.resize(pages);
    for (int i = 0; i < pages; ++i) page_ids[i] = i;
    std::shuffle(page_ids.begin(), page_ids.end(), rng);
    const int cu[2] = {0, tokens};
    CUDA_CHECK(cudaMalloc(&page_table, pages * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&cu_seqlens_q, sizeof(cu)));
    CUDA_CHECK(cudaMalloc(&seqused_k, sizeof(int)));
    CUDA_CHECK(cudaMemcpy(page_table, page_ids.data(), pages * sizeof(int), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(cu_seqlens_q, cu, sizeof(cu), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(seqused_k, &tokens, sizeof(int), cudaMemcpyHostToDevice));
    layout.q = q;
    layout.q_row_stride = int64_t(heads_q) * head_dim;
    layout.q_head_stride = head_dim;
    layout.k_cache = k_cache;
    layout.v_cache = v_cache;
    layout.k_page_stride = layout.v_page_stride = int64_t(page_size) * heads_kv * head_dim;
    layout.k_row_stride = layout.v_row_stride = int64_t(heads_kv) * head_dim;
    layout.k_head_stride = layout.v_head_stride = head_dim;
    layout.page_table = page_table;
    layout.page_table_stride = pages;
    layout.cu_seqlens_q = cu_seqlens_q;
    layout.seqused_k = seqused_k;
    layout.batch = 1;
    layout.num_heads_q = heads_q;
    layout.num_heads_kv = heads_kv;
    layout.head_dim = head_dim;
    layout.page_size = page_size;
    layout.num_pages = pages;
    layout.max_pages_per_seq = pages;
    layout.total_q = layout.max_seqlen_q = layout.max_seqlen_k = tokens;
    layout.num_q_blocks = layout.max_k_blocks = tokens / cosa::kBlockSize;
    layout.dtype = cosa::DType::kBFloat16;
    layout.softmax_scale = 1.0f / std::sqrt(float(head_dim));
  }
  ~OneSequence() {
    for (void* p : {(void*)page_table, (void*)cu_seqlens_q, (void*)seqused_k}) CUDA_CHECK(cudaFree(p));
  }
  OneSequence(const OneSequence&) = delete;
  OneSequence& operator=(const OneSequence&) = delete;
};

inline float median(std::vector<float> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// Times run(v) for every variant v: warm-up calls alternating over the variants, then `rounds`
// interleaved rounds of kTimed CUDA-event timings each, so that clock drift reaches every variant
// alike. Round r starts at variant r % num_variants, so that each variant follows every other one
// equally often: the GPU's clock and temperature after a long or a short kernel otherwise favour
// whichever variant runs next. A variant's ratio is the median over the rounds of its time over the
// baseline's time in the same round (paired, so that drift between rounds cancels), with the
// quartiles of those per-round ratios beside it. Prints one "ROW" line per variant for
// dev/kernel_ab.py and the case's table line; `mismatches[v]` counts the output elements where
// variant v differs from variant 0.
template <class Run>
void time_and_report(const char* case_name, const std::vector<const char*>& labels, int rounds,
                     cudaStream_t stream, const std::vector<long long>& mismatches, Run run) {
  constexpr int kTimed = 15, kWarmup = 10;
  const int num_variants = static_cast<int>(labels.size());
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  for (int w = 0; w < kWarmup; ++w) run(w % num_variants);
  std::vector<std::vector<float>> round_ms(num_variants, std::vector<float>(rounds));
  for (int r = 0; r < rounds; ++r) {
    for (int i = 0; i < num_variants; ++i) {
      const int v = (r + i) % num_variants;
      std::vector<float> times;
      for (int t = 0; t < kTimed; ++t) {
        CUDA_CHECK(cudaEventRecord(start, stream));
        run(v);
        CUDA_CHECK(cudaEventRecord(stop, stream));
        CUDA_CHECK(cudaEventSynchronize(stop));
        float ms = 0.f;
        CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
        times.push_back(ms);
      }
      round_ms[v][r] = median(times);
    }
  }
  struct Ratio {
    float median, q1, q3;
  };
  std::vector<Ratio> ratios(num_variants);
  for (int v = 0; v < num_variants; ++v) {
    std::vector<float> paired(rounds);
    for (int r = 0; r < rounds; ++r) paired[r] = round_ms[v][r] / round_ms[0][r];
    std::sort(paired.begin(), paired.end());
    ratios[v] = {median(paired), paired[(rounds - 1) / 4], paired[rounds - 1 - (rounds - 1) / 4]};
  }
  for (int v = 0; v < num_variants; ++v) {
    std::printf("ROW case=%s variant=%s ms=%.4f ratio=%.4f q1=%.4f q3=%.4f mismatches=%lld rounds=", case_name,
                labels[v], median(round_ms[v]), ratios[v].median, ratios[v].q1, ratios[v].q3, mismatches[v]);
    for (int r = 0; r < rounds; ++r) std::printf("%s%.4f", r ? "," : "", round_ms[v][r]);
    std::printf("\n");
  }
  std::printf("%-18s", case_name);
  for (int v = 0; v < num_variants; ++v) {
    if (v == 0) {
      std::printf(" %9.3f %5.3f%s", median(round_ms[v]), 1.f, mismatches[v] ? "!" : " ");
    } else {
      std::printf(" %9.3f %5.3f%s [%5.3f %5.3f]", median(round_ms[v]), ratios[v].median,
                  mismatches[v] ? "!" : " ", ratios[v].q1, ratios[v].q3);
    }
  }
  const auto bounds = std::minmax_element(round_ms[0].begin(), round_ms[0].end());
  std::printf("   spread %.3f\n", *bounds.second / *bounds.first);
  std::fflush(stdout);
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
}

// The table's last line.
inline void print_footer(const char* baseline) {
  std::printf("a ratio marked ! is that of a tree whose output differs from %s's (expected only for "
              "ablations that change the arithmetic)\n",
              baseline);
}
