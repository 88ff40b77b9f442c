// OSK side by side: the hdim-128 bf16 OSK of several source trees (dev/kernel_ab.py builds each under
// its own namespace, variant_entry.cu) run on the same inputs in one process. Inputs: one sequence, 32
// query heads and 8 KV heads unless a case says otherwise, random normal bf16 Q/K/V, pages shuffled;
// lists ascending with block 0 and the diagonal block forced. Every variant's output (NaN-poisoned before the first run) is compared
// element by element with the first variant's; times are medians of CUDA-event timings, repeated in
// interleaved rounds so that clock drift reaches every variant alike. Torch-free.
//
//   osk_ab_harness ROUNDS [CASE_FILTER [INPUTS]]
//
// INPUTS: captured layers of a real model (bench/layers.py --save-ab-inputs; its docstring gives the
// format): each layer adds three cases on its own Q/K/V and KAP's lists, with the skip off, on at
// delta 2000, and on with nothing skipped.
//
// Prints one "ROW" line per (case, variant) for dev/kernel_ab.py, and a table.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "ab_common.cuh"
#include "cosa_params.h"

using RunOsk = cudaError_t (*)(const void*, cudaStream_t);
// AB_VARIANTS(X) expands X(label) once per built tree; each tree defines run_osk_<label>.
#define OSK_AB_DECLARE(label) cudaError_t run_osk_##label(const void*, cudaStream_t);
AB_VARIANTS(OSK_AB_DECLARE)
#define OSK_AB_ENTRY(label) {#label, run_osk_##label},
struct Variant {
  const char* label;
  RunOsk run;
};
static const Variant kVariants[] = {AB_VARIANTS(OSK_AB_ENTRY)};
static const int kNumVariants = sizeof(kVariants) / sizeof(kVariants[0]);

// A sink at key 0: every query gains 1 in each channel and key 0 holds 8 in each, so its logit
// (about 8 * 128 / sqrt(128) = 90 in softmax units) lies far above the others' (a few units): with
// the skip at delta 2000 every listed block after block 0 is skipped, the cost of a skipped block.
__global__ void plant_sink(__nv_bfloat16* q, size_t q_elems, __nv_bfloat16* key0, int key0_elems) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < q_elems; i += size_t(gridDim.x) * blockDim.x) {
    q[i] = __float2bfloat16(__bfloat162float(q[i]) + 1.f);
    if (i < size_t(key0_elems)) key0[i] = __float2bfloat16(8.f);
  }
}

// Low key blocks: every query gains 1 in each channel and every key of a low block loses 8 in each,
// so that a low block's logits lie about 90 softmax units below the others': with the skip on, the
// low blocks are skipped and the others computed. `low_pages` lists the cache pages of the low
// blocks (page size 128: one page a block).
__global__ void plant_low_blocks(__nv_bfloat16* q, size_t q_elems, __nv_bfloat16* k_cache, const int* low_pages,
                                 int num_low, int page_elems) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < q_elems; i += stride) {
    q[i] = __float2bfloat16(__bfloat162float(q[i]) + 1.f);
  }
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(num_low) * page_elems; i += stride) {
    __nv_bfloat16* key = k_cache + size_t(low_pages[i / page_elems]) * page_elems + i % page_elems;
    *key = __float2bfloat16(__bfloat162float(*key) - 8.f);
  }
}

struct Case {
  const char* name;
  int tokens;
  int page_size;
  double budget;  // share of the non-forced causal blocks listed (1: every causal block)
  float delta;    // > 0: the kernel with the skip; 1e-30 skips nothing
  bool sink = false;  // plant_sink: with the skip on, every block after block 0 is skipped
  // plant_low_blocks on key blocks drawn as a two-state chain along the keys (block 0 not low): a
  // block after a computed one is low with probability 0.15, after a low one with 0.62, about as
  // the reference's skip decisions fall along KAP's lists of Qwen2.5-Coder-1.5B's layers 1, 11, 19
  // and 27 at 8K tokens (0.12-0.17 and 0.58-0.70; its first layer 0.31 and 0.58; at 32K tokens
  // 0.05-0.12 and 0.36-0.70). So about 28% of the blocks are skipped, two in five of them right
  // after a computed block.
  bool scattered = false;
  int heads_q = 32;
  int heads_kv = 8;
};

