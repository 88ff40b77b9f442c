// OSK side by side: the hdim-128 bf16 OSK of several source trees (bench/osk_ab.py builds each under its
// own namespace, variant_entry.cu) run on the same inputs in one process. Inputs: one sequence, 32
// query heads, 8 KV heads, random normal bf16 Q/K/V, pages shuffled; lists ascending with block 0 and
// the diagonal block forced. Every variant's output (NaN-poisoned before the first run) is compared
// element by element with the first variant's; times are medians of CUDA-event timings, repeated in
// interleaved rounds so that clock drift reaches every variant alike. Torch-free.
//
//   osk_ab_harness ROUNDS [CASE_FILTER]
//
// Prints one "ROW" line per (case, variant) for bench/osk_ab.py, and a table.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
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

using RunOsk = cudaError_t (*)(const void*, cudaStream_t);
// OSK_AB_VARIANTS(X) expands X(label) once per built tree; each tree defines run_osk_<label>.
#define OSK_AB_DECLARE(label) cudaError_t run_osk_##label(const void*, cudaStream_t);
OSK_AB_VARIANTS(OSK_AB_DECLARE)
#define OSK_AB_ENTRY(label) {#label, run_osk_##label},
struct Variant {
  const char* label;
  RunOsk run;
};
static const Variant kVariants[] = {OSK_AB_VARIANTS(OSK_AB_ENTRY)};
static const int kNumVariants = sizeof(kVariants) / sizeof(kVariants[0]);

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

// A sink at key 0: every query gains 1 in each channel and key 0 holds 8 in each, so its logit
// (about 8 * 128 / sqrt(128) = 90 in softmax units) lies far above the others' (a few units): with
// the skip at delta 2000 every listed block after block 0 is skipped, the cost of a skipped block.
__global__ void plant_sink(__nv_bfloat16* q, size_t q_elems, __nv_bfloat16* key0, int key0_elems) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < q_elems; i += size_t(gridDim.x) * blockDim.x) {
    q[i] = __float2bfloat16(__bfloat162float(q[i]) + 1.f);
    if (i < size_t(key0_elems)) key0[i] = __float2bfloat16(8.f);
  }
}

struct Case {
  const char* name;
  int tokens;
  int page_size;
  double budget;  // share of the non-forced causal blocks listed (1: every causal block)
  float delta;    // > 0: the kernel with the skip; 1e-30 skips nothing
  bool sink;      // plant_sink: with the skip on, every block after block 0 is skipped
};

static const Case kCases[] = {
    {"dense-16K", 16384, 128, 1.0, 0.f},      {"dense-32K", 32768, 128, 1.0, 0.f},
    {"random-50%-16K", 16384, 128, 0.5, 0.f}, {"random-25%-16K", 16384, 128, 0.25, 0.f},
    {"random-25%-32K", 32768, 128, 0.25, 0.f}, {"dense-page16-16K", 16384, 16, 1.0, 0.f},
    {"skip-none-16K", 16384, 128, 1.0, 1e-30f}, {"skip-all-16K", 16384, 128, 1.0, 2000.f, true},
};

