// Host side of one OSK configuration (head dim, dtype): derived parameters, the shared-memory
// opt-in and the launch. Instantiated once per configuration in instantiations/*.cu.
#pragma once

#include <cmath>

#include <cuda.h>
#include <cuda_runtime.h>

#include "common/dependent_launch.h"
#include "common/tensor_map.h"
#include "cosa_params.h"
#include "osk/osk_kernel.h"
#include "osk/osk_traits.h"

namespace cosa::osk {

// Pipeline depth: with head_dim 128, Q + 2 x (K, V) stages take 160 KB of the 227 KB of shared
// memory; head_dim 64 tiles are half as big, so twice as many stages fit.
template <int kHeadDim>
constexpr int kStagesForHeadDim = kHeadDim == 128 ? 2 : 4;

// A paged cache [num_pages, page_size, num_heads_kv, head_dim] as the 4-D TMA tensor
// (head_dim, kv head, row, page) read in boxes of 64 x 1 x min(page_size, 128) x 1 (128 bytes per
// row: the 128-byte swizzle of the shared-memory tiles). False when TMA cannot address it
// (misaligned base or strides); the kernel then gathers every block with cp.async.
inline bool encode_kv_tensor_map(CUtensorMap* map, const void* base, const PagedLayout& layout,
                                 int64_t page_stride, int64_t row_stride, int64_t head_stride) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  constexpr int64_t kElementBytes = 2;
  const bool aligned = reinterpret_cast<uintptr_t>(base) % 16 == 0 &&
                       (page_stride * kElementBytes) % 16 == 0 &&
                       (row_stride * kElementBytes) % 16 == 0 &&
                       (head_stride * kElementBytes) % 16 == 0;
  if (encode == nullptr || !aligned || layout.num_pages <= 0) { return false; }
  const cuuint64_t dims[4] = {cuuint64_t(layout.head_dim), cuuint64_t(layout.num_heads_kv),
                              cuuint64_t(layout.page_size), cuuint64_t(layout.num_pages)};
  const cuuint64_t strides[3] = {cuuint64_t(head_stride * kElementBytes),
                                 cuuint64_t(row_stride * kElementBytes),
                                 cuuint64_t(page_stride * kElementBytes)};
  const cuuint32_t box[4] = {64, 1, cuuint32_t(layout.page_size < kBlockSize ? layout.page_size
                                                                             : kBlockSize), 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult result = encode(
      map,
      layout.dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                       : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      4, const_cast<void*>(base), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS;
}

template <int kHeadDim, class Element>
cudaError_t run_osk_config(const OskParams& params, cudaStream_t stream) {
  using Traits = OskTraits<kHeadDim, Element, kStagesForHeadDim<kHeadDim>>;
  const dim3 grid = OskTileScheduler::grid(params);
  if (grid.x == 0) { return cudaSuccess; }

  OskKernelParams kp;
  kp.args = params;
  kp.log2_page_size = log2_page_size(params.layout.page_size);
  kp.heads_per_kv = params.layout.num_heads_q / params.layout.num_heads_kv;
  kp.scale_log2 = params.layout.softmax_scale * static_cast<float>(M_LOG2E);
  const PagedLayout& layout = params.layout;
  kp.kv_tma = encode_kv_tensor_map(&kp.tma_k, layout.k_cache, layout, layout.k_page_stride,
                                   layout.k_row_stride, layout.k_head_stride) &&
              encode_kv_tensor_map(&kp.tma_v, layout.v_cache, layout, layout.v_page_stride,
                                   layout.v_row_stride, layout.v_head_stride);

  auto kernel = skip_enabled(params.delta) ? osk_fwd_kernel<Traits, true> : osk_fwd_kernel<Traits, false>;
  const int smem_bytes = static_cast<int>(sizeof(OskSharedStorage<Traits>));
  // Per device and per configuration, cheap enough to repeat on every call.
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) { return err; }
  return launch_dependent(kernel, grid, dim3(Traits::kNumThreads), smem_bytes, stream, kp);
}

}  // namespace cosa::osk
