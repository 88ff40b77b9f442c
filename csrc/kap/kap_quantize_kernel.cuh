// The e4m3 proxy's quantisation pass (spec section 2, proxy precision), two kernels. The range
// kernel folds each key channel's finite maximum and minimum over a sample of a sequence's keys
// (every COSA_KEY_CENTRE_STRIDE-th) into the workspace (per KV head); the quantise kernel centres
// the keys on the midpoint of that range, then per 128-token block and head takes amax = max |x|
// over the block's tokens (NaN if any is NaN), scale = amax / 448 (1 for an all-zero block), and
// e4m3(x * (448 / amax)) rounded to nearest even with saturation, written to the workspace for the
// scoring kernel. Queries are blocked from the first query of each sequence, keys from token 0;
// every step is one IEEE float32 operation (no fast-math division, no contraction) so that
// cosa.reference can reproduce every byte.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/input_gate.cuh"
#include "common/query_blocks.cuh"
#include "kap/kap_traits.h"

namespace cosa::kap {

constexpr int kQuantizeThreads = 256;
constexpr float kE4M3Max = 448.f;

template <class Element>
__device__ __forceinline__ float2 to_float2(const Element* pair);
template <>
__device__ __forceinline__ float2 to_float2<__nv_bfloat16>(const __nv_bfloat16* pair) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(pair));
}
template <>
__device__ __forceinline__ float2 to_float2<__half>(const __half* pair) {
  return __half22float2(*reinterpret_cast<const __half2*>(pair));
}

constexpr int kRangeThreads = 128;
constexpr int kCentreStride = COSA_KEY_CENTRE_STRIDE;  // the centre's sample: every this-many-th key
constexpr int kRangeKeysPerCta = 128;                   // sampled keys one key-range CTA folds

// Key-range CTAs per sequence and KV head (grid x = batch times this times Hkv): the one mapping
// that the launch and the kernel share.
__host__ __device__ __forceinline__ int range_ctas_per_seq(int max_k_blocks) {
  constexpr int kTokensPerCta = kRangeKeysPerCta * kCentreStride;
  return (max_k_blocks * kBlockSize + kTokensPerCta - 1) / kTokensPerCta;
}

// The range that centres the keys (spec section 2): per sequence, KV head and channel, the finite
// maximum and minimum over the sequence's keys 0, kCentreStride, 2 * kCentreStride, ... Any centre
// moves all proxy logits of a query row alike, so a sample serves as well as every key, and reads
// one kCentreStride-th of the bytes (the pass over every key took 0.023 of KAP's 0.71 ms at 32K
// tokens and 8 KV heads on an H200, the sample 0.008). Atomics on one word serialise: at 1M tokens
// a word takes 1024 of them, as many as a pass with a CTA per key block once gave each word at 32K
// (0.23 ms), against KAP's 0.7 s there. Grid: x over (sequence, group of kRangeKeysPerCta sampled
// keys, KV head), the head fastest, so that the CTAs in flight together read whole token rows of
// the pages. Each thread owns one 16-byte chunk (8 channels) of every (128 / chunks per row)-th
// sampled key, and issues all of its loads before folding any (one memory latency per CTA). Finite
// values fold into per-channel maxima and minima (NaN and infinities skipped), the warps' through
// shared memory; then one thread per channel adds the CTA's range to the sequence's words as atomic
// maxima of order-preserving bits, so that the range does not depend on the order of the CTAs (the
// index kernel zeroed the words, and 0 lies below every float's bits).
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(kRangeThreads)
    kap_key_range_kernel(const KapDeviceArgs args) {
  cudaGridDependencySynchronize();  // the zeroed words; the caches may come from the kernel before
  cudaTriggerProgrammaticLaunchCompletion();
  if (inputs_rejected(args.layout)) return;
  constexpr int kChunks = kHeadDim / 8;                  // 16-byte chunks of a key row
  constexpr int kKeysPerPass = kRangeThreads / kChunks;  // sampled keys the CTA reads at once
  constexpr int kPasses = kRangeKeysPerCta / kKeysPerPass;
  constexpr int kWarps = kRangeThreads / 32;
  static_assert(32 % kChunks == 0, "a warp holds whole rows");
  static_assert(kHeadDim <= kRangeThreads, "one thread per channel folds the warps");
  const PagedLayout& L = args.layout;
  const int ctas_per_seq = range_ctas_per_seq(L.max_k_blocks);
  const int head = static_cast<int>(blockIdx.x % L.num_heads_kv);
  const int b = static_cast<int>(blockIdx.x / L.num_heads_kv) / ctas_per_seq;
  const int group = static_cast<int>(blockIdx.x / L.num_heads_kv) % ctas_per_seq;
  const int len_k = __ldg(L.seqused_k + b);
  const int first_key = group * kRangeKeysPerCta * kCentreStride;
  if (first_key >= len_k) return;
  const int tid = static_cast<int>(threadIdx.x);
  const int chunk = tid % kChunks;
  const Element* cache = static_cast<const Element*>(L.k_cache) + head * L.k_head_stride + chunk * 8;
  const int32_t* pages = L.page_table + static_cast<int64_t>(b) * L.page_table_stride;
  const KeyPaging paging = key_paging(L);
  auto pass_key = [&](int pass) { return first_key + (pass * kKeysPerPass + tid / kChunks) * kCentreStride; };
  // The page numbers first, then the keys: issued in one loop, each key's load would wait for its
  // page number, one memory latency per pass.
  int page[kPasses];
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int key = pass_key(pass);
    page[pass] = key < len_k ? __ldg(pages + paging.page_index(key)) : -1;
  }
  uint4 raw[kPasses];
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    raw[pass] = make_uint4(0u, 0u, 0u, 0u);
    if (page[pass] >= 0) {
      raw[pass] = *reinterpret_cast<const uint4*>(cache + static_cast<int64_t>(page[pass]) * L.k_page_stride +
                                                  paging.row(pass_key(pass)) * L.k_row_stride);
    }
  }
  float high[8], low[8];
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    high[c] = -INFINITY;
    low[c] = INFINITY;
  }
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    if (page[pass] < 0) continue;  // past len_k: not a key
    const Element* e = reinterpret_cast<const Element*>(&raw[pass]);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const float2 v = to_float2<Element>(e + 2 * p);
      if (isfinite(v.x)) {
        high[2 * p] = fmaxf(high[2 * p], v.x);
        low[2 * p] = fminf(low[2 * p], v.x);
      }
      if (isfinite(v.y)) {
        high[2 * p + 1] = fmaxf(high[2 * p + 1], v.y);
        low[2 * p + 1] = fminf(low[2 * p + 1], v.y);
      }
    }
  }
