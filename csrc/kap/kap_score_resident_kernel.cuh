// KAP scoring pass for the default proxy's common case (the e4m3 copies at d = 128, s <= 8, 256-column
// tiles): the same block maxima bm[r, j] and row maxima rm[r] as kap_score_kernel.cuh, which has
// the GEMM's decomposition (Qs[r] . Ks[c] = sum_t Q[r*s + s-1-t] . K[c*s + t], s K slices of d)
// and serves every other case, with the work split between the two consumer warpgroups by columns
// instead of rows.
//
// A K slice is one token of every group: a box of a 4-D view of the copy (channel, token in group,
// head, group), loaded by TMA. One CTA owns 128 stride rows of one sequence and one query head and
// a unit of up to col_tiles_per_unit 256-column tiles. The rows' whole reduction (s slices of 128
// rows x 128 bytes, at most 128 KB) is loaded once and stays in shared memory for the unit. Each
// warpgroup computes all 128 rows (two m64 x n128 wgmmas per k32 step) for every other 128-column
// half of the unit, from a ring of key stages that only it consumes and refills. A half past every
// row's causal limit is not computed at all (3-4% of the proxy's work at 32K tokens, more at 8K),
// and the two warpgroups share nothing but the resident query slices, so each drifts at its own
// pace. The copies are laid out per query block and per key block with zeros past Lq and Lk
// (kap_quantize_kernel.cuh), so a box carries the spec's zero rows; what it reads beyond a
// sequence's last block lands only in rows and columns that the epilogue drops or masks. The
// epilogue multiplies each block maximum by its query and key blocks' scales.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/async_copy.cuh"
#include "common/input_gate.cuh"
#include "common/tma_pipeline.cuh"
#include "kap/kap_block_maxima.cuh"
#include "kap/kap_mma.cuh"
#include "kap/kap_traits.h"

