// KAP scoring pass: the strided (antidiagonal) proxy logits on tensor cores, reduced on chip to
// the per-key-block maxima bm[r, j] of every stride row (spec section 2, steps 1-3).
//
// One CTA owns a tile of 128 stride rows of one sequence and one query head and walks a unit of
// up to col_tiles_per_unit causal column tiles of kCols stride columns (the units of a row tile
// write disjoint key blocks, so they need no merge). Qs[r] . Ks[c] = sum_t Q[r*s + s-1-t] . K[c*s + t], so the GEMM
// reduction dimension (s * d) is walked as s chunks of d, each an ordinary Q K^T slice whose query
// rows are s tokens apart (offset s-1-t) and whose key rows are the t-th token of each s-group.
// The 16-bit operands are gathered with 16-byte cp.async straight into the 128-byte-swizzled
// layout that wgmma reads: queries through cu_seqlens_q, keys through the page table (an s-group
// never crosses a page since s <= 16 <= page_size and both are powers of two). Positions past
// Lq/Lk are zero-filled, as the spec's zero rows. The pipeline is one flat sequence of (column
// tile, K slice) steps, so the loads of the next column tile overlap the epilogue of the current
// one. With the e4m3 proxy the operands are the quantisation pass's copies (kap_quantize_kernel.cuh),
// laid out per query block and per key block with zeros past Lq and Lk, and the epilogue multiplies
// each block maximum by its query and key blocks' scales. A 128-byte row then holds 128 elements:
// at d = 128 a K slice is one token of every group, a box of a 4-D view of the copy (channel,
// token in group, head, group) loaded by TMA, so the gather no longer takes the consumers' issue
// slots, and the steps need no CTA-wide barrier: each warpgroup releases a stage once its MMAs on
// it have completed, and the second release refills it, so one warpgroup's epilogue may overlap
// the other's MMAs. At d = 64 a K slice spans two tokens of a group, in opposite orders for
// queries and keys, and is gathered with cp.async as the 16-bit operands are.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/async_copy.cuh"
#include "common/input_gate.cuh"
#include "common/tma_pipeline.cuh"
#include "kap/kap_block_maxima.cuh"
#include "kap/kap_mma.cuh"
#include "kap/kap_traits.h"