static const Case kCases[] = {
    {"dense-16K", 16384, 128, 1.0, 0.f},      {"dense-32K", 32768, 128, 1.0, 0.f},
    {"random-50%-16K", 16384, 128, 0.5, 0.f}, {"random-25%-16K", 16384, 128, 0.25, 0.f},
    {"random-25%-32K", 32768, 128, 0.25, 0.f}, {"dense-page16-16K", 16384, 16, 1.0, 0.f},
    {"skip-none-16K", 16384, 128, 1.0, 1e-30f}, {"skip-all-16K", 16384, 128, 1.0, 2000.f, true},
    // Block 0 and the diagonal alone: what a tile costs beyond its blocks.
    {"sink-diagonal-16K", 16384, 128, 0.0, 0.f},
    // Skipped blocks scattered along the lists (plant_low_blocks), synthetic.
    {"skip-scattered-16K", 16384, 128, 1.0, 2000.f, false, true},
    // The head shape of Qwen2.5-Coder-1.5B (12 query heads, 2 KV heads) on lists of the size KAP
    // gives its layers at 32K, with the skip off and with it on but skipping nothing: the skip's tax
    // at that shape is the second case's time over the first's.
    {"model-heads-37%-32K", 32768, 128, 0.37, 0.f, false, false, 12, 2},
    {"model-heads-37%-skip-none-32K", 32768, 128, 0.37, 1e-30f, false, false, 12, 2},
};

// Runs every variant once on `params` (output NaN-poisoned first) and counts the output elements where
// each differs from the first variant; with `report_skips`, prints the share of the blocks after
// each list's first that the variant skipped (skipped counts 64-row halves: a list could skip
// 2 * (count - 1)). Then times the variants (time_and_report).
static void check_and_time(const char* name, const cosa::OskParams& params, size_t q_elems, const int* skipped,
                           const std::vector<int>& counts, bool report_skips, const Harness& harness) {
  std::vector<long long> mismatches(kNumVariants, 0);
  std::vector<uint16_t> reference(q_elems), candidate(q_elems);
  for (int v = 0; v < kNumVariants; ++v) {
    CUDA_CHECK(cudaMemsetAsync(params.out, 0xff, q_elems * 2, harness.stream));
    CUDA_CHECK(kVariants[v].run(&params, harness.stream));
    CUDA_CHECK(cudaStreamSynchronize(harness.stream));
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaMemcpy((v == 0 ? reference : candidate).data(), params.out, q_elems * 2, cudaMemcpyDeviceToHost));
    if (report_skips) {
      std::vector<int> skipped_host(counts.size());
      CUDA_CHECK(cudaMemcpy(skipped_host.data(), skipped, counts.size() * sizeof(int), cudaMemcpyDeviceToHost));
      long long done = 0, possible = 0;
      for (size_t i = 0; i < counts.size(); ++i) { done += skipped_host[i]; possible += 2 * std::max(counts[i] - 1, 0); }
      std::printf("%s, %s: %.1f%% of the blocks after each list's first skipped\n", name, kVariants[v].label,
                  100.0 * done / std::max(possible, 1LL));
    }
    if (v == 0) continue;
    for (size_t i = 0; i < q_elems; ++i) mismatches[v] += reference[i] != candidate[i];
  }
  time_and_report(name, harness.labels, harness.rounds, harness.stream, mismatches,
                  [&](int v) { CUDA_CHECK(kVariants[v].run(&params, harness.stream)); });
}