namespace cosa::kap {

// Loads one key box into a warpgroup's stage, if `issue`: predicated, so that no divergent branch
// sits between two steps' wgmmas (ptxas would serialise them, C7518).
__device__ __forceinline__ void refill_key_stage(bool issue, uint64_t* full, uint32_t bytes,
                                                 uint32_t dst, const void* map, int c1, int c2,
                                                 int c3) {
  asm volatile(
      "{\n\t.reg .pred issue;\n\t"
      "setp.ne.u32 issue, %0, 0;\n\t"
      "@issue mbarrier.arrive.expect_tx.shared::cta.b64 _, [%1], %2;\n\t"
      "@issue cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%3], [%4, {%5, %6, %7, %8}], [%1];\n\t}\n" ::"r"(static_cast<uint32_t>(issue)),
      "r"(smem_addr(full)), "r"(bytes), "r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(0),
      "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// One scoring CTA's unit of column tiles (kap_score_resident_kernel).
template <int kStride>
__device__ __forceinline__ void score_resident_unit(const KapDeviceArgs& args,
                                                    const ScoreOperandMaps& maps,
                                                    const ScoreRowTile& row_tile) {
  using Tile = ResidentScoreTile<kStride>;
  constexpr int kAccs = kTileRows / 64;               // 64-row accumulators
  constexpr int kSteps = kStride;                     // K slices per column half (one token per group)
  constexpr int kStages = Tile::kStagesPerWarpgroup;
  static_assert(kStages <= kSteps, "the prologue fills each ring beside the first query slices");
  constexpr int kCols = Tile::kHalfCols;
  constexpr int kRowsPerBlock = kBlockSize / kStride;  // stride rows (and columns) per block
  constexpr int kGroups = kCols / kRowsPerBlock;       // key blocks per column half
  constexpr int kFragsPerGroup = kRowsPerBlock / 8;    // 8-column fragments per key block
  constexpr int kAccRegs = kCols / 2;                  // one m64 x n128 fp32 accumulator
  static_assert(kGroups % 4 == 0, "a quad of lanes shares the key blocks of a half");

  const PagedLayout& L = args.layout;
  const int head = row_tile.head, kv_head = row_tile.kv_head, b = row_tile.b;
  const int prefix_cols = row_tile.prefix_cols, num_rows = row_tile.num_rows;
  const int row0 = row_tile.row0, row_last = row_tile.row_last;
  const int64_t first_row = row_tile.first_row;
  // The unit's column tiles, counted by the launch 256 columns wide, as 128-column halves; only
  // the halves that hold an allowed column of some row of the tile.
  const int half_begin = 2 * static_cast<int>(blockIdx.y) * args.col_tiles_per_unit;
  const int half_end =
      min(half_begin + 2 * args.col_tiles_per_unit, (row_last + prefix_cols) / kCols + 1);
  if (half_end <= half_begin) return;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));
  const uint32_t smem_base = smem_addr(smem);
  // The query tile's K slices first (slice t: query token s-1-t of every group), then the key
  // stages of warpgroup 0, then those of warpgroup 1.
  auto query_slice = [&](int slice) { return smem_base + slice * Tile::kSliceBytes; };
  auto key_stage = [&](int wg, int stage) {
    return smem_base + Tile::kQueryBytes + (wg * kStages + stage) * Tile::kStageBytes;
  };
  __shared__ alignas(8) uint64_t query_full[kSteps];
  __shared__ alignas(8) uint64_t stage_full[2][kStages];

  const int tid = threadIdx.x;
  // Warp-uniform (a value broadcast from lane 0), so that ptxas builds the descriptors in uniform
  // registers and sees no divergence around the wgmmas.
  const int warpgroup = __shfl_sync(0xffffffffu, tid / 128, 0);
  auto first_half_of = [&](int wg) { return half_begin + wg; };
  auto steps_of = [&](int wg) {
    const int first = first_half_of(wg);
    return first < half_end ? (half_end - first + 1) / 2 * kSteps : 0;
  };
  const int64_t k_first_group = static_cast<int64_t>(b) * L.max_k_blocks * kRowsPerBlock;
  // Step `step` of warpgroup `wg`: key token `step % s` of every group of its (step / s)-th half.
  auto key_group_of = [&](int wg, int step) {
    return static_cast<int>(k_first_group +
                            static_cast<int64_t>(first_half_of(wg) + 2 * (step / kSteps)) * kCols);
  };
  const int query_group = static_cast<int>(first_row + row0);

  if (tid == 0) {
#pragma unroll
    for (int slice = 0; slice < kSteps; ++slice) MBarrier::init(&query_full[slice], 1);
#pragma unroll
    for (int wg = 0; wg < 2; ++wg) {
#pragma unroll
      for (int st = 0; st < kStages; ++st) MBarrier::init(&stage_full[wg][st], 1);
    }
    MBarrier::fence_init();
    // Slice by slice, each query slice beside the key boxes of the steps that need it first.
    const int steps[2] = {steps_of(0), steps_of(1)};
#pragma unroll 1
    for (int slice = 0; slice < kSteps; ++slice) {
      MBarrier::arrive_expect_tx(&query_full[slice], Tile::kSliceBytes);
      tma_load_4d(query_slice(slice), &maps.q, &query_full[slice], 0, kStride - 1 - slice, head,
                  query_group);
      if (slice < kStages) {
#pragma unroll
        for (int wg = 0; wg < 2; ++wg) {
          refill_key_stage(slice < steps[wg], &stage_full[wg][slice], Tile::kStageBytes,
                           key_stage(wg, slice), &maps.k, slice % kSteps, kv_head,
                           key_group_of(wg, slice));
        }
      }
    }
  }
  __syncthreads();
  const int total_steps = steps_of(warpgroup);
  if (total_steps == 0) return;

  // Only warp 0 of the warpgroup refills its ring (its first thread issues the box): the other
  // warps would only run the loop that ptxas builds around the TMA issue.
  const bool release_warp = __shfl_sync(0xffffffffu, (tid / 32) % 4, 0) == 0;
  int released = 0;  // warp 0: steps [0, released) of this warpgroup released
  auto release_through = [&](int last) {
    if (!release_warp) return;
    for (; released <= last; ++released) {
      const int load = released + kStages;
      const int stage = released % kStages;
      refill_key_stage(tid % 128 == 0 && load < total_steps, &stage_full[warpgroup][stage],
                       Tile::kStageBytes, key_stage(warpgroup, stage), &maps.k, load % kSteps,
                       kv_head, key_group_of(warpgroup, load));
    }
  };

  // Epilogue geometry: the thread holds rows 64 * m + 16 * (warp % 4) + lane / 4 + 8 * half of the
  // tile in accumulator m (wgmma accumulator layout, kap_mma.cuh).
  const int lane = tid % 32;
  auto row_of = [&](int m, int half) {
    return row0 + 64 * m + 16 * ((tid / 32) % 4) + lane / 4 + 8 * half;
  };
  float* block_max_head = args.block_max + static_cast<int64_t>(blockIdx.x) * args.block_max_rows *
                                               L.max_k_blocks;
  uint32_t* row_max_head = args.row_max + static_cast<int64_t>(blockIdx.x) * args.block_max_rows;
  // Each row's logits scale, sigma / s times its query block's e4m3 scale, fixed for the unit.
  float row_scale[kAccs][2];
#pragma unroll
  for (int m = 0; m < kAccs; ++m) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = min(row_of(m, half), num_rows - 1);
      row_scale[m][half] = L.softmax_scale / kStride *
                           __ldg(args.q_scale + (first_row + r) / kRowsPerBlock * L.num_heads_q + head);
    }
  }
  // The e4m3 scales of the key blocks 4q + (lane & 3) of a half (clamped past max_k_blocks: those
  // blocks have no allowed column), loaded while the half's last MMAs run.
  struct KeyScales {
    float key[kGroups / 4];
  };
  auto load_key_scales = [&](int col0) {
    KeyScales scales;
#pragma unroll
    for (int q = 0; q < kGroups / 4; ++q) {
      const int key_block = min(col0 / kRowsPerBlock + 4 * q + (lane & 3), L.max_k_blocks - 1);
      scales.key[q] = __ldg(args.k_scale +
                            (static_cast<int64_t>(b) * L.max_k_blocks + key_block) * L.num_heads_kv +
                            kv_head);
    }
    return scales;
  };

  // A half's maxima in two parts: half_pair_maxima reads the accumulators (per row and key block,
  // the max over the thread's allowed columns, and the first exchange, kap_block_maxima.cuh);
  // publish_block_maxima does the second exchange, scales and stores bm, and folds each row's best
  // into row_best; it reads no accumulator and runs under the next half's first MMAs.
  struct HalfPairMaxima {
    float pair[kAccs][2][kGroups / 2];
  };
  auto half_pair_maxima = [&](const auto& acc, int m, int col0, auto masked,
                              HalfPairMaxima& maxima) {
    constexpr bool kMasked = decltype(masked)::value;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      pair_block_maxima<kGroups, kFragsPerGroup, kMasked>(
          acc, half, row_of(m, half) + prefix_cols - col0, lane, maxima.pair[m][half]);
    }
  };
  float row_best[kAccs][2];  // key-scaled, not yet by the row's scale
