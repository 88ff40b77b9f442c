// Which (query head, query block) tile a CTA computes, and where that tile lives in the packed
// varlen batch.
#pragma once

#include <cstdint>

#include <cuda.h>  // CUtensorMap (a plain 128-byte struct; no driver calls here)
#include <cuda_runtime.h>

#include "cosa_params.h"

namespace cosa::osk {

// Launch-time parameters: the user's OskParams plus values derived once on the host.
struct OskKernelParams {
  // K and V caches as 4-D TMA tensors (head_dim, kv head, row in page, page), boxes of
  // 64 x 1 x min(page_size, 128) x 1 with the 128-byte swizzle. Valid when kv_tma is set.
  CUtensorMap tma_k;  // CUtensorMap carries the 64-byte alignment TMA requires
  CUtensorMap tma_v;
  bool kv_tma = false;
  OskParams args;
  int log2_page_size = 0;
  int heads_per_kv = 1;     // num_heads_q / num_heads_kv
  float scale_log2 = 0.f;   // softmax_scale * log2(e): exp(sigma * s) == exp2(scale_log2 * s)
};

struct OskTile {
  int head = 0;          // query head h
  int head_kv = 0;       // h / heads_per_kv
  int row = 0;           // flat query block g (row of order / counts / skipped)
  int batch = 0;         // sequence b
  int block_in_seq = 0;  // query block i of sequence b
  int q_start = 0;       // first token of sequence b in q / out
  int seqlen_q = 0;      // Lq_b
  int seqlen_k = 0;      // Lk_b
  int diagonal = 0;      // key block aligned with query block i: P_b / 128 + i
  int count = 0;         // counts[h, g]
  bool valid = false;    // false for padding rows past the batch's real number of query blocks
};

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
    // Batches are small: a linear walk over cu_seqlens_q finds the sequence of block g.
    int first_block = 0;
    for (int b = 0; b < layout.batch; ++b) {
      const int q_begin = layout.cu_seqlens_q[b];
      const int seqlen_q = layout.cu_seqlens_q[b + 1] - q_begin;
      const int num_blocks = (seqlen_q + kBlockSize - 1) / kBlockSize;
      if (t.row < first_block + num_blocks) {
        t.batch = b;
        t.block_in_seq = t.row - first_block;
        t.q_start = q_begin;
        t.seqlen_q = seqlen_q;
        t.seqlen_k = layout.seqused_k[b];
        t.diagonal = (t.seqlen_k - seqlen_q) / kBlockSize + t.block_in_seq;
        t.count = kp.args.counts[static_cast<int64_t>(t.head) * layout.num_q_blocks + t.row];
        t.valid = true;
        return t;
      }
      first_block += num_blocks;
    }
    return t;
  }
};

}  // namespace cosa::osk
