// Where a sequence's keys lie in a paged K/V cache (spec section 1: page sizes are powers of two,
// checked by the binding and by run_kap / run_osk), for KAP's key loops and OSK's block loads.
#pragma once

#include "cosa_params.h"

namespace cosa {

// Key t of a sequence lies in page-table entry t >> shift, row t & row_mask of that page: no
// integer division in the key loops.
struct KeyPaging {
  int shift = 0;
  int row_mask = 0;
  __device__ __forceinline__ int page_index(int key) const { return key >> shift; }
  __device__ __forceinline__ int row(int key) const { return key & row_mask; }
  // The sequence's first key in page-table entry `page_index`.
  __device__ __forceinline__ int first_key(int page_index) const { return page_index << shift; }
};
__device__ __forceinline__ KeyPaging key_paging(const PagedLayout& layout) {
  return KeyPaging{log2_page_size(layout.page_size), layout.page_size - 1};
}

// The pages under one block of kBlockKeys keys (a power of two; blocks start at multiples of it).
// Pages of kBlockKeys keys or more hold a whole block each, at some row of one page; smaller pages
// tile a block with kBlockKeys >> shift whole pages. Each answer below spells that test in its own
// expression: through one bool helper, the test compiled to another predicate form in OSK's
// producer, which ptxas then scheduled differently.
template <int kBlockKeys>
struct BlockPaging : KeyPaging {
  static constexpr int log2_of(int n) { return n > 1 ? 1 + log2_of(n >> 1) : 0; }
  static constexpr int kLog2BlockKeys = log2_of(kBlockKeys);
  static_assert((1 << kLog2BlockKeys) == kBlockKeys, "blocks of a power-of-two number of keys");

  // Pages that a block touches.
  __device__ __forceinline__ int pages_per_block() const {
    return shift >= kLog2BlockKeys ? 1 : (kBlockKeys >> shift);
  }
  // log2 of the block's keys that one page holds: a page, or the whole block.
  __device__ __forceinline__ int log2_keys_per_page() const {
    return shift < kLog2BlockKeys ? shift : kLog2BlockKeys;
  }
  // Which of the block's pages (0 .. pages_per_block() - 1) holds its key `row`.
  __device__ __forceinline__ int page_of_row(int row) const {
    return shift >= kLog2BlockKeys ? 0 : (row >> shift);
  }
  // The page row of block `block`'s first key (0 where the block starts a page).
  __device__ __forceinline__ int first_row(int block) const {
    return shift >= kLog2BlockKeys ? row(block * kBlockKeys) : 0;
  }
};

}  // namespace cosa