namespace cosa::kap {

// One warpgroup's release of a stage whose MMAs have completed: the elected thread adds one to the
// stage's release count; the second release of a fill (odd old count) loads the stage again, if
// a load is left, as the A and B boxes of the TMA tensors. All predicated, no branch.
__device__ __forceinline__ void release_stage_and_refill(bool elected, uint32_t* releases, bool load_left,
                                                         uint64_t* full, uint32_t bytes,
                                                         uint32_t a_dst, const void* map_a, int a1,
                                                         int a2, int a3, uint32_t b_dst,
                                                         const void* map_b, int b1, int b2, int b3) {
  asm volatile(
      "{\n\t.reg .pred elected, refill;\n\t.reg .b32 old;\n\t"
      "setp.ne.u32 elected, %0, 0;\n\t"
      "mov.u32 old, 0;\n\t"
      "@elected atom.acq_rel.cta.shared::cta.add.u32 old, [%1], 1;\n\t"
      "and.b32 old, old, %2;\n\t"
      "setp.ne.u32 refill, old, 0;\n\t"
      "@refill mbarrier.arrive.expect_tx.shared::cta.b64 _, [%3], %4;\n\t"
      "@refill cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%5], [%6, {%7, %8, %9, %10}], [%3];\n\t"
      "@refill cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%11], [%12, {%13, %14, %15, %16}], [%3];\n\t}\n" ::"r"(static_cast<uint32_t>(elected)),
      "r"(smem_addr(releases)), "r"(static_cast<uint32_t>(load_left)), "r"(smem_addr(full)), "r"(bytes),
      "r"(a_dst), "l"(reinterpret_cast<uint64_t>(map_a)), "r"(0), "r"(a1), "r"(a2), "r"(a3),
      "r"(b_dst), "l"(reinterpret_cast<uint64_t>(map_b)), "r"(0), "r"(b1), "r"(b2), "r"(b3)
      : "memory");
}

// One scoring CTA's unit of column tiles (kap_score_kernel).
template <ProxyElement kElement, int kHeadDim, int kStride, int kCols>
__device__ __forceinline__ void score_unit(const KapDeviceArgs& args, const ScoreOperandMaps& maps,
                                           const ScoreRowTile& row_tile) {
  using Elements = ProxyElementTraits<kElement>;
  constexpr bool kE4M3 = kElement == ProxyElement::kE4M3;
  constexpr int kRowElems = Elements::kRowElems;              // elements of one K slice row
  constexpr int kChunkElems = 16 / Elements::kBytes;          // elements of one 16-byte copy
  static_assert((kStride * kHeadDim) % kRowElems == 0, "a group's s * d must fill whole rows");
  constexpr bool kTmaLoads = kTmaOperands<kElement, kHeadDim>;
  using Tile = ScoreTile<kCols, kTmaLoads>;
  constexpr int kTileCols = Tile::kTileCols;
  constexpr int kStages = Tile::kStages;
  constexpr int kStageBytes = Tile::kStageBytes;
  constexpr int kRowsPerBlock = kBlockSize / kStride;       // stride rows (and columns) per block
  constexpr int kSteps = kStride * kHeadDim / kRowElems;     // K slices per column tile
  constexpr int kGroups = kTileCols / kRowsPerBlock;         // key blocks per column tile
  constexpr int kFragsPerGroup = kRowsPerBlock / 8;          // 8-column fragments per key block
  constexpr int kLoadRows = kScoreThreads / 8;               // rows one load pass covers
  constexpr int kLoadsA = kTileRows / kLoadRows;             // per thread and step
  constexpr int kLoadsB = kTileCols / kLoadRows;

  const PagedLayout& L = args.layout;
  const int head = row_tile.head, kv_head = row_tile.kv_head, b = row_tile.b;
  const int q_begin = row_tile.q_begin, len_q = row_tile.len_q, len_k = row_tile.len_k;
  const int prefix_cols = row_tile.prefix_cols, num_rows = row_tile.num_rows;
  const int row0 = row_tile.row0, row_last = row_tile.row_last;
  const int64_t first_row = row_tile.first_row;
  const int col_tile_begin = static_cast<int>(blockIdx.y) * args.col_tiles_per_unit;
  const int num_col_tiles =
      min((row_last + prefix_cols) / kTileCols + 1 - col_tile_begin, args.col_tiles_per_unit);
  if (num_col_tiles <= 0) return;
  const int total_steps = num_col_tiles * kSteps;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));
  const uint32_t smem_base = smem_addr(smem);
  // Stage st: A (Qs slice) at st * kStageBytes, B (Ks slice) right after it.
  auto a_stage = [&](int st) { return smem_base + st * kStageBytes; };
  auto b_stage = [&](int st) { return smem_base + st * kStageBytes + kTileABytes; };

  const int tid = threadIdx.x;
  // Load assignment: thread tid copies 16-byte chunk (tid % 8) of rows tid / 8 + kLoadRows * i.
  const int load_chunk = tid % 8;
  const int load_row = tid / 8;
  const uint32_t load_smem_offset =
      load_row * 128 + ((load_chunk ^ (load_row % 8)) * 16);  // kLoadRows % 8 == 0: same swizzle

  // Element k of the s * d long antidiagonal vector of a row is element k % d of token k / d of its
  // group; 16-byte chunk `load_chunk` of K slice `slice` starts at k = slice * kRowElems +
  // load_chunk * kChunkElems (one token per chunk: d is a multiple of kChunkElems).
  using Elem = std::conditional_t<kE4M3, uint8_t, uint16_t>;
  const Elem* q_ptr = kE4M3 ? reinterpret_cast<const Elem*>(args.q8) : static_cast<const Elem*>(L.q);
  const Elem* k_ptr =
      kE4M3 ? reinterpret_cast<const Elem*>(args.k8) : static_cast<const Elem*>(L.k_cache);
  // Element strides of the operands: the inputs', or the e4m3 copies' ([tokens, heads, d]).
  const int64_t q_row_stride = kE4M3 ? int64_t(L.num_heads_q) * kHeadDim : L.q_row_stride;
  const int64_t q_head_stride = kE4M3 ? int64_t(kHeadDim) : L.q_head_stride;
  const int64_t k_row_stride = kE4M3 ? int64_t(L.num_heads_kv) * kHeadDim : L.k_row_stride;
  const int64_t k_head_stride = kE4M3 ? int64_t(kHeadDim) : L.k_head_stride;

  // Query rows: Qs[r] token t of the group is query r*s + s-1-t, valid iff it is < len_q, i.e. iff
  // t >= r*s + s - len_q.
  // Row starts are held as 16-byte-chunk offsets from the operand's base (32 bits, 64 GB of reach)
  // rather than as pointers: half the registers, which keeps the 256-column tile from spilling.
  const int64_t q_token_begin = kE4M3 ? first_row * kStride : q_begin;  // the copy: by query block
  uint32_t q_base[kLoadsA];
  int q_first_valid[kLoadsA];
