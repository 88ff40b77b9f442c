// The packed query-block numbering of spec section 1 on the device: sequence b owns
// ceil(Lq_b / 128) query blocks, numbered back to back over the batch. KAP's select kernels, OSK's
// tile scheduler and the input checks all map a packed block g to its sequence through
// locate_query_block, so that the three agree on it by construction.
#pragma once

#include <cstdint>

#include "cosa_params.h"

namespace cosa {

// Query blocks of a sequence of `len_q` queries; none for a negative length, which only inputs
// that failed the length checks have (the input checks still walk them).
__host__ __device__ __forceinline__ int num_query_blocks(int len_q) {
  return len_q > 0 ? (len_q + kBlockSize - 1) / kBlockSize : 0;
}

struct QueryBlock {
  int batch = 0;          // sequence b
  int block_in_seq = 0;   // query block i of sequence b
  int q_start = 0;        // first token of sequence b in q / out: cu_seqlens_q[b]
  int seqlen_q = 0;       // Lq_b
  int seqlen_k = 0;       // Lk_b
  // The diagonal blocks (first_diagonal_block and last_diagonal_block, cosa_contract.h): keys in
  // blocks before first_diagonal are visible to every query of the block, keys past last_diagonal
  // to none.
  int first_diagonal = 0;
  int last_diagonal = 0;
  bool valid = false;     // false for padding rows past the batch's real number of query blocks
};

// Where packed query block g lives. Warp-collective: every lane of the calling warp passes the same
// g and gets the same answer. The warp takes 32 sequences per step (their lengths loaded side by
// side, a warp scan of their block counts, a ballot for the owner): one round of loads per 32
// sequences and no prefix sums needed beforehand (OSK and the checks have none). That is 32 times
// fewer steps than a walk one sequence at a time, and fewer dependent loads than the binary search
// over KAP's prefix sums that the select kernels used (1 + log2(batch)) up to about 256 sequences.
__device__ __forceinline__ QueryBlock locate_query_block(const PagedLayout& layout, int g) {
  constexpr unsigned kFullWarp = 0xffffffffu;
  const int lane = static_cast<int>(threadIdx.x % 32);
  QueryBlock block;
  int first_block = 0;  // packed index of the first block of sequence `base`
  for (int base = 0; base < layout.batch; base += 32) {
    const int b = base + lane;
    int q_start = 0, seqlen_q = 0, seqlen_k = 0;
    if (b < layout.batch) {
      q_start = layout.cu_seqlens_q[b];
      seqlen_q = layout.cu_seqlens_q[b + 1] - q_start;
      seqlen_k = layout.seqused_k[b];
    }
    const int blocks = num_query_blocks(seqlen_q);
    int blocks_through = blocks;  // inclusive prefix sum over lanes 0 .. lane
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int other = __shfl_up_sync(kFullWarp, blocks_through, offset);
      if (lane >= offset) blocks_through += other;
    }
    // Block counts are never negative, so the lowest lane whose sum passes g owns it (lanes past
    // the batch repeat the last sum and can only follow it).
    const unsigned passed = __ballot_sync(kFullWarp, g - first_block < blocks_through);
    if (passed != 0) {
      const int owner = __ffs(passed) - 1;
      block.batch = base + owner;
      block.block_in_seq = g - first_block - __shfl_sync(kFullWarp, blocks_through - blocks, owner);
      block.q_start = __shfl_sync(kFullWarp, q_start, owner);
      block.seqlen_q = __shfl_sync(kFullWarp, seqlen_q, owner);
      block.seqlen_k = __shfl_sync(kFullWarp, seqlen_k, owner);
      const int prefix = block.seqlen_k - block.seqlen_q;
      block.first_diagonal = first_diagonal_block(prefix, block.block_in_seq);
      block.last_diagonal = last_diagonal_block(prefix, block.seqlen_q, block.block_in_seq);
      block.valid = true;
      return block;
    }
    first_block += __shfl_sync(kFullWarp, blocks_through, 31);
  }
  return block;
}

}  // namespace cosa