#pragma unroll
  for (int off = kChunks; off < 32; off <<= 1) {
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      high[c] = fmaxf(high[c], __shfl_xor_sync(0xffffffffu, high[c], off));
      low[c] = fminf(low[c], __shfl_xor_sync(0xffffffffu, low[c], off));
    }
  }
  __shared__ float warp_high[kWarps][kHeadDim], warp_low[kWarps][kHeadDim];
  if (tid % 32 < kChunks) {
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      warp_high[tid / 32][chunk * 8 + c] = high[c];
      warp_low[tid / 32][chunk * 8 + c] = low[c];
    }
  }
  __syncthreads();
  if (tid < kHeadDim) {
    float channel_high = warp_high[0][tid], channel_low = warp_low[0][tid];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      channel_high = fmaxf(channel_high, warp_high[w][tid]);
      channel_low = fminf(channel_low, warp_low[w][tid]);
    }
    uint32_t* words = args.key_range + (static_cast<int64_t>(b) * L.num_heads_kv + head) * 2 * kHeadDim;
    atomicMax(words + tid, ordered_bits(channel_high));
    atomicMax(words + kHeadDim + tid, ordered_bits(-channel_low));  // the minimum as a maximum
  }
}

// The centre that the keys of sequence b, head `head` are quantised around: the midpoint of each
// channel's finite range, max / 2 + min / 2 (0 for a channel with no finite key).
template <int kHeadDim>
__device__ __forceinline__ float key_centre(const KapDeviceArgs& args, int b, int head, int channel) {
  const uint32_t* words =
      args.key_range + (static_cast<int64_t>(b) * args.layout.num_heads_kv + head) * 2 * kHeadDim;
  const float high = from_ordered_bits(words[channel]);
  const float low = -from_ordered_bits(words[kHeadDim + channel]);
  const float centre = __fadd_rn(__fmul_rn(high, 0.5f), __fmul_rn(low, 0.5f));
  return isfinite(centre) ? centre : 0.f;
}

// Quantisation CTAs: one per (packed query block, query head), then one per (key block, KV head);
// the launch's grid and the kernel's CTA mapping share these.
__host__ __device__ __forceinline__ int64_t quantize_query_ctas(const PagedLayout& L) {
  return static_cast<int64_t>(L.num_q_blocks) * L.num_heads_q;
}
__host__ __device__ __forceinline__ int64_t quantize_ctas(const PagedLayout& L) {
  return quantize_query_ctas(L) + static_cast<int64_t>(L.batch) * L.max_k_blocks * L.num_heads_kv;
}