// One captured layer of bench/layers.py --save-ab-inputs, on the host.
struct RealLayer {
  int layer = 0;
  float softmax_scale = 0.f;
  std::vector<uint16_t> q, k, v;  // bf16 [n, heads, d]
  std::vector<int> order, counts;  // KAP's lists: [heads_q, n / 128, n / 128], [heads_q, n / 128]
};

struct RealInputs {
  int tokens = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  std::vector<RealLayer> layers;
};

template <class T>
static void read_exactly(std::FILE* f, T* data, size_t count, const char* path) {
  if (std::fread(data, sizeof(T), count, f) != count) {
    std::fprintf(stderr, "%s: truncated\n", path);
    std::exit(2);
  }
}

static RealInputs read_real_inputs(const char* path) {
  std::FILE* f = std::fopen(path, "rb");
  if (f == nullptr) {
    std::fprintf(stderr, "%s: cannot open\n", path);
    std::exit(2);
  }
  char magic[8];
  read_exactly(f, magic, 8, path);
  if (std::memcmp(magic, "COSAOSK1", 8) != 0) {
    std::fprintf(stderr, "%s: not a file of bench/layers.py --save-ab-inputs\n", path);
    std::exit(2);
  }
  int32_t header[5];  // tokens, heads_q, heads_kv, head_dim, layers
  read_exactly(f, header, 5, path);
  RealInputs in;
  in.tokens = header[0], in.heads_q = header[1], in.heads_kv = header[2], in.head_dim = header[3];
  if (in.head_dim != 128 || in.tokens % cosa::kBlockSize != 0) {
    std::fprintf(stderr, "%s: head dim %d and %d tokens; the harness runs d 128 on whole blocks\n", path,
                 in.head_dim, in.tokens);
    std::exit(2);
  }
  const size_t blocks = size_t(in.tokens) / cosa::kBlockSize;
  for (int l = 0; l < header[4]; ++l) {
    RealLayer layer;
    int32_t index;
    read_exactly(f, &index, 1, path);
    read_exactly(f, &layer.softmax_scale, 1, path);
    layer.layer = index;
    layer.q.resize(size_t(in.tokens) * in.heads_q * in.head_dim);
    layer.k.resize(size_t(in.tokens) * in.heads_kv * in.head_dim);
    layer.v.resize(layer.k.size());
    layer.order.resize(size_t(in.heads_q) * blocks * blocks);
    layer.counts.resize(size_t(in.heads_q) * blocks);
    read_exactly(f, layer.q.data(), layer.q.size(), path);
    read_exactly(f, layer.k.data(), layer.k.size(), path);
    read_exactly(f, layer.v.data(), layer.v.size(), path);
    read_exactly(f, layer.order.data(), layer.order.size(), path);
    read_exactly(f, layer.counts.data(), layer.counts.size(), path);
    in.layers.push_back(std::move(layer));
  }
  std::fclose(f);
  return in;
}