#pragma unroll
  for (int i = 0; i < kLoadsA; ++i) {
    const int r = row0 + load_row + kLoadRows * i;
    const int64_t token = static_cast<int64_t>(r) * kStride + kStride - 1;
    q_first_valid[i] = r * kStride + kStride - len_q;
    q_base[i] = static_cast<uint32_t>(((q_token_begin + token) * q_row_stride + head * q_head_stride) /
                                      kChunkElems);
  }
  // Key columns of the column tile being loaded: Ks[c] token t of the group is key c*s + t, valid
  // iff t < len_k - c*s. Resolved through the page table (or the e4m3 copy's rows) once per
  // column tile.
  uint32_t k_base[kLoadsB];
  int k_valid_count[kLoadsB];
  const int32_t* page_row = L.page_table + static_cast<int64_t>(b) * L.page_table_stride;
  const KeyPaging paging = key_paging(L);
  auto resolve_key_columns = [&](int col_tile) {
    // The page numbers first, then the offsets: resolved in one loop, each column would wait for
    // its page number before the next one's load issued.
    [[maybe_unused]] int page[kLoadsB];  // 16-bit operands only
#pragma unroll
    for (int i = 0; i < kLoadsB; ++i) {
      const int key = (col_tile * kTileCols + load_row + kLoadRows * i) * kStride;
      k_valid_count[i] = len_k - key;
      if constexpr (!kE4M3) page[i] = key < len_k ? __ldg(page_row + paging.page_index(key)) : 0;
    }
#pragma unroll
    for (int i = 0; i < kLoadsB; ++i) {
      const int key = (col_tile * kTileCols + load_row + kLoadRows * i) * kStride;
      int64_t offset = 0;
      if (key < len_k) {
        if constexpr (kE4M3) {
          offset = (static_cast<int64_t>(b) * L.max_k_blocks * kBlockSize + key) * k_row_stride;
        } else {
          offset = page[i] * L.k_page_stride + paging.row(key) * L.k_row_stride;
        }
      }
      k_base[i] = static_cast<uint32_t>((offset + kv_head * k_head_stride) / kChunkElems);
    }
  };

  // TMA: stage st is full once its A and B boxes have landed (one arrival, the loading thread's,
  // plus the boxes' bytes). No CTA-wide barrier per step: each warpgroup counts its release of a
  // stage (once its MMAs on it have completed) in stage_releases, and the second to release a
  // fill loads the stage again, kStages steps ahead, so that one warpgroup's epilogue may overlap
  // the other's MMAs.
  __shared__ alignas(8) uint64_t stage_full[kTmaLoads ? kStages : 1];
  __shared__ uint32_t stage_releases[kTmaLoads ? kStages : 1];
  const int64_t k_first_group = static_cast<int64_t>(b) * L.max_k_blocks * kRowsPerBlock;
  // Where step `load`'s boxes come from: slice t is query token s-1-t and key token t of every
  // group (kSteps == s here), the key groups of its column tile.
  struct StepBoxes {
    int query_token, key_token, key_group;
  };
  auto step_boxes = [&](int load) {
    const int slice = load % kSteps;
    return StepBoxes{kStride - 1 - slice, slice,
                     static_cast<int>(k_first_group + (col_tile_begin + load / kSteps) * kTileCols)};
  };
  const int query_group = static_cast<int>(first_row + row0);
  auto tma_load = [&](int load) {
    const int stage = load % kStages;
    const StepBoxes box = step_boxes(load);
    MBarrier::arrive_expect_tx(&stage_full[stage], kStageBytes);
    tma_load_4d(a_stage(stage), &maps.q, &stage_full[stage], 0, box.query_token, head, query_group);
    tma_load_4d(b_stage(stage), &maps.k, &stage_full[stage], 0, box.key_token, kv_head, box.key_group);
  };
  if constexpr (kTmaLoads) {
    if (tid == 0) {
#pragma unroll
      for (int st = 0; st < kStages; ++st) {
        MBarrier::init(&stage_full[st], 1);
        stage_releases[st] = 0;
      }
      MBarrier::fence_init();
      for (int load = 0; load < min(kStages, total_steps); ++load) tma_load(load);
    }
    __syncthreads();
  }
  int released = 0;  // TMA, warp 0 of each warpgroup: steps [0, released) released by the warpgroup
  // Only warp 0 of each warpgroup runs the release: its elected thread is the one that counts and
  // refills, and the other warps would only run the uniform-operand loops that ptxas builds around
  // the TMA issue. The shuffle makes the test warp-uniform and the release itself is predicated: a
  // divergent branch between two steps' wgmmas makes ptxas serialise them (C7518).
  const bool release_warp = __shfl_sync(0xffffffffu, (tid / 32) % 4, 0) == 0;
  auto release_through = [&](int last) {
    if (!release_warp) return;
    for (; released <= last; ++released) {
      const int load = released + kStages;
      const int stage = released % kStages;
      const StepBoxes box = step_boxes(load);
      release_stage_and_refill(tid % 128 == 0, &stage_releases[stage], load < total_steps,
                               &stage_full[stage], kStageBytes, a_stage(stage), &maps.q,
                               box.query_token, head, query_group, b_stage(stage), &maps.k,
                               box.key_token, kv_head, box.key_group);
    }
  };

  int load_step = 0;  // next step to load
  int loaded_col_tile = -1;
  auto load_next = [&]() {  // cp.async: every thread its chunks of step load_step
    if (load_step < total_steps) {
      const int col_tile = col_tile_begin + load_step / kSteps;
      const int slice = load_step % kSteps;
      if (col_tile != loaded_col_tile) {
        resolve_key_columns(col_tile);
        loaded_col_tile = col_tile;
      }
      const int element = slice * kRowElems + load_chunk * kChunkElems;
      const int t = element / kHeadDim;
      const int dim = element % kHeadDim;
      const int stage = load_step % kStages;
      const uint32_t a_dst = a_stage(stage) + load_smem_offset;
      const uint32_t b_dst = b_stage(stage) + load_smem_offset;
      const int64_t q_offset = -static_cast<int64_t>(t) * q_row_stride + dim;
      const int64_t k_offset = static_cast<int64_t>(t) * k_row_stride + dim;
#pragma unroll
      for (int i = 0; i < kLoadsA; ++i) {
        const bool q_valid = t >= q_first_valid[i];
        const Elem* src = q_ptr + static_cast<int64_t>(q_base[i]) * kChunkElems + q_offset;
        cp_async_16_zfill(a_dst + i * kLoadRows * 128, q_valid ? src : q_ptr,
                          q_valid);
      }
#pragma unroll
      for (int i = 0; i < kLoadsB; ++i) {
        const bool k_valid = t < k_valid_count[i];
        const Elem* src = k_ptr + static_cast<int64_t>(k_base[i]) * kChunkElems + k_offset;
        cp_async_16_zfill(b_dst + i * kLoadRows * 128, k_valid ? src : k_ptr,
                          k_valid);
      }
    }
    cp_async_commit();  // possibly empty: keeps one group per step
    ++load_step;
  };

  // Epilogue geometry of this thread (wgmma accumulator layout, see wgmma_m64n256k16).
  const int warpgroup = tid / 128;
  const int lane = tid % 32;
  const int row_in_tile = warpgroup * 64 + ((tid % 128) / 32) * 16 + lane / 4;  // + 8 for half 1
  const float logit_scale = L.softmax_scale / kStride;
  float* block_max_head = args.block_max + static_cast<int64_t>(blockIdx.x) * args.block_max_rows *
                                               L.max_k_blocks;
  uint32_t* row_max_head = args.row_max + static_cast<int64_t>(blockIdx.x) * args.block_max_rows;

  if constexpr (!kTmaLoads) {
#pragma unroll
    for (int s = 0; s < kStages - 2; ++s) load_next();
  }

  float acc[kTileCols / 2];
