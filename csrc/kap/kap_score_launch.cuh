// Definition of launch_score, included by the per-dtype instantiation files.
#pragma once

#include "common/dependent_launch.h"
#include "kap/kap_launch.h"
#include "kap/kap_score_kernel.cuh"

namespace cosa::kap {

template <ProxyElement kElement, int kHeadDim, int kStride, int kCols>
cudaError_t launch_score_tile(const KapDeviceArgs& args, cudaStream_t stream) {
  using Tile = ScoreTile<kCols>;
  auto kernel = kap_score_kernel<kElement, kHeadDim, kStride, kCols>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
  if (err != cudaSuccess) return err;
  const int max_col_tiles = ((args.layout.max_seqlen_k + kStride - 1) / kStride + kCols - 1) / kCols;
  const int num_units = (max_col_tiles + args.col_tiles_per_unit - 1) / args.col_tiles_per_unit;
  const dim3 grid(args.head_count, num_units, args.num_tiles);
  return launch_dependent(kernel, grid, dim3(kScoreThreads), Tile::kSmemBytes, stream, args);
}

template <ProxyElement kElement, int kHeadDim, int kStride>
cudaError_t launch_score(const KapDeviceArgs& args, cudaStream_t stream) {
  if (args.num_tiles == 0) return cudaSuccess;  // no query rows at all
  if (args.tile_cols == 128) return launch_score_tile<kElement, kHeadDim, kStride, 128>(args, stream);
  return launch_score_tile<kElement, kHeadDim, kStride, 256>(args, stream);
}

#define COSA_KAP_INSTANTIATE_SCORE(ELEMENT)                                                   \
  template cudaError_t launch_score<ELEMENT, 64, 4>(const KapDeviceArgs&, cudaStream_t);      \
  template cudaError_t launch_score<ELEMENT, 64, 8>(const KapDeviceArgs&, cudaStream_t);      \
  template cudaError_t launch_score<ELEMENT, 64, 16>(const KapDeviceArgs&, cudaStream_t);     \
  template cudaError_t launch_score<ELEMENT, 128, 4>(const KapDeviceArgs&, cudaStream_t);     \
  template cudaError_t launch_score<ELEMENT, 128, 8>(const KapDeviceArgs&, cudaStream_t);     \
  template cudaError_t launch_score<ELEMENT, 128, 16>(const KapDeviceArgs&, cudaStream_t);

}  // namespace cosa::kap