#pragma unroll
  for (int m = 0; m < kAccs; ++m) row_best[m][0] = row_best[m][1] = -INFINITY;
  auto publish_block_maxima = [&](int col0, const KeyScales& scales, const HalfPairMaxima& maxima) {
#pragma unroll
    for (int m = 0; m < kAccs; ++m) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = row_of(m, half);
        const int col_limit = r + prefix_cols - col0;
        float quad_max[kGroups / 4];
        quad_block_maxima<kGroups>(maxima.pair[m][half], lane, quad_max);
#pragma unroll
        for (int q = 0; q < kGroups / 4; ++q) {
          // Blocks past Lk have no scale, and no allowed column either.
          if (quad_max[q] != -INFINITY) quad_max[q] *= scales.key[q];
          row_best[m][half] = fmaxf(row_best[m][half], quad_max[q]);
        }
        if (r < num_rows) {
          float* out_row = block_max_head + (first_row + r) * L.max_k_blocks + col0 / kRowsPerBlock;
#pragma unroll
          for (int q = 0; q < kGroups / 4; ++q) {
            const int g = 4 * q + (lane & 3);
            // Block g has an allowed column iff its first column is allowed.
            if (g * kRowsPerBlock <= col_limit) out_row[g] = quad_max[q] * row_scale[m][half];
          }
        }
      }
    }
  };

  float acc[kAccs][kAccRegs];  // CTA rows 64 m .. 64 m + 63 x the half's columns