#pragma unroll
  for (int i = 0; i < kTileCols / 2; ++i) acc[i] = 0.f;

  // The e4m3 scales a tile's epilogue multiplies by: the key blocks 4q + (lane & 3) of this
  // lane's quad and the query blocks of its two rows. The TMA kernels load them while the tile's
  // last MMAs run, so that their latency is off the epilogue's path; the gathering ones (d = 64)
  // where each is used, since holding them through the wait would spill. Past max_k_blocks (a
  // tile reaching beyond the sequence's keys) the index is clamped: those blocks have no allowed
  // column.
  auto key_scale = [&](int col0, int q) {
    const int key_block = min(col0 / kRowsPerBlock + 4 * q + (lane & 3), L.max_k_blocks - 1);
    return __ldg(args.k_scale +
                 (static_cast<int64_t>(b) * L.max_k_blocks + key_block) * L.num_heads_kv + kv_head);
  };
  auto query_scale = [&](int half) {
    const int r = min(row0 + row_in_tile + 8 * half, num_rows - 1);
    return __ldg(args.q_scale + (first_row + r) / kRowsPerBlock * L.num_heads_q + head);
  };
  struct TileScales {
    float key[kGroups / 4];
    float row[2];
  };
  auto load_tile_scales = [&](int col0) {
    TileScales scales;
#pragma unroll
    for (int q = 0; q < kGroups / 4; ++q) scales.key[q] = key_scale(col0, q);
#pragma unroll
    for (int half = 0; half < 2; ++half) scales.row[half] = query_scale(half);
    return scales;
  };

  // A column tile's epilogue, in two parts. tile_pair_maxima reads the accumulators: per row half
  // and key block, the max over this thread's allowed columns c <= r + P/s (kMasked: the tile
  // reaches past a row's causal limit, so that each column must be tested), then the first of the
  // two exchanges between the four lanes of a row (kap_block_maxima.cuh). publish_block_maxima
  // does the second, scales, and writes bm and the row's best into rm; it reads no accumulator, so
  // the TMA kernels run it once the next column tile's first MMAs are issued, and the tensor cores
  // work through it.
  struct TilePairMaxima {
    float pair[2][kGroups / 2];
  };
  auto tile_pair_maxima = [&](int col0, auto masked) {
    constexpr bool kMasked = decltype(masked)::value;
    TilePairMaxima maxima;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int col_limit = row0 + row_in_tile + 8 * half + prefix_cols - col0;
      pair_block_maxima<kGroups, kFragsPerGroup, kMasked>(acc, half, col_limit, lane,
                                                          maxima.pair[half]);
    }
    return maxima;
  };
  auto publish_block_maxima = [&](int col0, const TileScales& scales, const TilePairMaxima& maxima) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row0 + row_in_tile + 8 * half;
      const int col_limit = r + prefix_cols - col0;
      float quad_max[kGroups / 4];
      quad_block_maxima<kGroups>(maxima.pair[half], lane, quad_max);
      if constexpr (kE4M3) {
        // Each reduction step above combined one key block across lanes, so the lane's blocks
        // 4q + (lane & 3) take their scales now (> 0: a block's max times its scale is the max of
        // its scaled logits). Blocks past Lk have no scale, and no allowed column either.
#pragma unroll
        for (int q = 0; q < kGroups / 4; ++q) {
          if (quad_max[q] != -INFINITY) {
            quad_max[q] *= kTmaLoads ? scales.key[q] : key_scale(col0, q);
          }
        }
      }
      float row_best = -INFINITY;  // blocks without an allowed column hold -inf
