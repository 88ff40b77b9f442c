// Which (query head, query block) tile a CTA computes, and where that tile lives in the packed
// varlen batch.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "common/query_blocks.cuh"
#include "cosa_params.h"
#include "osk/osk_params.h"

namespace cosa::osk {

// One CTA per tile (the hardware hands CTAs to SMs as they free up, which balanced the uneven
// lists better than a persistent round-robin did in our measurements). Flat CTA index -> (g, h)
// with g descending so that the tiles with the longest causal range (and so, usually, the longest
// lists) start first, and the query heads of one g next to each other so that heads sharing a KV
// head read the same pages close in time (L2 reuse).
struct OskTileScheduler {
  static int num_tiles(const OskParams& p) {
    return p.layout.num_q_blocks * p.layout.num_heads_q;
  }
  static dim3 grid(const OskParams& p) { return dim3(static_cast<unsigned>(num_tiles(p)), 1, 1); }

  __device__ static OskTile get_tile(const OskKernelParams& kp) {
    const PagedLayout& layout = kp.args.layout;
    OskTile t;
    const int linear = blockIdx.x;
    t.head = linear % layout.num_heads_q;
    t.row = layout.num_q_blocks - 1 - linear / layout.num_heads_q;
    t.head_kv = t.head / kp.heads_per_kv;
    // KAP's output when OSK follows it: read only past the kernel's grid-dependency wait, and
    // before the lookup below, which it does not depend on, so that the loads overlap (a padding
    // row's count and entries are read but not used). The entries are read before the count is
    // known, so that the producer's first page lookup does not wait for the count and then for
    // the list in turn: lane l reads entry l where the row has one (rows may be empty when no
    // sequence has keys).
    const int64_t list_row = static_cast<int64_t>(t.head) * layout.num_q_blocks + t.row;
    const int count = kp.args.counts[list_row];
    const int lane = static_cast<int>(threadIdx.x % 32);
    const int first_entries =
        layout.max_k_blocks > 0
            ? kp.args.order[list_row * layout.max_k_blocks + (lane < layout.max_k_blocks ? lane : 0)]
            : -1;
    // Every thread of the CTA calls this with the same tile, so each warp locates it together.
    const QueryBlock block = locate_query_block(layout, t.row);
    if (!block.valid) return t;
    t.batch = block.batch;
    t.block_in_seq = block.block_in_seq;
    t.q_start = block.q_start;
    t.seqlen_q = block.seqlen_q;
    t.seqlen_k = block.seqlen_k;
    t.first_diagonal = block.first_diagonal;
    t.count = count;
    t.first_entries = first_entries;
    t.valid = true;
    return t;
  }
};

}  // namespace cosa::osk
