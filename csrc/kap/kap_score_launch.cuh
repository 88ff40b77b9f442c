// Definition of launch_score, included by the per-dtype instantiation files.
#pragma once

#include "common/dependent_launch.h"
#include "common/tensor_map.h"
#include "kap/kap_launch.h"
#include "kap/kap_score_kernel.cuh"
#include "kap/kap_score_resident_kernel.cuh"

namespace cosa::kap {

// An e4m3 copy [groups * s, heads, 128] as the 4-D TMA tensor (channel, token in group, head,
// group), read in boxes of 128 x 1 x 1 x rows: one 128-byte row per group, the 128-byte swizzle
// that wgmma reads. The copies live in KAP's workspace (256-byte aligned, strides multiples of
// 128 bytes), so the encoding fails only where the driver lacks TMA.
inline cudaError_t encode_copy_tensor_map(CUtensorMap* map, void* base, int64_t groups, int heads,
                                          int stride, int box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  constexpr int64_t kRowBytes = 128;  // d = 128 one-byte elements
  const cuuint64_t dims[4] = {cuuint64_t(kRowBytes), cuuint64_t(stride), cuuint64_t(heads),
                              cuuint64_t(groups)};
  const cuuint64_t strides[3] = {cuuint64_t(heads * kRowBytes), cuuint64_t(kRowBytes),
                                 cuuint64_t(stride * heads * kRowBytes)};
  const cuuint32_t box[4] = {cuuint32_t(kRowBytes), 1, 1, cuuint32_t(box_rows)};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult result = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, base, dims, strides, box,
                                 element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                 CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// Both e4m3 copies as TMA tensors for the scoring kernels: query boxes of a tile's 128 stride rows,
// key boxes of `key_box_rows` stride columns.
inline cudaError_t encode_operand_maps(const KapDeviceArgs& args, int stride, int key_box_rows,
                                       ScoreOperandMaps* maps) {
  const PagedLayout& L = args.layout;
  const int groups_per_block = kBlockSize / stride;
  const cudaError_t err = encode_copy_tensor_map(
      &maps->q, args.q8, int64_t(L.num_q_blocks) * groups_per_block, L.num_heads_q, stride, kTileRows);
  if (err != cudaSuccess) return err;
  return encode_copy_tensor_map(&maps->k, args.k8, int64_t(L.batch) * L.max_k_blocks * groups_per_block,
                                L.num_heads_kv, stride, key_box_rows);
}

// The resident-query kernel (kap_score_resident_kernel.cuh) over the launch's 256-column units.
template <int kStride>
cudaError_t launch_score_resident(const KapDeviceArgs& args, cudaStream_t stream) {
  using Tile = ResidentScoreTile<kStride>;
  auto kernel = kap_score_resident_kernel<kStride>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(args.head_count, args.units_per_tile, args.num_tiles);
  ScoreOperandMaps maps = {};
  err = encode_operand_maps(args, kStride, Tile::kHalfCols, &maps);
  if (err != cudaSuccess) return err;
  return launch_dependent(kernel, grid, dim3(kScoreThreads), Tile::kSmemBytes, stream, args, maps);
}

template <ProxyElement kElement, int kHeadDim, int kStride, int kCols>
cudaError_t launch_score_tile(const KapDeviceArgs& args, cudaStream_t stream) {
  using Tile = ScoreTile<kCols, kTmaOperands<kElement, kHeadDim>>;
  auto kernel = kap_score_kernel<kElement, kHeadDim, kStride, kCols>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(args.head_count, args.units_per_tile, args.num_tiles);
  ScoreOperandMaps maps = {};
  if constexpr (kTmaOperands<kElement, kHeadDim>) {
    err = encode_operand_maps(args, kStride, kCols, &maps);
    if (err != cudaSuccess) return err;
  }
  return launch_dependent(kernel, grid, dim3(kScoreThreads), Tile::kSmemBytes, stream, args, maps);
}

template <ProxyElement kElement, int kHeadDim, int kStride>
cudaError_t launch_score(const KapDeviceArgs& args, cudaStream_t stream) {
  if (args.num_tiles == 0) return cudaSuccess;  // no query rows at all
  if (args.tile_cols == 128) return launch_score_tile<kElement, kHeadDim, kStride, 128>(args, stream);
  if constexpr (kResidentQueryScoring<kElement, kHeadDim, kStride>) {
    return launch_score_resident<kStride>(args, stream);
  } else {
    return launch_score_tile<kElement, kHeadDim, kStride, 256>(args, stream);
  }
}

#define COSA_KAP_INSTANTIATE_SCORE(ELEMENT)                                                   \
  template cudaError_t launch_score<ELEMENT, 64, 4>(const KapDeviceArgs&, cudaStream_t);      \
  template cudaError_t launch_score<ELEMENT, 64, 8>(const KapDeviceArgs&, cudaStream_t);      \
  template cudaError_t launch_score<ELEMENT, 64, 16>(const KapDeviceArgs&, cudaStream_t);     \
  template cudaError_t launch_score<ELEMENT, 128, 4>(const KapDeviceArgs&, cudaStream_t);     \
  template cudaError_t launch_score<ELEMENT, 128, 8>(const KapDeviceArgs&, cudaStream_t);     \
  template cudaError_t launch_score<ELEMENT, 128, 16>(const KapDeviceArgs&, cudaStream_t);

}  // namespace cosa::kap
