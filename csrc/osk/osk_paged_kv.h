// The OSK producer's paged K / V loads: the page-table lookup of a listed key block and the copy of
// that block into a stage buffer, by TMA (one box per page and 64-column half) for whole blocks and
// by cp.async with zero fill for the block holding Lk. Pages are located through
// common/paging.cuh, which KAP's key loops share. The producer's walk over the list, which calls
// these once per entry and cache, is OskMainloop::load (osk_mainloop.h).
#pragma once

#include <cstdint>

#include <cuda.h>  // CUtensorMap

#include <cute/tensor.hpp>

#include "common/async_copy.cuh"
#include "common/paging.cuh"
#include "common/tma_pipeline.cuh"
#include "cosa_params.h"
#include "osk/osk_params.h"

namespace cosa::osk {

template <class Traits>
struct OskPagedKV {
  using Element = typename Traits::Element;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kChunksPerRow = Traits::kChunksPerRow;
  static constexpr uint32_t kTileBytes = uint32_t(Traits::kTileElems * sizeof(Element));
  using Paging = BlockPaging<kBlockN>;

  // The page size's log2 comes from the host (OskKernelParams::log2_page_size).
  __device__ static Paging make_paging(const OskKernelParams& kp) {
    return Paging{{kp.log2_page_size, (1 << kp.log2_page_size) - 1}};
  }

  // Lane l of each producer warp holds the physical page of the l-th page of key block `block`
  // (a 128-key block spans 128 / page_size pages, or part of one page when page_size >= 128).
  __device__ static int lane_page(const OskKernelParams& kp, const OskTile& t, int block,
                                  int lane) {
    const PagedLayout& layout = kp.args.layout;
    const Paging paging = make_paging(kp);
    const int page_in_seq = paging.page_index(block * kBlockN) + lane;
    const bool live = lane < paging.pages_per_block() && block >= 0 &&
                      paging.first_key(page_in_seq) < t.seqlen_k;
    return live ? layout.page_table[static_cast<int64_t>(t.batch) * layout.page_table_stride +
                                    page_in_seq]
                : 0;
  }

  // Gathers key block `block` of one cache (K or V) with cp.async into the tile at `smem_tile`; keys
  // at or past Lk are zero-filled without being read. The first `num_warps` producer warps share the
  // work (warp `warp` of them): each warp copies 8-row groups (one swizzle atom high), lane l row
  // l / 4 of the group and every fourth 16-byte chunk of that row from chunk l % 4, so that a lane's
  // shared-memory offsets repeat from group to group. `src_head` points at page 0, row 0 of KV head
  // head_kv; `page` is lane_page() of this block.
  __device__ static void gather_kv_block(const OskKernelParams& kp, const OskTile& t,
                                         uint32_t smem_tile, const Element* src_head,
                                         int64_t page_stride, int64_t row_stride, int block,
                                         int page, int warp, int num_warps, int lane) {
    constexpr int kGroups = kBlockN / 8;
    constexpr int kChunksPerLane = kChunksPerRow / 4;
    const Paging paging = make_paging(kp);
    const int row_in_group = lane / 4;
    uint32_t smem_chunk[kChunksPerLane];
    CUTE_UNROLL
    for (int j = 0; j < kChunksPerLane; ++j) {
      smem_chunk[j] = smem_tile + uint32_t(Traits::swizzled_offset(row_in_group, lane % 4 + 4 * j) *
                                           sizeof(Element));
    }
    for (int group = warp; group < kGroups; group += num_warps) {
      const int row = group * 8 + row_in_group;
      const int token = block * kBlockN + row;
      const int page_of_row = __shfl_sync(0xffffffffu, page, paging.page_of_row(row));
      const bool live = static_cast<unsigned>(token) < static_cast<unsigned>(t.seqlen_k);
      const Element* src_row = src_head + static_cast<int64_t>(page_of_row) * page_stride +
                               static_cast<int64_t>(paging.row(token)) * row_stride;
      // Group g starts 8 rows (one swizzle atom) below group 0.
      const uint32_t group_bytes = uint32_t(Traits::swizzled_offset(group * 8, 0) * sizeof(Element));
      CUTE_UNROLL
      for (int j = 0; j < kChunksPerLane; ++j) {
        const int chunk = lane % 4 + 4 * j;
        cp_async_16_zfill(smem_chunk[j] + group_bytes, live ? src_row + chunk * 8 : src_head, live);
      }
    }
  }

  // Where one cache (K or V) lives, for both load paths.
  struct KVSource {
    const CUtensorMap* tma;
    const Element* src_head;  // KV head head_kv, page 0, row 0
    int64_t page_stride;
    int64_t row_stride;
    uint32_t smem;  // stage 0 of the tile buffer
  };

  // Producer warps per cache: K and V each have their own loading warps, which follow the list
  // independently, so that the two caches' copies are issued side by side (at 16-key pages a block
  // is 16 TMA boxes per cache, issued one lane at a time). Whole blocks travel by TMA, one warp per
  // cache (the other two producer warps leave once Q is loaded, taking no issue slots from the
  // consumers); where TMA cannot address the caches, two warps per cache gather every block. The
  // full barriers expect one arrival per loading warp of their cache.
  __device__ static int kv_load_warps(const OskKernelParams& kp) {
    return kp.kv_tma ? 1 : Traits::kNumProducerThreads / 64;
  }

  // Loads key block `block` of one cache into stage buffer `stage` and arrives on `full`; `page` is
  // lane_page() of the block, `warp` this warp's index among the `num_warps` loading warps. Whole
  // blocks travel by TMA (one box per page and 64-column half); the block holding Lk is gathered
  // with cp.async, zero-filling the keys past Lk (the rest of that page may hold anything, NaN
  // included, and P = 0 times NaN would still poison P V).
  __device__ static void load_kv_block(const OskKernelParams& kp, const OskTile& t,
                                       const KVSource& src, int stage, int block, int page,
                                       uint64_t* full, int warp, int num_warps, int lane) {
    const uint32_t smem_tile = src.smem + stage * kTileBytes;
    const bool whole_block = kp.kv_tma && block >= 0 && (block + 1) * kBlockN <= t.seqlen_k;
    if (whole_block) {  // one loading warp per cache (kv_load_warps)
      constexpr int kHalves = Traits::kHeadDim / 64;
      constexpr uint32_t kHalfBytes = kBlockN * 64 * sizeof(Element);
      const Paging paging = make_paging(kp);
      const int log2_box_rows = paging.log2_keys_per_page();  // a page or a block
      const int pages = kBlockN >> log2_box_rows;  // boxes per 64-column half
      const int row_in_page = paging.first_row(block);
      if (lane == 0) { MBarrier::arrive_expect_tx(full, kTileBytes); }
      __syncwarp();
      const int box_page = lane / kHalves;
      const int half = lane % kHalves;
      const int page_of_box = __shfl_sync(0xffffffffu, page, box_page);
      if (lane < pages * kHalves) {
        tma_load_4d(smem_tile + half * kHalfBytes +
                        ((box_page << log2_box_rows) * 64 * uint32_t(sizeof(Element))),
                    src.tma, full, half * 64, t.head_kv, row_in_page, page_of_box);
      }
    } else {
      gather_kv_block(kp, t, smem_tile, src.src_head, src.page_stride, src.row_stride, block, page,
                      warp, num_warps, lane);
      MBarrier::hold_for_cp_async(full);
      __syncwarp();
      if (lane == 0) { MBarrier::arrive(full); }
    }
  }
};

}  // namespace cosa::osk
