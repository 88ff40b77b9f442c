// Compile-time shapes of the KAP kernels and the layout of their workspace (spec section 2).
//
// KAP runs as a chain of dependent launches on one stream (common/dependent_launch.h: each kernel
// may start while the one before it finishes, and waits for it before touching global memory):
//   1. kap_index_kernel: per sequence, the first packed query block and the first scoring tile
//      (prefix sums over the batch, so that no host synchronisation is needed); its other CTAs
//      zero the rm buffer of the first head chunk and the query blocks' scoring counters;
//   2. kap_score_kernel (kap_score_kernel.cuh), or for the e4m3 copies at d = 128 and s <= 8 on
//      256-column tiles kap_score_resident_kernel (kap_score_resident_kernel.cuh): the strided
//      proxy GEMM Qs Ks^T on tensor cores; its epilogue reduces each stride row's logits to the
//      per-key-block maxima bm[r, j], stores them in the workspace and folds them into the row
//      maxima rm[r] (atomic maxima, into a zeroed buffer);
//   3. kap_select_*_kernel (kap_select_kernel.cuh): per (query head, query block), once the scoring
//      CTAs of its row tile are done (their warps count themselves in the block's counter), Pbar, S
//      and the HRM flags in one read of bm, the flag-grouped sort, top-p and the ordered list; each
//      list zeroes the rm entries it read, which leaves the buffer zeroed for the next head chunk.
// Steps 2-3 repeat per chunk of query heads so that the bm buffer stays below kMaxBlockMaxBytes
// (no O(N^2) buffer: bm is O(N^2 / (128 s)) per head, 64 MB per head at 128K tokens and s = 8).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda.h>  // CUtensorMap

#include "common/input_gate.cuh"
#include "common/paging.cuh"
#include "cosa_params.h"

