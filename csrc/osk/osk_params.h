// What an OSK kernel receives and what each of its CTAs works on: the launch-time parameters and
// the tile (query head, query block, sequence), shared by the scheduler that locates a tile, the
// main loop, the paged K/V loads and the epilogue.
#pragma once

#include <cuda.h>  // CUtensorMap (a plain 128-byte struct; no driver calls here)

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
  int first_diagonal = 0;  // the key block of the tile's first query (QueryBlock::first_diagonal)
  int count = 0;         // counts[h, g]
  // The list's first 32 entries, lane l holding entry l (entries past the count are whatever
  // the row holds there, and unused).
  int first_entries = -1;
  bool valid = false;    // false for padding rows past the batch's real number of query blocks
};

}  // namespace cosa::osk