#pragma unroll
  for (int m = 0; m < kAccs; ++m) {
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) acc[m][i] = 0.f;
  }
  auto fence_accumulators = [&]() {
#pragma unroll
    for (int m = 0; m < kAccs; ++m) wgmma_fence_operands(acc[m]);
  };
  HalfPairMaxima pending_maxima;
  KeyScales pending_scales;
  int pending_col0 = 0;
  for (int step = 0; step < total_steps; ++step) {
    const int stage = step % kStages;
    const int slice = step % kSteps;
    MBarrier::wait(&stage_full[warpgroup][stage], (step / kStages) & 1);
    MBarrier::wait(&query_full[slice], 0);  // a single phase: at once after the first half

    wgmma_fence();
    fence_accumulators();
    const uint64_t desc_b = sw128_kmajor_desc(key_stage(warpgroup, stage));
#pragma unroll
    for (int k = 0; k < kTileRowBytes / 32; ++k) {  // k32 e4m3 slices of the 128-byte row
#pragma unroll
      for (int m = 0; m < kAccs; ++m) {
        const uint64_t desc_a = sw128_kmajor_desc(query_slice(slice) + m * 64 * kTileRowBytes);
        proxy_mma<ProxyElement::kE4M3, kCols>(acc[m], desc_a + 2 * k, desc_b + 2 * k, slice > 0 || k > 0);
      }
    }
    wgmma_commit();
    fence_accumulators();
    if (slice == 0 && step > 0) publish_block_maxima(pending_col0, pending_scales, pending_maxima);
    if (slice != kSteps - 1) {
      wgmma_wait<1>();
      release_through(step - 1);
      continue;
    }
    const int col0 = (first_half_of(warpgroup) + 2 * (step / kSteps)) * kCols;
    const KeyScales scales = load_key_scales(col0);
    wgmma_wait<0>();
    fence_accumulators();
    release_through(step);

    // Only the halves that reach past the first row's causal limit test each column.
    HalfPairMaxima maxima;
    if (col0 + kCols - 1 > row0 + prefix_cols) {
#pragma unroll
      for (int m = 0; m < kAccs; ++m) half_pair_maxima(acc[m], m, col0, std::true_type{}, maxima);
    } else {
#pragma unroll
      for (int m = 0; m < kAccs; ++m) half_pair_maxima(acc[m], m, col0, std::false_type{}, maxima);
    }
    pending_maxima = maxima;
    pending_scales = scales;
    pending_col0 = col0;
  }
  // As in kap_score_kernel: the explicit wait keeps ptxas from waiting at the end of every step.
  wgmma_wait<0>();
  publish_block_maxima(pending_col0, pending_scales, pending_maxima);
  // Each row's best over this warpgroup's halves, folded into rm once.
#pragma unroll
  for (int m = 0; m < kAccs; ++m) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float best = row_best[m][half];
      best = fmaxf(best, __shfl_xor_sync(0xffffffffu, best, 1));
      best = fmaxf(best, __shfl_xor_sync(0xffffffffu, best, 2));
      const int r = row_of(m, half);
      if (r < num_rows && (lane & 3) == 0 && best > -INFINITY) {
        atomicMax(row_max_head + first_row + r, ordered_bits(best * row_scale[m][half]));
      }
    }
  }
}

template <int kStride>
__global__ void __launch_bounds__(kScoreThreads, 1)
    kap_score_resident_kernel(const KapDeviceArgs args, const __grid_constant__ ScoreOperandMaps maps) {
  run_scoring_cta<kStride>(
      args, [&](const ScoreRowTile& row_tile) { score_resident_unit<kStride>(args, maps, row_tile); });
}

}  // namespace cosa::kap