static float median(std::vector<float> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 3;
  const char* case_filter = argc > 2 ? argv[2] : "";
  constexpr int kHeadsQ = 32, kHeadsKV = 8, kHeadDim = 128, kTimed = 15, kWarmup = 10;
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  std::mt19937 rng(1234);

  std::printf("%-18s", "case");
  for (const Variant& v : kVariants) std::printf(" %20s", v.label);
  std::printf("   (median ms and ratio to %s; spread = slowest / fastest round of %s)\n",
              kVariants[0].label, kVariants[0].label);
  for (const Case& c : kCases) {
    if (std::strstr(c.name, case_filter) == nullptr) continue;
    const int n = c.tokens, blocks = n / cosa::kBlockSize, pages = n / c.page_size;
    const size_t q_elems = size_t(n) * kHeadsQ * kHeadDim, kv_elems = size_t(n) * kHeadsKV * kHeadDim;
    __nv_bfloat16 *q, *k_cache, *v_cache, *out;
    CUDA_CHECK(cudaMalloc(&q, q_elems * 2));
    CUDA_CHECK(cudaMalloc(&k_cache, kv_elems * 2));
    CUDA_CHECK(cudaMalloc(&v_cache, kv_elems * 2));
    CUDA_CHECK(cudaMalloc(&out, q_elems * 2));
    fill_normal<<<1024, 256, 0, stream>>>(q, q_elems, 1);
    fill_normal<<<1024, 256, 0, stream>>>(k_cache, kv_elems, 2);
    fill_normal<<<1024, 256, 0, stream>>>(v_cache, kv_elems, 3);
    CUDA_CHECK(cudaGetLastError());

    std::vector<int> page_ids(pages);
    for (int i = 0; i < pages; ++i) page_ids[i] = i;
    std::shuffle(page_ids.begin(), page_ids.end(), rng);
    if (c.sink) {  // key 0 sits in row 0 of the first page of the sequence
      plant_sink<<<1024, 256, 0, stream>>>(q, q_elems, k_cache + size_t(page_ids[0]) * c.page_size * kHeadsKV * kHeadDim,
                                           kHeadsKV * kHeadDim);
      CUDA_CHECK(cudaGetLastError());
    }
    std::vector<int> order(size_t(kHeadsQ) * blocks * blocks, -1), counts(size_t(kHeadsQ) * blocks);
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    for (int h = 0; h < kHeadsQ; ++h) {
      for (int i = 0; i < blocks; ++i) {
        int* row = &order[(size_t(h) * blocks + i) * blocks];
        int count = 0;
        for (int j = 0; j <= i; ++j) {
          if (c.budget >= 1.0 || j == 0 || j == i || uniform(rng) < c.budget) row[count++] = j;
        }
        counts[size_t(h) * blocks + i] = count;
      }
    }
    int *page_table, *d_order, *d_counts, *skipped, *cu_seqlens_q, *seqused_k;
    float* lse;
    const int cu[2] = {0, n};
    CUDA_CHECK(cudaMalloc(&page_table, pages * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&d_order, order.size() * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&d_counts, counts.size() * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&skipped, counts.size() * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&lse, size_t(kHeadsQ) * n * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&cu_seqlens_q, sizeof(cu)));
    CUDA_CHECK(cudaMalloc(&seqused_k, sizeof(int)));
    CUDA_CHECK(cudaMemcpy(page_table, page_ids.data(), pages * sizeof(int), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_order, order.data(), order.size() * sizeof(int), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_counts, counts.data(), counts.size() * sizeof(int), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(cu_seqlens_q, cu, sizeof(cu), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(seqused_k, &n, sizeof(int), cudaMemcpyHostToDevice));

    cosa::OskParams params;
    cosa::PagedLayout& layout = params.layout;
    layout.q = q;
    layout.q_row_stride = kHeadsQ * kHeadDim;
    layout.q_head_stride = kHeadDim;
    layout.k_cache = k_cache;
    layout.v_cache = v_cache;
    layout.k_page_stride = layout.v_page_stride = int64_t(c.page_size) * kHeadsKV * kHeadDim;
    layout.k_row_stride = layout.v_row_stride = kHeadsKV * kHeadDim;
    layout.k_head_stride = layout.v_head_stride = kHeadDim;
    layout.page_table = page_table;
    layout.page_table_stride = pages;
    layout.cu_seqlens_q = cu_seqlens_q;
    layout.seqused_k = seqused_k;
    layout.batch = 1;
    layout.num_heads_q = kHeadsQ;
    layout.num_heads_kv = kHeadsKV;
    layout.head_dim = kHeadDim;
    layout.page_size = c.page_size;
    layout.num_pages = pages;
    layout.max_pages_per_seq = pages;
    layout.total_q = layout.max_seqlen_q = layout.max_seqlen_k = n;
    layout.num_q_blocks = layout.max_k_blocks = blocks;
    layout.dtype = cosa::DType::kBFloat16;
    layout.softmax_scale = 1.0f / std::sqrt(float(kHeadDim));
    params.order = d_order;
    params.counts = d_counts;
    params.delta = c.delta;
    params.vote = cosa::VoteScope::kWarpgroup;
    params.out = out;
    params.out_row_stride = kHeadsQ * kHeadDim;
    params.out_head_stride = kHeadDim;
    params.lse = lse;
    params.skipped = skipped;

    // Output check: each variant's first output against the first variant's, element by element.
    std::vector<long long> mismatches(kNumVariants, 0);
    std::vector<uint16_t> reference(q_elems), candidate(q_elems);
    for (int v = 0; v < kNumVariants; ++v) {
      CUDA_CHECK(cudaMemsetAsync(out, 0xff, q_elems * 2, stream));
      CUDA_CHECK(kVariants[v].run(&params, stream));
      CUDA_CHECK(cudaStreamSynchronize(stream));
      CUDA_CHECK(cudaGetLastError());
      CUDA_CHECK(cudaMemcpy((v == 0 ? reference : candidate).data(), out, q_elems * 2, cudaMemcpyDeviceToHost));
      if (c.sink) {  // skipped counts 64-row halves: each list could skip 2 * (count - 1)
        std::vector<int> skipped_host(counts.size());
        CUDA_CHECK(cudaMemcpy(skipped_host.data(), skipped, counts.size() * sizeof(int), cudaMemcpyDeviceToHost));
        long long done = 0, possible = 0;
        for (size_t i = 0; i < counts.size(); ++i) { done += skipped_host[i]; possible += 2 * (counts[i] - 1); }
        std::printf("%s, %s: %.1f%% of the blocks after block 0 skipped\n", c.name, kVariants[v].label,
                    100.0 * done / std::max(possible, 1LL));
      }
      if (v == 0) continue;
      for (size_t i = 0; i < q_elems; ++i) mismatches[v] += reference[i] != candidate[i];
    }
    for (int w = 0; w < kWarmup; ++w) CUDA_CHECK(kVariants[w % kNumVariants].run(&params, stream));
    std::vector<std::vector<float>> round_ms(kNumVariants);
    for (int r = 0; r < rounds; ++r) {
      for (int v = 0; v < kNumVariants; ++v) {
        std::vector<float> times;
        for (int t = 0; t < kTimed; ++t) {
          CUDA_CHECK(cudaEventRecord(start, stream));
          CUDA_CHECK(kVariants[v].run(&params, stream));
          CUDA_CHECK(cudaEventRecord(stop, stream));
          CUDA_CHECK(cudaEventSynchronize(stop));
          float ms = 0.f;
          CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
          times.push_back(ms);
        }
        round_ms[v].push_back(median(times));
      }
    }
    const float base = median(round_ms[0]);
    for (int v = 0; v < kNumVariants; ++v) {
      std::printf("ROW case=%s variant=%s ms=%.4f ratio=%.4f mismatches=%lld rounds=", c.name,
                  kVariants[v].label, median(round_ms[v]), median(round_ms[v]) / base, mismatches[v]);
      for (int r = 0; r < rounds; ++r) std::printf("%s%.4f", r ? "," : "", round_ms[v][r]);
      std::printf("\n");
    }
    std::printf("%-18s", c.name);
    for (int v = 0; v < kNumVariants; ++v) {
      std::printf(" %9.3f %5.3f%s", median(round_ms[v]), median(round_ms[v]) / base, mismatches[v] ? "!" : " ");
    }
    const auto bounds = std::minmax_element(round_ms[0].begin(), round_ms[0].end());
    std::printf("   spread %.3f\n", *bounds.second / *bounds.first);
    std::fflush(stdout);
    for (void* p : {(void*)q, (void*)k_cache, (void*)v_cache, (void*)out, (void*)(void*)page_table,
                    (void*)d_order, (void*)d_counts, (void*)skipped, (void*)lse, (void*)cu_seqlens_q, (void*)seqused_k}) {
      CUDA_CHECK(cudaFree(p));
    }
  }
  std::printf("a ratio marked ! is that of a tree whose output differs from %s's (expected only for "
              "ablations that change the arithmetic)\n",
              kVariants[0].label);
  return 0;
}
