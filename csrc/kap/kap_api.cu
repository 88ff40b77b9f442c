// cosa::run_kap and cosa::kap_workspace_bytes (declared in cosa_params.h): the index pass, then per
// chunk of query heads the scoring and selection passes (see kap_traits.h), all enqueued on one
// stream as one chain of dependent launches, without host synchronisation.
#include <cuda_runtime.h>

#include <algorithm>

#include "common/dependent_launch.h"
#include "common/query_blocks.cuh"
#include "cosa_params.h"
#include "kap/kap_launch.h"
#include "kap/kap_quantize_kernel.cuh"
#include "kap/kap_select_kernel.cuh"
#include "kap/kap_traits.h"

namespace cosa {
namespace kap {
namespace {

constexpr int kIndexThreads = 1024;
// Words (rm, the query blocks' scoring counters, then the key ranges) per zeroing CTA of the index
// kernel (four per thread); past one CTA per SM they loop.
constexpr int64_t kZeroedWordsPerCta = 4 * kIndexThreads;

// CTA 0: prefix sums over the batch of the query blocks (ceil(Lq_b / 128)) and scoring tiles
// (ceil(ceil(Lq_b / s) / 128)) of each sequence, in chunks of kIndexThreads sequences. The other
// CTAs zero the first `zeroed_words` words from rm on: the first head chunk's rm, the query blocks'
// scoring counters and, with the e4m3 proxy, the key ranges after them. The scoring pass folds its
// row maxima into a zeroed buffer (the select kernels re-zero it for later chunks) and counts its
// warps from zero, the range kernel folds its channel ranges, and doing it here rather than in a
// memset keeps the launches one chain of kernels.
__global__ void __launch_bounds__(kIndexThreads)
    kap_index_kernel(const int32_t* cu_seqlens_q, int batch, int stride, int32_t* q_block_start,
                     int32_t* tile_start, uint32_t* zeroed, int64_t zeroed_words) {
  // A dependent launch (common/dependent_launch.h) after whatever the stream ran before KAP; the
  // scoring kernel may launch as soon as every CTA here has started.
  cudaGridDependencySynchronize();
  cudaTriggerProgrammaticLaunchCompletion();
  if (blockIdx.x > 0) {
    const int64_t step = static_cast<int64_t>(gridDim.x - 1) * kIndexThreads;
    const int64_t first = static_cast<int64_t>(blockIdx.x - 1) * kIndexThreads + threadIdx.x;
    for (int64_t w = first; w < zeroed_words; w += step) zeroed[w] = 0;
    return;
  }
  __shared__ int warp_blocks[kIndexThreads / 32], warp_tiles[kIndexThreads / 32];
  __shared__ int carry_blocks, carry_tiles;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  if (tid == 0) {
    carry_blocks = 0;
    carry_tiles = 0;
  }
  __syncthreads();
  for (int base = 0; base < batch; base += kIndexThreads) {
    const int b = base + tid;
    int blocks = 0, tiles = 0;
    if (b < batch) {
      const int len_q = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
      blocks = num_query_blocks(len_q);
      tiles = ((len_q + stride - 1) / stride + kTileRows - 1) / kTileRows;
    }
    int inc_blocks = blocks, inc_tiles = tiles;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int ob = __shfl_up_sync(0xffffffffu, inc_blocks, off);
      const int ot = __shfl_up_sync(0xffffffffu, inc_tiles, off);
      if (lane >= off) {
        inc_blocks += ob;
        inc_tiles += ot;
      }
    }
    if (lane == 31) {
      warp_blocks[warp] = inc_blocks;
      warp_tiles[warp] = inc_tiles;
    }
    __syncthreads();
    int off_blocks = carry_blocks, off_tiles = carry_tiles;
    for (int w = 0; w < warp; ++w) {
      off_blocks += warp_blocks[w];
      off_tiles += warp_tiles[w];
    }
    if (b < batch) {
      q_block_start[b] = off_blocks + inc_blocks - blocks;
      tile_start[b] = off_tiles + inc_tiles - tiles;
    }
    __syncthreads();  // everyone has read the carries and warp sums
    if (tid == kIndexThreads - 1) {
      carry_blocks = off_blocks + inc_blocks;
      carry_tiles = off_tiles + inc_tiles;
    }
    __syncthreads();
  }
  if (tid == 0) {
    q_block_start[batch] = carry_blocks;
    tile_start[batch] = carry_tiles;
  }
}

// The warp select kernel in the version whose longest sort (32 * kMaxElems keys, from 64 up to
// kWarpSortMax) holds the problem's longest list; the host side of select_list_fitting.
template <int kStride, int kMaxElems = 2>
cudaError_t launch_select_warp(const KapDeviceArgs& args, cudaStream_t stream) {
  if constexpr (32 * kMaxElems < kWarpSortMax) {
    if (args.layout.max_k_blocks > 32 * kMaxElems) {
      return launch_select_warp<kStride, 2 * kMaxElems>(args, stream);
    }
  }
  const dim3 grid(static_cast<unsigned>(
      static_cast<int64_t>((args.layout.num_q_blocks + kSelectWarps - 1) / kSelectWarps) *
      args.head_count));
  return launch_dependent(kap_select_warp_kernel<kStride, kMaxElems>, grid,
                          dim3(32 * kSelectWarps), 0, stream, args);
}

template <int kStride>
cudaError_t launch_select(const KapDeviceArgs& args, cudaStream_t stream) {
  if (args.layout.max_k_blocks <= kWarpSortMax) { return launch_select_warp<kStride>(args, stream); }
  const size_t smem = select_smem_bytes(args.layout.max_k_blocks);
  auto kernel = kap_select_block_kernel<kStride>;
  if (smem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(
      static_cast<unsigned>(static_cast<int64_t>(args.layout.num_q_blocks) * args.head_count));
  return launch_dependent(kernel, grid, dim3(kSelectThreads), smem, stream, args);
}

template <ProxyElement kElement, int kHeadDim>
cudaError_t launch_chunk(const KapDeviceArgs& args, int stride, cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  switch (stride) {
    case 4:
      err = launch_score<kElement, kHeadDim, 4>(args, stream);
      if (err == cudaSuccess) err = launch_select<4>(args, stream);
      break;
    case 8:
      err = launch_score<kElement, kHeadDim, 8>(args, stream);
      if (err == cudaSuccess) err = launch_select<8>(args, stream);
      break;
    case 16:
      err = launch_score<kElement, kHeadDim, 16>(args, stream);
      if (err == cudaSuccess) err = launch_select<16>(args, stream);
      break;
    default:
      break;
  }
  return err;
}

template <ProxyElement kElement>
cudaError_t launch_chunk(const KapDeviceArgs& args, int stride, cudaStream_t stream) {
  if (args.layout.head_dim == 128) return launch_chunk<kElement, 128>(args, stride, stream);
  if (args.layout.head_dim == 64) return launch_chunk<kElement, 64>(args, stride, stream);
  return cudaErrorInvalidValue;
}

cudaError_t launch_chunk(const KapDeviceArgs& args, int stride, ProxyPrecision precision,
                         cudaStream_t stream) {
  if (precision == ProxyPrecision::kE4M3) {
    return launch_chunk<ProxyElement::kE4M3>(args, stride, stream);
  }
  return args.layout.dtype == DType::kBFloat16
             ? launch_chunk<ProxyElement::kBFloat16>(args, stride, stream)
             : launch_chunk<ProxyElement::kFloat16>(args, stride, stream);
}

// The keys' channel ranges, then the e4m3 copies of q and of the centred keys of every sequence,
// with their block scales.
template <class Element, int kHeadDim>
cudaError_t launch_quantize(const KapDeviceArgs& args, cudaStream_t stream) {
  const PagedLayout& L = args.layout;
  const dim3 range_grid(static_cast<unsigned>(
      L.batch * range_ctas_per_seq(L.max_k_blocks) * L.num_heads_kv));
  const cudaError_t err = launch_dependent(kap_key_range_kernel<Element, kHeadDim>, range_grid,
                                           dim3(kRangeThreads), 0, stream, args);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(quantize_ctas(L)));
  return launch_dependent(kap_quantize_kernel<Element, kHeadDim>, grid, dim3(kQuantizeThreads), 0,
                          stream, args);
}

template <class Element>
cudaError_t launch_quantize(const KapDeviceArgs& args, cudaStream_t stream) {
  return args.layout.head_dim == 128 ? launch_quantize<Element, 128>(args, stream)
                                     : launch_quantize<Element, 64>(args, stream);
}

}  // namespace
}  // namespace kap