// One CTA's block of the quantisation pass (kap_quantize_kernel): a packed query block of one query
// head, or a key block of one KV head, to e4m3 with its scale. Each thread owns one 16-byte chunk
// (8 channels) of every (kQuantizeThreads / chunks per token)-th token of the block, so that a
// warp's loads and stores cover whole token rows (coalesced), and holds its chunks as loaded: the
// values are converted (and centred) once for amax and again for the quantisation, the same float32
// operations both times, which keeps the registers, and so the CTAs in flight per SM, at what the
// loads need. (With a thread per token holding its whole row as floats, the pass moved about 2.1
// TB/s on the H200.) 256 threads of 8 chunks each (64 registers, four CTAs per SM) made the fp8 KAP
// 2-3.5% faster at 4K-16K tokens than 128 threads of 16 (96 registers, five CTAs), and 512 threads
// 5-15% slower.
template <class Element, int kHeadDim>
__device__ __forceinline__ void quantize_block(const KapDeviceArgs& args, bool query_block) {
  constexpr int kChunksPerToken = kHeadDim / 8;
  constexpr int kTokenStep = kQuantizeThreads / kChunksPerToken;  // tokens between a thread's chunks
  constexpr int kChunks = kBlockSize / kTokenStep;                 // chunks per thread
  const PagedLayout& L = args.layout;
  const int64_t query_ctas = quantize_query_ctas(L);
  const int64_t cta = query_block ? blockIdx.x : blockIdx.x - query_ctas;
  const int heads = query_block ? L.num_heads_q : L.num_heads_kv;
  const int head = static_cast<int>(cta % heads);
  const int block_index = static_cast<int>(cta / heads);  // g, or b * max_k_blocks + j
  const int tid = static_cast<int>(threadIdx.x);
  const int chunk = tid % kChunksPerToken;  // channels 8 * chunk ... 8 * chunk + 7
  const int first_token = tid / kChunksPerToken;

  uint4 raw[kChunks];
  bool live[kChunks];
  uint8_t* dst = nullptr;  // the thread's first chunk; the others follow kTokenStep rows apart
  int64_t dst_token_stride = 0;
  float* scale_out = nullptr;
  float centre[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // keys: what each channel is taken from
  if (query_block) {
    const int g = block_index;
    const QueryBlock block = locate_query_block(L, g);  // warp-collective: every warp calls it
    if (!block.valid) return;
    const int first_row = block.block_in_seq * kBlockSize + first_token;
    const int64_t token = static_cast<int64_t>(block.q_start) + first_row;
    const Element* src = static_cast<const Element*>(L.q) + token * L.q_row_stride + head * L.q_head_stride + 8 * chunk;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      live[i] = first_row + kTokenStep * i < block.seqlen_q;
      raw[i] = live[i] ? *reinterpret_cast<const uint4*>(src + int64_t(kTokenStep) * i * L.q_row_stride)
                       : make_uint4(0, 0, 0, 0);
    }
    dst_token_stride = int64_t(L.num_heads_q) * kHeadDim;
    dst = args.q8 + (static_cast<int64_t>(g) * kBlockSize + first_token) * dst_token_stride + head * kHeadDim +
          8 * chunk;
    scale_out = args.q_scale + static_cast<int64_t>(g) * L.num_heads_q + head;
  } else {
    const int slot = block_index;  // b * max_k_blocks + j
    const int b = slot / L.max_k_blocks;
    const int key_block = slot % L.max_k_blocks;
    const int len_k = __ldg(L.seqused_k + b);
    if (key_block * kBlockSize >= len_k) return;  // past Lk: never read
#pragma unroll
    for (int c = 0; c < 8; ++c) centre[c] = key_centre<kHeadDim>(args, b, head, 8 * chunk + c);
    const int32_t* page_row = L.page_table + static_cast<int64_t>(b) * L.page_table_stride;
    // The page numbers first, then the keys, as in the range kernel: a key's load waits for its
    // page number, and issued in one loop the chunks would pay one memory latency each.
    const KeyPaging paging = key_paging(L);
    int page[kChunks];
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int key = key_block * kBlockSize + first_token + kTokenStep * i;
      live[i] = key < len_k;
      page[i] = live[i] ? __ldg(page_row + paging.page_index(key)) : 0;
    }
    const Element* cache = static_cast<const Element*>(L.k_cache) + head * L.k_head_stride + 8 * chunk;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int key = key_block * kBlockSize + first_token + kTokenStep * i;
      raw[i] = live[i] ? *reinterpret_cast<const uint4*>(cache + static_cast<int64_t>(page[i]) * L.k_page_stride +
                                                         paging.row(key) * L.k_row_stride)
                       : make_uint4(0, 0, 0, 0);
    }
    dst_token_stride = int64_t(L.num_heads_kv) * kHeadDim;
    dst = args.k8 + (static_cast<int64_t>(slot) * kBlockSize + first_token) * dst_token_stride + head * kHeadDim +
          8 * chunk;
    scale_out = args.k_scale + static_cast<int64_t>(slot) * L.num_heads_kv + head;
  }
  // Channels p, p + 1 of chunk i as floats, centred for keys (one IEEE subtraction each).
  auto pair = [&](int i, int p) {
    float2 v = to_float2<Element>(reinterpret_cast<const Element*>(&raw[i]) + 2 * p);
    if (!query_block) {
      v.x = __fsub_rn(v.x, centre[2 * p]);
      v.y = __fsub_rn(v.y, centre[2 * p + 1]);
    }
    return v;
  };

  float amax = 0.f;
  bool nan = false;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    if (!live[i]) continue;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const float2 v = pair(i, p);
      amax = fmaxf(amax, fmaxf(fabsf(v.x), fabsf(v.y)));
      nan = nan || isnan(v.x) || isnan(v.y);
    }
  }
  // fmaxf drops NaN: the flag carries it.
  __shared__ float warp_amax[kQuantizeThreads / 32];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  if (tid % 32 == 0) warp_amax[tid / 32] = amax;
  nan = __syncthreads_or(nan);