#pragma unroll
      for (int q = 0; q < kGroups / 4; ++q) row_best = fmaxf(row_best, quad_max[q]);
      row_best = fmaxf(row_best, __shfl_xor_sync(0xffffffffu, row_best, 1));
      row_best = fmaxf(row_best, __shfl_xor_sync(0xffffffffu, row_best, 2));
      // The row's logits scale: sigma / s, times (e4m3) its query block's scale.
      float row_scale = logit_scale;
      if constexpr (kE4M3) { row_scale *= kTmaLoads ? scales.row[half] : query_scale(half); }
      if (r < num_rows) {
        float* out_row = block_max_head + (first_row + r) * L.max_k_blocks + col0 / kRowsPerBlock;
#pragma unroll
        for (int q = 0; q < kGroups / 4; ++q) {
          const int g = 4 * q + (lane & 3);
          // Block g has an allowed column iff its first column is allowed.
          if (g * kRowsPerBlock <= col_limit) out_row[g] = quad_max[q] * row_scale;
        }
        if ((lane & 3) == 0 && row_best > -INFINITY) {
          atomicMax(row_max_head + first_row + r, ordered_bits(row_best * row_scale));
        }
      }
    }
  };

  // TMA kernels: a column tile's maxima are published during the next tile's first MMAs (the
  // scoring kernel 2.3% faster at 32K, fp8). The gathering kernels, whose warpgroups meet at a CTA
  // barrier every step, were 1-5% slower with it: they publish at once.
  constexpr bool kPublishLate = kTmaLoads;
  TilePairMaxima pending_maxima;
  TileScales pending_scales;
  int pending_col0 = 0;
  for (int step = 0; step < total_steps; ++step) {
    const int stage = step % kStages;
    const int slice = step % kSteps;
    if constexpr (kTmaLoads) {
      MBarrier::wait(&stage_full[stage], (step / kStages) & 1);
    } else {
      cp_async_wait<kStages - 3>();
      fence_proxy_async_shared();
      __syncthreads();  // stage `step` is complete; every warpgroup has finished step - 2
    }

    wgmma_fence();
    wgmma_fence_operands(acc);
    const uint64_t desc_a = sw128_kmajor_desc(a_stage(stage) + warpgroup * 64 * kTileRowBytes);
    const uint64_t desc_b = sw128_kmajor_desc(b_stage(stage));
#pragma unroll
    for (int k = 0; k < kRowElems / Elements::kMmaK; ++k) {
      proxy_mma<kElement, kTileCols>(acc, desc_a + 2 * k, desc_b + 2 * k, slice > 0 || k > 0);
    }
    wgmma_commit();
    wgmma_fence_operands(acc);
    if constexpr (kPublishLate) {
      if (slice == 0 && step > 0) publish_block_maxima(pending_col0, pending_scales, pending_maxima);
    }
    if constexpr (!kTmaLoads) load_next();  // into the stage of step - 2
    if (slice != kSteps - 1) {
      wgmma_wait<1>();
      if constexpr (kTmaLoads) release_through(step - 1);
      continue;
    }
    const int col_tile = col_tile_begin + step / kSteps;
    const int col0 = col_tile * kTileCols;
    TileScales scales;
    if constexpr (kTmaLoads) { scales = load_tile_scales(col0); }
    wgmma_wait<0>();
    wgmma_fence_operands(acc);
    if constexpr (kTmaLoads) {
      release_through(step);
    }

    // Epilogue of column tile `col_tile`: per row and key block, the max over allowed columns
    // c <= r + P/s. scale > 0, so max(x) * scale == max(x * scale) exactly. Only the tiles that
    // reach past a row's causal limit (the last one or two of a row tile) test each column; the
    // others take a path without the per-column compare and select (12% fewer instructions in
    // the whole kernel at 32K tokens).
    TilePairMaxima maxima;
    if (col0 + kTileCols - 1 > row0 + prefix_cols) {
      maxima = tile_pair_maxima(col0, std::true_type{});
    } else {
      maxima = tile_pair_maxima(col0, std::false_type{});
    }
    if constexpr (kPublishLate) {
      pending_maxima = maxima;
      pending_scales = scales;
      pending_col0 = col0;
    } else {
      publish_block_maxima(col0, scales, maxima);
    }
  }
  // The loop ends after a column tile's wait, but ptxas cannot tell: without this wait it assumed
  // that MMAs could still be in flight on the way out and waited for them at the end of every
  // step (C7517, "warpgroup.wait is injected"), which left one K slice of MMAs in flight per
  // warpgroup instead of two.
  wgmma_wait<0>();
  if constexpr (kPublishLate) publish_block_maxima(pending_col0, pending_scales, pending_maxima);
  if constexpr (!kTmaLoads) cp_async_wait<0>();
}

template <ProxyElement kElement, int kHeadDim, int kStride, int kCols>
__global__ void __launch_bounds__(kScoreThreads,
                                   (ScoreTile<kCols, kTmaOperands<kElement, kHeadDim>>::kCtasPerSm))
    kap_score_kernel(const KapDeviceArgs args, const __grid_constant__ ScoreOperandMaps maps) {
  run_scoring_cta<kStride>(args, [&](const ScoreRowTile& row_tile) {
    score_unit<kElement, kHeadDim, kStride, kCols>(args, maps, row_tile);
  });
}

}  // namespace cosa::kap