namespace {
// `given` with its proxy precision resolved (kAuto chooses by the problem's longest key sequence):
// what the workspace is sized for and what runs.
KapParams with_resolved_precision(const KapParams& given) {
  KapParams params = given;
  params.precision = resolve_proxy_precision(given.precision, given.layout.max_seqlen_k);
  return params;
}
}  // namespace

size_t kap_workspace_bytes(const KapParams& given) {
  // 0 for parameters run_kap refuses (the layout divides by the stride).
  return valid_kap_params(given) ? kap::workspace_layout(with_resolved_precision(given)).total_bytes : 0;
}

cudaError_t run_kap(const KapParams& given, cudaStream_t stream) {
  if (!valid_kap_params(given)) return cudaErrorInvalidValue;
  const KapParams params = with_resolved_precision(given);
  const PagedLayout& layout = params.layout;
  if (layout.num_q_blocks == 0) return cudaSuccess;
  if (kap::select_smem_bytes(layout.max_k_blocks) > 200 * 1024) return cudaErrorInvalidValue;
  const kap::WorkspaceLayout ws = kap::workspace_layout(params);
  // The copies in it are read by 16-byte cp.async and by TMA (16-byte aligned addresses).
  if (reinterpret_cast<uintptr_t>(params.workspace) % kap::kWorkspaceAlignment != 0) {
    return cudaErrorInvalidValue;
  }
  auto* base = static_cast<uint8_t*>(params.workspace);
  kap::KapDeviceArgs args;
  args.layout = layout;
  args.top_p = params.top_p;
  args.order = params.order;
  args.counts = params.counts;
  args.q_block_start = reinterpret_cast<const int32_t*>(base + ws.q_block_start_offset);
  args.tile_start = reinterpret_cast<const int32_t*>(base + ws.tile_start_offset);
  args.block_max = reinterpret_cast<float*>(base + ws.block_max_offset);
  args.row_max = reinterpret_cast<uint32_t*>(base + ws.row_max_offset);
  args.blocks_scored = reinterpret_cast<uint32_t*>(base + ws.blocks_scored_offset);
  args.block_max_rows = ws.rows;
  if (params.precision == ProxyPrecision::kE4M3) {
    args.key_range = reinterpret_cast<uint32_t*>(base + ws.key_range_offset);
    args.q8 = base + ws.q8_offset;
    args.k8 = base + ws.k8_offset;
    args.q_scale = reinterpret_cast<float*>(base + ws.q_scale_offset);
    args.k_scale = reinterpret_cast<float*>(base + ws.k_scale_offset);
  }
  // At most kKapMaxScoreTiles (valid_kap_params).
  args.num_tiles = static_cast<int>(
      kap_score_tiles_bound(layout.batch, layout.max_seqlen_q, layout.total_q, params.stride));
  int device = 0, num_sms = 132;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
  {
    // Column tiles and units: 256-wide tiles unless the problem gives fewer than two waves of
    // them; units long enough to amortise the pipeline fill, short enough that the causal
    // triangle splits into some two waves of CTAs per head chunk.
    const int64_t stride_cols = (layout.max_seqlen_k + params.stride - 1) / params.stride;
    auto causal_work = [&](int64_t tile_cols) {  // column tiles of all row tiles, about
      return static_cast<int64_t>(ws.heads_per_chunk) * args.num_tiles *
             ((stride_cols + tile_cols - 1) / tile_cols + 1) / 2;
    };
    args.tile_cols = causal_work(256) < 2 * static_cast<int64_t>(num_sms) ? 128 : 256;
    const int64_t per_unit = causal_work(args.tile_cols) / (2 * static_cast<int64_t>(num_sms));
    args.col_tiles_per_unit = static_cast<int>(
        per_unit < 1 ? 1 : (per_unit > kap::kMaxColTilesPerUnit ? kap::kMaxColTilesPerUnit : per_unit));
    const int64_t col_tiles = (stride_cols + args.tile_cols - 1) / args.tile_cols;
    args.units_per_tile =
        static_cast<int>((col_tiles + args.col_tiles_per_unit - 1) / args.col_tiles_per_unit);
  }

  // The first head chunk has heads_per_chunk heads (heads_per_chunk <= num_heads_q); the query
  // blocks' scoring counters and, with the e4m3 proxy, the key ranges that follow are zeroed in the
  // same sweep.
  const int64_t zeroed_words =
      static_cast<int64_t>((ws.q8_offset - ws.row_max_offset) / sizeof(uint32_t));
  const int64_t zeroing_ctas = std::min<int64_t>(
      (zeroed_words + kap::kZeroedWordsPerCta - 1) / kap::kZeroedWordsPerCta, num_sms);
  cudaError_t err = launch_dependent(
      kap::kap_index_kernel, dim3(static_cast<unsigned>(1 + zeroing_ctas)),
      dim3(kap::kIndexThreads), 0, stream, layout.cu_seqlens_q, layout.batch, params.stride,
      reinterpret_cast<int32_t*>(base + ws.q_block_start_offset),
      reinterpret_cast<int32_t*>(base + ws.tile_start_offset), args.row_max, zeroed_words);
  if (err == cudaSuccess && params.precision == ProxyPrecision::kE4M3) {
    err = layout.dtype == DType::kBFloat16 ? kap::launch_quantize<__nv_bfloat16>(args, stream)
                                           : kap::launch_quantize<__half>(args, stream);
  }
  for (int head = 0; err == cudaSuccess && head < layout.num_heads_q; head += ws.heads_per_chunk) {
    args.head_begin = head;
    args.head_count = min(ws.heads_per_chunk, layout.num_heads_q - head);
    err = kap::launch_chunk(args, params.stride, params.precision, stream);
  }
  return err;
}

}  // namespace cosa