#pragma unroll
  for (int w = 0; w < kQuantizeThreads / 32; ++w) amax = fmaxf(amax, warp_amax[w]);
  // An infinite amax is a NaN block too, as in the reference: x * (448 / inf) rounds to 0, and 0 times
  // the block's scale (inf) is NaN; taken as 0 times an infinite scale, the block's proxy maxima
  // were NaN where the reference's are -inf, and every list kept every candidate.
  if (nan || isinf(amax)) amax = __int_as_float(0x7fc00000);
  const float scale = amax == 0.f ? 1.f : __fdiv_rn(amax, kE4M3Max);
  const float inverse = amax == 0.f ? 1.f : __fdiv_rn(kE4M3Max, amax);
  if (tid == 0) *scale_out = scale;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {  // 8-byte stores; zeros past Lq and Lk, as the spec's zero rows
    uint32_t words[2] = {0u, 0u};
    if (live[i]) {
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        const float2 lo = pair(i, 2 * w);
        const float2 hi = pair(i, 2 * w + 1);
        const uint32_t lo2 = __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(lo.x, inverse), __fmul_rn(lo.y, inverse)),
                                                      __NV_SATFINITE, __NV_E4M3);
        const uint32_t hi2 = __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(hi.x, inverse), __fmul_rn(hi.y, inverse)),
                                                      __NV_SATFINITE, __NV_E4M3);
        words[w] = lo2 | (hi2 << 16);
      }
    }
    *reinterpret_cast<uint2*>(dst + kTokenStep * i * dst_token_stride) = make_uint2(words[0], words[1]);
  }
}

// Grid: x over (packed query block, query head) pairs, then (key block of batch * max_k_blocks, KV
// head) pairs, the head varying fastest in both. The query blocks need nothing from the range
// kernel, so they are quantised while it runs: their CTAs come first and wait for it only before
// they exit (which keeps the chain's completion order), and only the key blocks, which are centred
// on its ranges, wait for it before they start. With the head fastest, the CTAs in flight together
// read whole token rows of q and of the pages (with the head slowest, each head's CTAs came back to
// the same rows far apart in time; 1.4% of KAP at 32K).
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(kQuantizeThreads)
    kap_quantize_kernel(const KapDeviceArgs args) {
  // A dependent launch after the range kernel. That kernel's CTAs passed their own grid-dependency
  // wait before this grid could start, so every kernel before it (the input checks, the index
  // kernel, whatever wrote q and the caches) has completed: the query blocks read q at once and
  // wait only before exiting, the key blocks wait for the key ranges first.
  const PagedLayout& L = args.layout;
  const bool query_block = static_cast<int64_t>(blockIdx.x) < quantize_query_ctas(L);
  if (!query_block) cudaGridDependencySynchronize();
  cudaTriggerProgrammaticLaunchCompletion();
  if (!inputs_rejected(L)) quantize_block<Element, kHeadDim>(args, query_block);
  if (query_block) cudaGridDependencySynchronize();
}

}  // namespace cosa::kap