// Each captured layer with the skip off, on at delta 2000 (the default), and on with nothing
// skipped, on the layer's own Q/K/V (pages shuffled, 128 tokens a page) and KAP's lists.
static void run_real_cases(const RealInputs& in, const Harness& harness) {
  const size_t q_elems = size_t(in.tokens) * in.heads_q * in.head_dim;
  const size_t kv_elems = size_t(in.tokens) * in.heads_kv * in.head_dim;
  const size_t page_elems = size_t(cosa::kBlockSize) * in.heads_kv * in.head_dim;
  std::mt19937 rng(99);
  for (const RealLayer& layer : in.layers) {
    const struct { const char* suffix; float delta; } kDeltas[] = {{"-skip-off", 0.f}, {"", 2000.f},
                                                                    {"-skip-none", 1e-30f}};
    bool any = false;
    char names[3][48];
    for (int d = 0; d < 3; ++d) {
      std::snprintf(names[d], sizeof(names[d]), "real-L%d%s-%dK", layer.layer, kDeltas[d].suffix, in.tokens / 1024);
      any |= harness.selects(names[d]);
    }
    if (!any) continue;
    __nv_bfloat16 *q, *k_cache, *v_cache, *out;
    int *d_order, *d_counts, *skipped;
    float* lse;
    CUDA_CHECK(cudaMalloc(&q, q_elems * 2));
    CUDA_CHECK(cudaMalloc(&k_cache, kv_elems * 2));
    CUDA_CHECK(cudaMalloc(&v_cache, kv_elems * 2));
    CUDA_CHECK(cudaMalloc(&out, q_elems * 2));
    CUDA_CHECK(cudaMalloc(&d_order, layer.order.size() * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&d_counts, layer.counts.size() * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&skipped, layer.counts.size() * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&lse, size_t(in.heads_q) * in.tokens * sizeof(float)));
    const OneSequence sequence(in.tokens, in.heads_q, in.heads_kv, in.head_dim, cosa::kBlockSize, q, k_cache, v_cache,
                               rng);
    CUDA_CHECK(cudaMemcpy(q, layer.q.data(), q_elems * 2, cudaMemcpyHostToDevice));
    for (size_t p = 0; p < sequence.page_ids.size(); ++p) {  // token block p into page page_ids[p]
      const size_t to = size_t(sequence.page_ids[p]) * page_elems, from = p * page_elems;
      CUDA_CHECK(cudaMemcpy(k_cache + to, layer.k.data() + from, page_elems * 2, cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaMemcpy(v_cache + to, layer.v.data() + from, page_elems * 2, cudaMemcpyHostToDevice));
    }
    CUDA_CHECK(cudaMemcpy(d_order, layer.order.data(), layer.order.size() * sizeof(int), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_counts, layer.counts.data(), layer.counts.size() * sizeof(int), cudaMemcpyHostToDevice));
    cosa::OskParams params;
    params.layout = sequence.layout;
    params.layout.softmax_scale = layer.softmax_scale;
    params.order = d_order;
    params.counts = d_counts;
    params.vote = cosa::VoteScope::kWarpgroup;
    params.out = out;
    params.out_row_stride = in.heads_q * in.head_dim;
    params.out_head_stride = in.head_dim;
    params.lse = lse;
    params.skipped = skipped;
    for (int d = 0; d < 3; ++d) {
      if (!harness.selects(names[d])) continue;
      params.delta = kDeltas[d].delta;
      check_and_time(names[d], params, q_elems, skipped, layer.counts, kDeltas[d].delta >= 1.f, harness);
    }
    for (void* p : {(void*)q, (void*)k_cache, (void*)v_cache, (void*)out, (void*)d_order, (void*)d_counts,
                    (void*)skipped, (void*)lse}) {
      CUDA_CHECK(cudaFree(p));
    }
  }
}

int main(int argc, char** argv) {
  constexpr int kHeadDim = 128;
  Harness harness(argc, argv, kVariants);
  const cudaStream_t stream = harness.stream;
  std::mt19937& rng = harness.rng;
  // Read first, so that a bad file fails the run before anything is timed.
  const RealInputs real_inputs = argc > 3 ? read_real_inputs(argv[3]) : RealInputs{};
  for (const Case& c : kCases) {
    if (!harness.selects(c.name)) continue;
    const int n = c.tokens, blocks = n / cosa::kBlockSize, heads_q = c.heads_q, heads_kv = c.heads_kv;
    const size_t q_elems = size_t(n) * heads_q * kHeadDim, kv_elems = size_t(n) * heads_kv * kHeadDim;
    __nv_bfloat16 *q, *k_cache, *v_cache, *out;
    CUDA_CHECK(cudaMalloc(&q, q_elems * 2));
    CUDA_CHECK(cudaMalloc(&k_cache, kv_elems * 2));
    CUDA_CHECK(cudaMalloc(&v_cache, kv_elems * 2));
    CUDA_CHECK(cudaMalloc(&out, q_elems * 2));
    fill_normal<<<1024, 256, 0, stream>>>(q, q_elems, 1);
    fill_normal<<<1024, 256, 0, stream>>>(k_cache, kv_elems, 2);
    fill_normal<<<1024, 256, 0, stream>>>(v_cache, kv_elems, 3);
    CUDA_CHECK(cudaGetLastError());
    const OneSequence sequence(n, heads_q, heads_kv, kHeadDim, c.page_size, q, k_cache, v_cache, rng);
    if (c.sink) {  // key 0 sits in row 0 of the first page of the sequence
      plant_sink<<<1024, 256, 0, stream>>>(q, q_elems,
                                           k_cache + size_t(sequence.page_ids[0]) * c.page_size * heads_kv * kHeadDim,
                                           heads_kv * kHeadDim);
      CUDA_CHECK(cudaGetLastError());
    }
    if (c.scattered) {
      std::vector<int> low_pages;
      bool low = false;
      std::uniform_real_distribution<double> chain(0.0, 1.0);
      for (int j = 1; j < blocks; ++j) {
        low = chain(rng) < (low ? 0.62 : 0.15);
        if (low) low_pages.push_back(sequence.page_ids[j]);
      }
      int* d_low_pages;
      CUDA_CHECK(cudaMalloc(&d_low_pages, low_pages.size() * sizeof(int)));
      CUDA_CHECK(cudaMemcpy(d_low_pages, low_pages.data(), low_pages.size() * sizeof(int), cudaMemcpyHostToDevice));
      plant_low_blocks<<<1024, 256, 0, stream>>>(q, q_elems, k_cache, d_low_pages, int(low_pages.size()),
                                                 c.page_size * heads_kv * kHeadDim);
      CUDA_CHECK(cudaGetLastError());
      CUDA_CHECK(cudaStreamSynchronize(stream));
      CUDA_CHECK(cudaFree(d_low_pages));
    }
    std::vector<int> order(size_t(heads_q) * blocks * blocks, -1), counts(size_t(heads_q) * blocks);
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    for (int h = 0; h < heads_q; ++h) {
      for (int i = 0; i < blocks; ++i) {
        int* row = &order[(size_t(h) * blocks + i) * blocks];
        int count = 0;
        for (int j = 0; j <= i; ++j) {
          if (c.budget >= 1.0 || j == 0 || j == i || uniform(rng) < c.budget) row[count++] = j;
        }
        counts[size_t(h) * blocks + i] = count;
      }
    }
    int *d_order, *d_counts, *skipped;
    float* lse;
    CUDA_CHECK(cudaMalloc(&d_order, order.size() * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&d_counts, counts.size() * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&skipped, counts.size() * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&lse, size_t(heads_q) * n * sizeof(float)));
    CUDA_CHECK(cudaMemcpy(d_order, order.data(), order.size() * sizeof(int), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_counts, counts.data(), counts.size() * sizeof(int), cudaMemcpyHostToDevice));

    cosa::OskParams params;
    params.layout = sequence.layout;
    params.order = d_order;
    params.counts = d_counts;
    params.delta = c.delta;
    params.vote = cosa::VoteScope::kWarpgroup;
    params.out = out;
    params.out_row_stride = heads_q * kHeadDim;
    params.out_head_stride = kHeadDim;
    params.lse = lse;
    params.skipped = skipped;

    check_and_time(c.name, params, q_elems, skipped, counts, c.sink || c.scattered, harness);
    for (void* p : {(void*)q, (void*)k_cache, (void*)v_cache, (void*)out, (void*)d_order, (void*)d_counts,
                    (void*)skipped, (void*)lse}) {
      CUDA_CHECK(cudaFree(p));
    }
  }
  if (argc > 3) run_real_cases(real_inputs, harness);
  print_footer(kVariants[0].label);
  return 0;
}
