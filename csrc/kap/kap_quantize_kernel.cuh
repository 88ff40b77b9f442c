// The e4m3 proxy's quantisation pass (spec section 2, proxy precision): per 128-token block and
// head, amax = max |x| over the block's tokens (NaN if any is NaN), scale = amax / 448 (1 for an
// all-zero block), and e4m3(x * (448 / amax)) rounded to nearest even with saturation, written to
// the workspace for the scoring kernel. Queries are blocked from the first query of each sequence,
// keys from token 0; the divisions are IEEE (not the fast-math ones) so that cosa.reference can
// reproduce every byte.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/query_blocks.cuh"
#include "kap/kap_traits.h"

namespace cosa::kap {

constexpr int kQuantizeThreads = kBlockSize;  // one thread per token of a block
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

// Grid: x over the packed query blocks, then over the key blocks (batch * max_k_blocks); y over
// query heads (key blocks use the first Hkv). Thread i owns token i of the block.
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(kQuantizeThreads)
    kap_quantize_kernel(const KapDeviceArgs args) {
  // A dependent launch after the index kernel: nothing here reads what it writes, but q and the
  // caches may come from the kernel before KAP.
  cudaGridDependencySynchronize();
  cudaTriggerProgrammaticLaunchCompletion();
  const PagedLayout& L = args.layout;
  const int head = static_cast<int>(blockIdx.y);
  const int tid = static_cast<int>(threadIdx.x);
  const bool query_block = static_cast<int>(blockIdx.x) < L.num_q_blocks;

  const Element* src = nullptr;
  uint8_t* dst = nullptr;
  float* scale_out = nullptr;
  bool live = false;
  if (query_block) {
    const int g = static_cast<int>(blockIdx.x);
    const QueryBlock block = locate_query_block(L, g);  // warp-collective: every warp calls it
    if (!block.valid) return;
    const int row_in_seq = block.block_in_seq * kBlockSize + tid;
    live = row_in_seq < block.seqlen_q;
    const int64_t token = static_cast<int64_t>(block.q_start) + row_in_seq;
    src = static_cast<const Element*>(L.q) + token * L.q_row_stride + head * L.q_head_stride;
    dst = args.q8 + (token * L.num_heads_q + head) * kHeadDim;
    scale_out = args.q_scale + static_cast<int64_t>(g) * L.num_heads_q + head;
  } else {
    if (head >= L.num_heads_kv) return;
    const int slot = static_cast<int>(blockIdx.x) - L.num_q_blocks;  // b * max_k_blocks + j
    const int b = slot / L.max_k_blocks;
    const int key_block = slot % L.max_k_blocks;
    const int len_k = __ldg(L.seqused_k + b);
    if (key_block * kBlockSize >= len_k) return;  // past Lk: never read
    const int key = key_block * kBlockSize + tid;
    live = key < len_k;
    if (live) {
      const int page = __ldg(L.page_table + static_cast<int64_t>(b) * L.page_table_stride +
                             key / L.page_size);
      src = static_cast<const Element*>(L.k_cache) + page * L.k_page_stride +
            (key % L.page_size) * L.k_row_stride + head * L.k_head_stride;
    }
    dst = args.k8 + ((static_cast<int64_t>(slot) * kBlockSize + tid) * L.num_heads_kv + head) *
                        kHeadDim;
    scale_out = args.k_scale + static_cast<int64_t>(slot) * L.num_heads_kv + head;
  }

  float2 values[kHeadDim / 2];
  float amax = 0.f;
  bool nan = false;
  if (live) {
#pragma unroll
    for (int i = 0; i < kHeadDim / 8; ++i) {  // 16-byte loads
      const uint4 chunk = *reinterpret_cast<const uint4*>(src + 8 * i);
      const Element* e = reinterpret_cast<const Element*>(&chunk);
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const float2 v = to_float2<Element>(e + 2 * p);
        values[4 * i + p] = v;
        amax = fmaxf(amax, fmaxf(fabsf(v.x), fabsf(v.y)));
        nan = nan || isnan(v.x) || isnan(v.y);
      }
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
  if (nan) amax = __int_as_float(0x7fc00000);
  const float scale = amax == 0.f ? 1.f : __fdiv_rn(amax, kE4M3Max);
  const float inverse = amax == 0.f ? 1.f : __fdiv_rn(kE4M3Max, amax);
  if (tid == 0) *scale_out = scale;
  if (!live) return;
#pragma unroll
  for (int i = 0; i < kHeadDim / 16; ++i) {  // 16-byte stores
    uint32_t words[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float2 lo = values[8 * i + 2 * w];
      const float2 hi = values[8 * i + 2 * w + 1];
      const uint32_t lo2 = __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(lo.x, inverse), __fmul_rn(lo.y, inverse)),
                                                    __NV_SATFINITE, __NV_E4M3);
      const uint32_t hi2 = __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(hi.x, inverse), __fmul_rn(hi.y, inverse)),
                                                    __NV_SATFINITE, __NV_E4M3);
      words[w] = lo2 | (hi2 << 16);
    }
    *reinterpret_cast<uint4*>(dst + 16 * i) = make_uint4(words[0], words[1], words[2], words[3]);
  }
}

}  // namespace cosa::kap