namespace cosa::kap {

// What the proxy GEMM multiplies: the inputs' 16-bit type, or e4m3 copies of them with per-block
// scales (spec section 2, proxy precision).
enum class ProxyElement { kBFloat16, kFloat16, kE4M3 };

template <ProxyElement kElement>
struct ProxyElementTraits {
  static constexpr int kBytes = kElement == ProxyElement::kE4M3 ? 1 : 2;
  // Elements of one 128-byte shared-memory row (one K slice of the tile), and of one MMA's K.
  static constexpr int kRowElems = 128 / kBytes;
  static constexpr int kMmaK = 32 / kBytes;
};

// Whether the scoring kernel loads its operands by TMA: the e4m3 copies at d = 128, where a K slice
// (128 one-byte elements) is one token of every group (kap_score_kernel.cuh).
template <ProxyElement kElement, int kHeadDim>
constexpr bool kTmaOperands = kElement == ProxyElement::kE4M3 && kHeadDim == 128;

// The e4m3 copies as TMA tensors (kap_score_launch.cuh); unset where the kernel gathers with
// cp.async.
struct ScoreOperandMaps {
  CUtensorMap q;
  CUtensorMap k;
};

// Scoring tile: kTileRows stride rows (Qs rows) x kTileCols stride columns (Ks rows), reduced over
// the s * d long antidiagonal vectors one 128-byte row at a time (64 16-bit or 128 e4m3 elements).
constexpr int kTileRows = kKapScoreTileRows;  // two consumer warpgroups of 64 rows
constexpr int kTileRowBytes = 128;  // one 128-byte-swizzled row of a K slice
constexpr int kScoreThreads = 256;
constexpr int kTileABytes = kTileRows * kTileRowBytes;
// Column tiles: 256 wide where there is work for every SM (the smallest tile whose operand
// traffic, 48 KB per K slice served mostly by L2, keeps up with the tensor cores), 128 wide for
// short problems, which then split into twice as many CTAs. The 128-wide tiles of the TMA kernel
// (e4m3 copies, d = 128) run two CTAs per SM on three stages each: a short problem leaves one CTA's
// loads and epilogues exposed (0.87x the KAP time at 8K tokens, 12 / 2 heads, on an H200), while
// the gathering kernels, whose loads run only kStages - 2 steps ahead, keep six stages and one CTA.
template <int kCols, bool kTmaLoads>
struct ScoreTile {
  static constexpr int kTileCols = kCols;
  static constexpr int kCtasPerSm = kCols == 128 && kTmaLoads ? 2 : 1;
  static constexpr int kStages = kCols == 256 ? 4 : (kCtasPerSm == 2 ? 3 : 6);
  static constexpr int kTileBBytes = kCols * kTileRowBytes;
  static constexpr int kStageBytes = kTileABytes + kTileBBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes + 1024;  // + alignment slack
};
// The resident-query kernel (kap_score_resident_kernel.cuh) takes the e4m3 copies at d = 128 and
// s <= 8 on 256-column tiles: the row tile's s K slices (at most 128 KB) stay in shared memory,
// beside a ring of 128-column key stages per consumer warpgroup (three at s = 8, four at s = 4).
template <ProxyElement kElement, int kHeadDim, int kStride>
constexpr bool kResidentQueryScoring = kTmaOperands<kElement, kHeadDim> && kStride <= 8;
template <int kStride>
struct ResidentScoreTile {
  static constexpr int kHalfCols = 128;
  static constexpr int kSliceBytes = kTileRows * kTileRowBytes;
  static constexpr int kQueryBytes = kStride * kSliceBytes;
  static constexpr int kStageBytes = kHalfCols * kTileRowBytes;
  static constexpr int kFittingStages = (227 * 1024 - 2048 - kQueryBytes) / (2 * kStageBytes);
  static constexpr int kStagesPerWarpgroup = kFittingStages < 4 ? kFittingStages : 4;
  static constexpr int kSmemBytes = kQueryBytes + 2 * kStagesPerWarpgroup * kStageBytes + 1024;
  static_assert(kStagesPerWarpgroup >= 3, "three key stages per warpgroup fit beside the query slices");
};
// A CTA walks at most kMaxColTilesPerUnit column tiles; shorter units balance short problems.
constexpr int kMaxColTilesPerUnit = 16;

constexpr int kSelectThreads = 256;

// The bm buffer of one head chunk: [heads, num_q_blocks * (128 / s), max_k_blocks] fp32.
constexpr size_t kMaxBlockMaxBytes = size_t(512) << 20;

struct WorkspaceLayout {
  size_t q_block_start_offset = 0;  // int32 [batch + 1]: first packed query block of sequence b
  size_t tile_start_offset = 0;     // int32 [batch + 1]: first scoring tile of sequence b
  size_t block_max_offset = 0;      // fp32 [heads_per_chunk, rows, max_k_blocks]
  size_t row_max_offset = 0;        // ordered_bits(rm) [heads_per_chunk, rows], zero between passes
  size_t blocks_scored_offset = 0;  // uint32 [Hq, num_q_blocks]: scoring warps done per query block
  // With the e4m3 proxy only (else 0 bytes): the keys' channel ranges (zeroed with row_max and
  // blocks_scored, which they follow), the quantised copies and their per-block scales.
  size_t key_range_offset = 0;  // ordered_bits [batch, Hkv, 2, d]: max, then -min, per channel
  size_t q8_offset = 0;       // e4m3 [num_q_blocks * 128, Hq, d], query i of packed block g at row
                              // 128 g + i, zeros past Lq
  size_t k8_offset = 0;       // e4m3 [batch, max_k_blocks * 128, Hkv, d], key t of b at row t of b,
                              // zeros past Lk in its last block
  size_t q_scale_offset = 0;  // fp32 [num_q_blocks, Hq]: packed query block g, query head
  size_t k_scale_offset = 0;  // fp32 [batch, max_k_blocks, Hkv]
  int64_t rows = 0;                 // num_q_blocks * (128 / s)
  int heads_per_chunk = 0;
  size_t total_bytes = 0;
};

// Of the workspace's base (cudaMalloc's); its regions start at multiples of it.
constexpr size_t kWorkspaceAlignment = 256;

inline size_t align_up(size_t value, size_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

inline WorkspaceLayout workspace_layout(const KapParams& params) {
  const PagedLayout& layout = params.layout;
  WorkspaceLayout ws;
  auto region = [](size_t bytes) { return align_up(bytes, kWorkspaceAlignment); };
  const size_t index_bytes = region(sizeof(int32_t) * (layout.batch + 1));
  ws.q_block_start_offset = 0;
  ws.tile_start_offset = index_bytes;
  ws.block_max_offset = 2 * index_bytes;
  ws.rows = static_cast<int64_t>(layout.num_q_blocks) * (kBlockSize / params.stride);
  const size_t head_bytes = sizeof(float) * ws.rows * static_cast<size_t>(layout.max_k_blocks);
  int heads = layout.num_heads_q;
  if (head_bytes > 0 && head_bytes * heads > kMaxBlockMaxBytes) {
    heads = static_cast<int>(kMaxBlockMaxBytes / head_bytes);
    if (heads < 1) heads = 1;
  }
  ws.heads_per_chunk = heads;
  ws.row_max_offset = ws.block_max_offset + region(head_bytes * heads);
  ws.blocks_scored_offset = ws.row_max_offset + region(sizeof(uint32_t) * ws.rows * heads);
  ws.key_range_offset =
      ws.blocks_scored_offset +
      region(sizeof(uint32_t) * layout.num_heads_q * static_cast<size_t>(layout.num_q_blocks));
  const bool e4m3 = params.precision == ProxyPrecision::kE4M3;
  const size_t head_dim = static_cast<size_t>(layout.head_dim);
  ws.q8_offset = ws.key_range_offset +
                 (e4m3 ? region(sizeof(uint32_t) * layout.batch * layout.num_heads_kv * 2 * head_dim) : 0);
  const size_t key_blocks = static_cast<size_t>(layout.batch) * layout.max_k_blocks;
  ws.k8_offset = ws.q8_offset +
                 (e4m3 ? region(size_t(layout.num_q_blocks) * kBlockSize * layout.num_heads_q * head_dim) : 0);
  ws.q_scale_offset = ws.k8_offset +
                      (e4m3 ? region(key_blocks * kBlockSize * layout.num_heads_kv * head_dim) : 0);
  ws.k_scale_offset = ws.q_scale_offset +
                      (e4m3 ? region(sizeof(float) * layout.num_q_blocks * layout.num_heads_q) : 0);
  ws.total_bytes = ws.k_scale_offset +
                   (e4m3 ? region(sizeof(float) * key_blocks * layout.num_heads_kv) : 0);
  return ws;
}

// Device-side view of one launch of the scoring and selection kernels.
struct KapDeviceArgs {
  PagedLayout layout;
  int head_begin = 0;   // first query head of this chunk
  int head_count = 0;   // heads in this chunk
  int num_tiles = 0;    // grid bound of the scoring kernel: row tiles
  int tile_cols = 256;         // scoring column tile: 128 or 256
  int col_tiles_per_unit = 1;  // column tiles one scoring CTA walks
  int units_per_tile = 1;      // scoring CTAs per (query head, row tile): the grid's y
  float top_p = 0.95f;
  int32_t* order = nullptr;
  int32_t* counts = nullptr;
  const int32_t* q_block_start = nullptr;  // [batch + 1]
  const int32_t* tile_start = nullptr;     // [batch + 1]
  float* block_max = nullptr;              // [head_count, rows, max_k_blocks]
  uint32_t* row_max = nullptr;             // ordered_bits of rm, [head_count, rows]
  uint32_t* blocks_scored = nullptr;       // [Hq, num_q_blocks], zeroed by the index kernel
  int64_t block_max_rows = 0;
  // The e4m3 proxy's operands (WorkspaceLayout), null with the native one.
  uint32_t* key_range = nullptr;  // [batch, Hkv, 2, d]
  uint8_t* q8 = nullptr;
  uint8_t* k8 = nullptr;
  float* q_scale = nullptr;
  float* k_scale = nullptr;
};

// Order-preserving map of floats to unsigned integers, so that an integer atomicMax keeps a float
// maximum; 0 lies below every float (the value a zeroed buffer starts from).
__device__ __forceinline__ uint32_t ordered_bits(float value) {
  const uint32_t u = __float_as_uint(value);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float from_ordered_bits(uint32_t bits) {
  return __uint_as_float((bits & 0x80000000u) ? (bits & 0x7FFFFFFFu) : ~bits);
}

// Index of the sequence that owns item `index` of a packed numbering with prefix sums `start`
// (start[0] = 0, non-decreasing, start[batch] = total): the largest b with start[b] <= index.
__device__ __forceinline__ int find_sequence(const int32_t* start, int batch, int index) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(start + mid) <= index) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// floor(P / s) for a sequence of len_q queries and len_k keys: stride row r may see stride column c
// iff c <= r + floor(P / s) (spec section 2), in the scoring kernels' epilogues and the select
// kernels alike.
template <int kStride>
__device__ __forceinline__ int prefix_stride_cols(int len_q, int len_k) {
  return (len_k - len_q) / kStride;
}

// The row tile of a scoring CTA and its sequence's geometry in stride rows and columns, located
// once for the kernel body and its completion counters. blockIdx.z counts row tiles from the last (the
// longest rows first, so that the CTAs with the most column tiles start first), blockIdx.x is the
// chunk's query head; `valid` is false for a grid slot past the batch's tiles.
struct ScoreRowTile {
  bool valid = false;
  int head = 0, kv_head = 0;
  int b = 0;            // the sequence
  int q_begin = 0;      // its first query token
  int len_q = 0, len_k = 0;
  int prefix_cols = 0;  // floor(P / s): prefix_stride_cols
  int num_rows = 0;     // its stride rows
  int row0 = 0, row_last = 0;  // the tile's first and last stride rows in the sequence
  // Stride row r of sequence b is row first_row + r of bm and rm; with the e4m3 proxy its group of
  // queries is group first_row + r of the query copy.
  int64_t first_row = 0;
};
template <int kStride>
__device__ __forceinline__ ScoreRowTile locate_score_row_tile(const KapDeviceArgs& args) {
  const PagedLayout& L = args.layout;
  ScoreRowTile t;
  const int tile = args.num_tiles - 1 - static_cast<int>(blockIdx.z);
  if (tile >= __ldg(args.tile_start + L.batch)) return t;
  t.valid = true;
  t.head = args.head_begin + static_cast<int>(blockIdx.x);
  t.kv_head = t.head / (L.num_heads_q / L.num_heads_kv);
  t.b = find_sequence(args.tile_start, L.batch, tile);
  t.q_begin = __ldg(L.cu_seqlens_q + t.b);
  t.len_q = __ldg(L.cu_seqlens_q + t.b + 1) - t.q_begin;
  t.len_k = __ldg(L.seqused_k + t.b);
  t.prefix_cols = prefix_stride_cols<kStride>(t.len_q, t.len_k);
  t.num_rows = (t.len_q + kStride - 1) / kStride;
  t.row0 = (tile - __ldg(args.tile_start + t.b)) * kTileRows;
  t.row_last = min(t.row0 + kTileRows, t.num_rows) - 1;
  t.first_row = static_cast<int64_t>(__ldg(args.q_block_start + t.b)) * (kBlockSize / kStride);
  return t;
}

// The selection of a query block may start once every scoring CTA of its row tile is done, not the
// whole scoring grid (kap_select_kernel.cuh). Each warp of a scoring CTA counts itself done in the
// counters of its row tile's query blocks (one per query head and packed query block) when it
// leaves, after its block maxima stores and row-maximum atomics; a block's counter is complete at
// units_per_tile CTAs of kScoreWarps warps.
constexpr int kScoreWarps = kScoreThreads / 32;
__device__ __forceinline__ uint32_t* block_scored_counter(const KapDeviceArgs& args, int head,
                                                          int q_block) {
  return args.blocks_scored + static_cast<int64_t>(head) * args.layout.num_q_blocks + q_block;
}
__device__ __forceinline__ uint32_t block_scored_complete(const KapDeviceArgs& args) {
  return static_cast<uint32_t>(args.units_per_tile * kScoreWarps);
}
// Called by every warp of a scoring CTA of a real row tile on its way out, with inputs that passed
// the checks. Stride row r lies in query block r / (128 / s) of its sequence.
template <int kStride>
__device__ __forceinline__ void publish_score_warp_done(const KapDeviceArgs& args,
                                                        const ScoreRowTile& t) {
  constexpr int kRowsPerBlock = kBlockSize / kStride;
  __syncwarp();  // the lanes' stores and atomics are ordered before the release below
  const int first = static_cast<int>(t.first_row / kRowsPerBlock) + t.row0 / kRowsPerBlock;
  const int blocks = t.row_last / kRowsPerBlock - t.row0 / kRowsPerBlock + 1;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (lane < blocks) {
    uint32_t* counter = block_scored_counter(args, t.head, first + lane);
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
  }
}

// The frame of both scoring kernels: a dependent launch (common/dependent_launch.h) after the
// index kernel, the quantisation kernel or the previous head chunk's select kernel, so the prefix
// sums, the zeroed rm buffer and the bm buffer that the previous chunk's selection reads are
// settled only past the wait. The select kernel may launch as soon as every CTA here has started;
// its lists wait for their query blocks' counters, which every warp of a real row tile advances on
// its way out (where the inputs failed the checks the select kernels do not wait). `score_unit`
// runs the CTA's unit of column tiles on the located row tile.
template <int kStride, class ScoreUnit>
__device__ __forceinline__ void run_scoring_cta(const KapDeviceArgs& args, ScoreUnit&& score_unit) {
  cudaGridDependencySynchronize();
  cudaTriggerProgrammaticLaunchCompletion();
  if (inputs_rejected(args.layout)) return;
  const ScoreRowTile row_tile = locate_score_row_tile<kStride>(args);
  if (!row_tile.valid) return;  // a grid slot past the batch's tiles: no list waits on it
  score_unit(row_tile);
  publish_score_warp_done<kStride>(args, row_tile);
}

}  // namespace cosa::kap
