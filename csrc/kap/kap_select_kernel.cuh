// KAP selection pass (spec section 2, steps 3-6) per (query head, packed query block): from the
// block maxima bm[r, j] and row maxima rm[r] of the block's stride rows (written by
// the scoring kernel) it forms the scores S[j] = sum_r exp(bm[r, j] - rm[r]) and the HRM flags
// H[j] = any_r bm[r, j] == rm[r]; sorts the candidates j = 0 .. last_i (the block's last diagonal
// block, QueryBlock::last_diagonal) by one packed 64-bit key (H, S bits, inverted j); keeps the
// shortest prefix whose cumulative S reaches top_p * T (every candidate when top_p >= 1) plus every
// HRM block, block 0 and both diagonal blocks; writes them in sort order followed by -1 padding.
//
// Two kernels: kap_select_warp_kernel gives each list one warp and sorts up to kWarpSortMax keys
// in registers (bitonic network: in-thread steps and shuffles, no shared-memory traffic), which
// is what rows of up to 128K-token contexts need; kap_select_block_kernel gives each list a CTA
// and sorts in shared memory, for longer contexts. Both go through the same helpers before the
// sort (locate_list, stage_row_max, candidate_key) and after it (kept_positions, finish_list).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/input_gate.cuh"
#include "common/query_blocks.cuh"
#include "kap/kap_traits.h"

namespace cosa::kap {

// Sort key: descending key order is (H desc, S desc, j asc). S >= 0, so its float bits order it
// as an unsigned integer and fit in bits 31..62; the block id takes the low 31 bits, inverted.
__device__ __forceinline__ uint64_t select_key(bool hrm, float score, int block) {
  return (static_cast<uint64_t>(hrm) << 63) |
         (static_cast<uint64_t>(__float_as_uint(score)) << 31) |
         static_cast<uint64_t>(0x7FFFFFFF - block);
}
__device__ __forceinline__ int key_block(uint64_t key) {
  return 0x7FFFFFFF - static_cast<int>(key & 0x7FFFFFFFu);
}
__device__ __forceinline__ float key_score(uint64_t key) {
  return __uint_as_float(static_cast<uint32_t>((key >> 31) & 0xFFFFFFFFu));
}
__device__ __forceinline__ bool key_hrm(uint64_t key) { return (key >> 63) != 0; }

// Longest list the warp kernel sorts: 32 lanes x 32 keys in registers.
constexpr int kWarpSortMax = 1024;
constexpr int kSelectWarps = 4;  // lists per CTA of the warp kernel

// Dynamic shared memory of the block kernel: next_pow2(max_k_blocks) keys.
inline size_t select_smem_bytes(int max_k_blocks) {
  size_t n = 1;
  while (n < static_cast<size_t>(max_k_blocks)) n <<= 1;
  return n * sizeof(uint64_t);
}

// One list of the selection pass, (query head head_begin + head_local, packed query block g): where
// its outputs go and where the scoring pass left its rows.
struct SelectList {
  int32_t* order_row = nullptr;       // [max_k_blocks]
  int32_t* count_out = nullptr;
  const float* block_max = nullptr;   // bm[r, j] at block_max[r * max_k_blocks + j]
  uint32_t* row_max = nullptr;        // ordered_bits(rm[r]) at row_max[r]
  int first_diagonal = 0;             // the diagonal blocks (QueryBlock), forced into the list;
  int last_diagonal = 0;              // the candidates are blocks 0 .. last_diagonal
  // The first of the list's stride rows that may see a column of block last_diagonal. The rows
  // before it (only where the prefix is not a multiple of 128: the block starts past their first
  // query) have no bm there, which the scoring pass does not write, and count as -inf. Every row
  // sees a column of each earlier block, which starts at or before the block's first query.
  int last_diagonal_first_row = 0;
  int num_rows = 0;                   // stride rows of the block (fewer in a sequence's last block)
  bool valid = false;                 // false for padding rows past the batch's query blocks
};

// Warp-collective (locate_query_block): every lane of the calling warp passes the same list.
template <int kStride>
__device__ __forceinline__ SelectList locate_list(const KapDeviceArgs& args, int head_local,
                                                  int q_block) {
  constexpr int kRowsPerBlock = kBlockSize / kStride;
  const PagedLayout& L = args.layout;
  const int64_t list_index =
      static_cast<int64_t>(args.head_begin + head_local) * L.num_q_blocks + q_block;
  const int64_t first_row = static_cast<int64_t>(head_local) * args.block_max_rows +
                            static_cast<int64_t>(q_block) * kRowsPerBlock;
  SelectList list;
  list.order_row = args.order + list_index * L.max_k_blocks;
  list.count_out = args.counts + list_index;
  list.block_max = args.block_max + first_row * L.max_k_blocks;
  list.row_max = args.row_max + first_row;
  const QueryBlock block = locate_query_block(L, q_block);
  list.first_diagonal = block.first_diagonal;
  list.last_diagonal = block.last_diagonal;
  const int rows_before = block.block_in_seq * kRowsPerBlock;  // stride rows of earlier blocks
  // Block j starts at stride column j * 128 / s, which row r sees iff it is at most r + floor(P / s).
  const int prefix_cols = prefix_stride_cols<kStride>(block.seqlen_q, block.seqlen_k);
  list.last_diagonal_first_row = max(0, block.last_diagonal * kRowsPerBlock - prefix_cols - rows_before);
  list.num_rows = min(kRowsPerBlock, (block.seqlen_q + kStride - 1) / kStride - rows_before);
  list.valid = block.valid;
  return list;
}

// The counter of a list's query block: every scoring CTA of its row tile is done once it reaches
// block_scored_complete (kap_traits.h). Read relaxed, so that the list's first poll goes out beside
// locate_list's loads; wait_until_scored ends with the fence that makes the polls an acquire.
__device__ __forceinline__ uint32_t scored_warps(const uint32_t* counter) {
  uint32_t done;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(done) : "l"(counter) : "memory");
  return done;
}

// Returns once the list's row tile is scored (one thread polls), so that a list is selected as
// soon as its own rows are scored, while the scoring grid's last CTAs still run, rather than after
// the whole grid. `done` is the first poll's count. The fence after the last poll makes it an
// acquire (it synchronises with the scoring warps' releases), and the caller orders the list's
// reads of bm and rm after it by synchronising the list's warp or CTA.
__device__ __forceinline__ void wait_until_scored(const KapDeviceArgs& args,
                                                  const uint32_t* counter, uint32_t done) {
  const uint32_t complete = block_scored_complete(args);
  while (done < complete) {
    __nanosleep(256);
    done = scored_warps(counter);
  }
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

// Threads 0 .. kRowsPerBlock-1 of the list's warp or CTA stage rm of one row each in `row_max`
// (0 past num_rows, never read) and zero it in the workspace: the next head chunk's scoring pass
// folds its maxima into a zeroed buffer (the index kernel zeroes it for the first chunk).
template <int kStride>
__device__ __forceinline__ void stage_row_max(const SelectList& list, float* row_max, int thread) {
  if (thread < kBlockSize / kStride) {
    float value = 0.f;
    if (thread < list.num_rows) {
      value = from_ordered_bits(list.row_max[thread]);
      list.row_max[thread] = 0;
    }
    row_max[thread] = value;
  }
}

// S[j] and H[j] summed over rows r0 .. r0+kRows-1 of the list (rm staged in `row_max`). With
// kAllRows the caller knows every row exists, so all the loads issue before the first use; otherwise
// rows past num_rows read row 0 and are dropped (a load guarded by its own branch would wait for
// the one before it). Rows before `first_allowed_row` have no allowed column in block j: their
// loads read what the scoring pass did not write, and are replaced by -inf, which adds
// exp(-inf - rm[r]) as the reference does (0, or NaN for a row without a maximum).
template <int kRows, bool kAllRows>
__device__ __forceinline__ void accumulate_rows(const SelectList& list, const float* row_max,
                                                int max_k_blocks, int j, int first_allowed_row,
                                                int r0, float& score, bool& hrm) {
  float v[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = kAllRows || r0 + r < list.num_rows ? r0 + r : 0;
    v[r] = list.block_max[static_cast<int64_t>(row) * max_k_blocks + j];
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r0 + r < first_allowed_row) v[r] = -INFINITY;
    if (kAllRows || r0 + r < list.num_rows) {
      score += __expf(v[r] - row_max[r0 + r]);
      hrm |= (v[r] == row_max[r0 + r]);
    }
  }
}

// The sort key of candidate block j: S[j] = sum_r exp(bm[r, j] - rm[r]) and the HRM flag
// H[j] = any_r bm[r, j] == rm[r], over the list's rows. Every query block but a sequence's last
// has all its rows, and takes the path without per-row tests; the rows go 16 loads at a time.
template <int kStride>
__device__ __forceinline__ uint64_t candidate_key(const SelectList& list, const float* row_max,
                                                  int max_k_blocks, int j) {
  constexpr int kRows = kBlockSize / kStride;
  constexpr int kBatch = kRows < 16 ? kRows : 16;
  float score = 0.f;
  bool hrm = false;
  const int first_allowed_row = j == list.last_diagonal ? list.last_diagonal_first_row : 0;
  if (list.num_rows == kRows) {
#pragma unroll
    for (int r0 = 0; r0 < kRows; r0 += kBatch)
      accumulate_rows<kBatch, true>(list, row_max, max_k_blocks, j, first_allowed_row, r0, score, hrm);
  } else {
#pragma unroll
    for (int r0 = 0; r0 < kRows; r0 += kBatch)
      accumulate_rows<kBatch, false>(list, row_max, max_k_blocks, j, first_allowed_row, r0, score, hrm);
  }
  return select_key(hrm, score, j);
}

// The sort positions of the forced blocks: the sink (block 0) and the two diagonal blocks, which
// may be one block, or block 0 itself. No member initialisers, so that the block kernel can hold
// one in shared memory; none() is the value before any position is noted.
struct ForcedPositions {
  int sink;
  int first_diagonal;
  int last_diagonal;
  __device__ __forceinline__ static ForcedPositions none() { return {-1, -1, -1}; }
  // Records sort position `pos` if it holds one of the forced blocks.
  __device__ __forceinline__ void note(const SelectList& list, int block, int pos) {
    if (block == 0) sink = pos;
    if (block == list.first_diagonal) first_diagonal = pos;
    if (block == list.last_diagonal) last_diagonal = pos;
  }
};

// Which sort positions a list keeps: 0 .. last_kept (the top-p prefix and the HRM prefix), then the
// forced blocks that lie past it, each once, in sort order.
struct KeptPositions {
  int last_kept = 0;
  int extra_first = -1;
  int extra_second = -1;
  int extra_third = -1;
  int count = 0;  // list length
  // Sort position of list entry k < count.
  __device__ __forceinline__ int position(int k) const {
    return k <= last_kept ? k
                          : (k == last_kept + 1 ? extra_first : (k == last_kept + 2 ? extra_second : extra_third));
  }
};

// first_reached: the first sort position whose cumulative S reaches top_p * T.
__device__ __forceinline__ KeptPositions kept_positions(float top_p, int num_candidates,
                                                        int first_reached, int hrm_count,
                                                        const ForcedPositions& forced) {
  KeptPositions kept;
  // top_p >= 1 keeps every candidate, zero scores included (the spec's "p = 1 keeps every
  // candidate"; the shortest prefix reaching T would stop before trailing zero scores).
  const int prefix_last =
      top_p >= 1.f ? num_candidates - 1 : min(first_reached, num_candidates - 1);
  kept.last_kept = max(prefix_last, hrm_count - 1);
  // The three positions in ascending order (a sorting network of three compare-exchanges), then
  // those past the prefix appended in that order, a repeated position once.
  int p0 = forced.sink, p1 = forced.first_diagonal, p2 = forced.last_diagonal;
  auto order_ascending = [](int& a, int& b) {
    const int low = min(a, b);
    b = max(a, b);
    a = low;
  };
  order_ascending(p0, p1);
  order_ascending(p1, p2);
  order_ascending(p0, p1);
  auto append = [&](int pos) {
    if (kept.extra_first < 0) kept.extra_first = pos;
    else if (kept.extra_second < 0) kept.extra_second = pos;
    else kept.extra_third = pos;
  };
  if (p0 > kept.last_kept) append(p0);
  if (p1 > kept.last_kept && p1 != p0) append(p1);
  if (p2 > kept.last_kept && p2 != p1) append(p2);
  kept.count = kept.last_kept + 1 + (kept.extra_first >= 0) + (kept.extra_second >= 0) + (kept.extra_third >= 0);
  return kept;
}

// Ends the list at `count` entries: -1 from position count on, and the count. Called by threads
// 0 .. num_threads-1 of the list's warp or CTA; a padding row ends at 0.
__device__ __forceinline__ void finish_list(const SelectList& list, int max_k_blocks, int count,
                                            int thread, int num_threads) {
  for (int k = count + thread; k < max_k_blocks; k += num_threads) list.order_row[k] = -1;
  if (thread == 0) *list.count_out = count;
}

// The CTA of one list (kap_select_block_kernel).
template <int kStride>
__device__ __forceinline__ void select_list_block(const KapDeviceArgs& args, int head_local,
                                                  int q_block) {
  constexpr int kRowsPerBlock = kBlockSize / kStride;
  constexpr int kWarps = kSelectThreads / 32;
  const int max_k_blocks = args.layout.max_k_blocks;
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const uint32_t* counter = block_scored_counter(args, args.head_begin + head_local, q_block);
  const uint32_t done = tid == 0 ? scored_warps(counter) : 0u;
  const SelectList list = locate_list<kStride>(args, head_local, q_block);
  if (!list.valid) {  // padding row
    finish_list(list, max_k_blocks, 0, tid, kSelectThreads);
    return;
  }
  if (tid == 0) wait_until_scored(args, counter, done);
  __syncthreads();
  const int num_candidates = list.last_diagonal + 1;

  extern __shared__ uint64_t keys[];
  __shared__ float row_max[kRowsPerBlock];
  __shared__ float warp_sums[kWarps];
  __shared__ int first_reached, hrm_count;
  __shared__ ForcedPositions forced;
  __shared__ float total_score;

  stage_row_max<kStride>(list, row_max, tid);
  if (tid == 0) {
    first_reached = 0x7FFFFFFF;
    hrm_count = 0;
    forced = ForcedPositions::none();
  }
  __syncthreads();

  // Scores, HRM flags, sort keys; the power-of-two tail holds zero keys, which sort last.
  int sort_size = 1;
  while (sort_size < num_candidates) sort_size <<= 1;
  int local_hrm = 0;
  for (int j = tid; j < sort_size; j += kSelectThreads) {
    uint64_t key = 0;
    if (j < num_candidates) {
      key = candidate_key<kStride>(list, row_max, max_k_blocks, j);
      local_hrm += key_hrm(key);
    }
    keys[j] = key;
  }
  if (local_hrm) atomicAdd(&hrm_count, local_hrm);
  __syncthreads();

  // Bitonic sort, descending. Pair idx = 32 * warp' + lane touches elements of the 64-element
  // chunk idx / 32 only while half <= 32, and a warp always owns the same chunks, so those steps
  // need a warp barrier only; a CTA barrier goes around every step with a larger half.
  for (int size = 2; size <= sort_size; size <<= 1) {
    for (int half = size >> 1; half > 0; half >>= 1) {
      for (int idx = tid; idx < sort_size / 2; idx += kSelectThreads) {
        const int lo = 2 * half * (idx / half) + (idx % half);
        const int hi = lo + half;
        const uint64_t a = keys[lo], c = keys[hi];
        const bool descending = (lo & size) == 0;
        if (descending ? (a < c) : (a > c)) {
          keys[lo] = c;
          keys[hi] = a;
        }
      }
      const int next_half = half > 1 ? half >> 1 : size;
      if (half > 32 || next_half > 32) {
        __syncthreads();
      } else {
        __syncwarp();
      }
    }
  }
  __syncthreads();

  // Cumulative S in sort order: each thread owns a contiguous run of positions.
  const int per_thread = (num_candidates + kSelectThreads - 1) / kSelectThreads;
  const int run_begin = min(tid * per_thread, num_candidates);
  const int run_end = min(run_begin + per_thread, num_candidates);
  float run_sum = 0.f;
  for (int k = run_begin; k < run_end; ++k) run_sum += key_score(keys[k]);
  // Exclusive block scan of the run sums.
  float inclusive = run_sum;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const float other = __shfl_up_sync(0xffffffffu, inclusive, off);
    if (lane >= off) inclusive += other;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  float warp_offset = 0.f;
  for (int w = 0; w < warp; ++w) warp_offset += warp_sums[w];
  const float run_offset = warp_offset + inclusive - run_sum;
  // T is the cumulative sum at the last position, so that top_p = 1 keeps every candidate.
  {
    float cumulative = run_offset;
    for (int k = run_begin; k < run_end; ++k) cumulative += key_score(keys[k]);
    if (run_begin < run_end && run_end == num_candidates) total_score = cumulative;
  }
  __syncthreads();
  const float threshold = args.top_p * total_score;
  {
    float cumulative = run_offset;
    for (int k = run_begin; k < run_end; ++k) {
      const uint64_t key = keys[k];
      cumulative += key_score(key);
      if (cumulative >= threshold) {
        atomicMin(&first_reached, k);
        break;
      }
    }
    for (int k = run_begin; k < run_end; ++k) forced.note(list, key_block(keys[k]), k);
  }
  __syncthreads();

  const KeptPositions kept = kept_positions(args.top_p, num_candidates, first_reached, hrm_count, forced);
  for (int k = tid; k < kept.count; k += kSelectThreads) {
    list.order_row[k] = key_block(keys[kept.position(k)]);
  }
  finish_list(list, max_k_blocks, kept.count, tid, kSelectThreads);
}

// The select kernels' grid: x over (query block, query head) pairs, the head fastest and the last
// query blocks first, in the order the scoring grid finishes its row tiles (longest rows first).
__device__ __forceinline__ void select_grid_slot(const KapDeviceArgs& args, int lists_per_cta,
                                                 int& head_local, int& first_q_block) {
  const int slot = static_cast<int>(blockIdx.x);
  const int groups = static_cast<int>(gridDim.x) / args.head_count;
  head_local = slot % args.head_count;
  first_q_block = (groups - 1 - slot / args.head_count) * lists_per_cta;
}

// A dependent launch (common/dependent_launch.h) after the scoring kernel, whose bm and rm it
// reads; the next kernel (the next chunk's scoring pass, or OSK) may launch once every CTA here has
// started, and waits for this grid before reading anything it writes. This grid can start only once
// every scoring CTA has started (each triggers right past its own wait), so every kernel before
// the scoring kernel has completed: the lists read the prefix sums and the input report at once and
// wait on their query blocks' counters, which the scoring CTAs, all resident or done by then,
// complete. The grid-dependency wait comes last, so that this grid still completes only after the
// scoring grid, as the chain's completion order needs.
template <int kStride>
__global__ void __launch_bounds__(kSelectThreads) kap_select_block_kernel(const KapDeviceArgs args) {
  cudaTriggerProgrammaticLaunchCompletion();
  if (!inputs_rejected(args.layout)) {
    int head_local, q_block;
    select_grid_slot(args, 1, head_local, q_block);
    select_list_block<kStride>(args, head_local, q_block);
  }
  cudaGridDependencySynchronize();
}

// Compare-exchange on 64-bit keys: `first` ends up with the larger key iff `descending`.
__device__ __forceinline__ void order_pair(uint64_t& first, uint64_t& second, bool descending) {
  const uint64_t hi = first > second ? first : second;
  const uint64_t lo = first > second ? second : first;
  first = descending ? hi : lo;
  second = descending ? lo : hi;
}

// Bitonic sort, descending, of the warp's 32 * kElems keys; lane l holds positions
// l * kElems .. l * kElems + kElems - 1 in key[0 .. kElems-1].
template <int kElems>
__device__ __forceinline__ void warp_bitonic_sort(uint64_t (&key)[kElems], int lane) {
  constexpr int kSize = 32 * kElems;
#pragma unroll 1
  for (int size = 2; size <= kSize; size <<= 1) {
    // Steps whose partner lives in another lane: the same slot of lane ^ (half / kElems).
#pragma unroll 1
    for (int half = size >> 1; half >= kElems; half >>= 1) {
      const int lane_mask = half / kElems;
      const bool descending = ((lane * kElems) & size) == 0;
      const bool keep_larger = ((lane & lane_mask) == 0) == descending;
      // Eight slots at a time: exchanging every slot at once would double the live registers.
#pragma unroll
      for (int e0 = 0; e0 < kElems; e0 += 8) {
#pragma unroll
        for (int e = e0; e < e0 + 8 && e < kElems; ++e) {
          const uint64_t other = __shfl_xor_sync(0xffffffffu, key[e], lane_mask);
          key[e] = keep_larger ? (key[e] > other ? key[e] : other) : (key[e] < other ? key[e] : other);
        }
        __syncwarp();
      }
    }
    // Steps inside a lane. Position lane * kElems + e has the bits of e below kElems and those of
    // lane * kElems above, so its direction bit (the one of `size`) comes from one of the two;
    // testing them apart keeps ptxas from holding kElems positions in registers through the sort
    // (it spilled at kElems = 32 under the 168-register bound of three CTAs per SM).
    const bool lane_descending = ((lane * kElems) & size) == 0;
#pragma unroll
    for (int half = kElems / 2; half >= 1; half >>= 1) {
      if (half < size) {
#pragma unroll
        for (int e = 0; e < kElems; ++e) {
          if ((e & half) == 0) {
            order_pair(key[e], key[e + half], lane_descending && (e & size) == 0);
          }
        }
      }
    }
  }
}

template <int kElems>
__device__ __forceinline__ void select_list_warp(const KapDeviceArgs& args, const SelectList& list,
                                                 const uint64_t* staged, int hrm_local, int lane) {
  const int num_candidates = list.last_diagonal + 1;
  // Any initial placement is fine for the sort; positions past the candidates hold zero keys,
  // which sort last.
  uint64_t key[kElems];
#pragma unroll
  for (int e = 0; e < kElems; ++e) {
    const int j = 32 * e + lane;
    key[e] = j < num_candidates ? staged[j] : 0;
  }
  const int hrm_count = __reduce_add_sync(0xffffffffu, hrm_local);
  warp_bitonic_sort<kElems>(key, lane);

  // Cumulative S in sort order: lane-local runs, then an exclusive scan over the lanes.
  float run_sum = 0.f;
#pragma unroll
  for (int e = 0; e < kElems; ++e) run_sum += key_score(key[e]);
  float inclusive = run_sum;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const float other = __shfl_up_sync(0xffffffffu, inclusive, off);
    if (lane >= off) inclusive += other;
  }
  // T is the cumulative sum at the last position (zero keys add nothing).
  const float total = __shfl_sync(0xffffffffu, inclusive, 31);
  const float threshold = args.top_p * total;
  float cumulative = inclusive - run_sum;
  int first_reached = 0x7FFFFFFF;
  ForcedPositions forced = ForcedPositions::none();
#pragma unroll
  for (int e = 0; e < kElems; ++e) {
    const int pos = lane * kElems + e;
    cumulative += key_score(key[e]);
    if (pos < num_candidates) {
      if (cumulative >= threshold && first_reached == 0x7FFFFFFF) first_reached = pos;
      forced.note(list, key_block(key[e]), pos);
    }
  }
  first_reached = __reduce_min_sync(0xffffffffu, first_reached);
  forced.sink = __reduce_max_sync(0xffffffffu, forced.sink);
  forced.first_diagonal = __reduce_max_sync(0xffffffffu, forced.first_diagonal);
  forced.last_diagonal = __reduce_max_sync(0xffffffffu, forced.last_diagonal);

  const KeptPositions kept = kept_positions(args.top_p, num_candidates, first_reached, hrm_count, forced);
#pragma unroll
  for (int e = 0; e < kElems; ++e) {
    const int pos = lane * kElems + e;
    if (pos <= kept.last_kept) list.order_row[pos] = key_block(key[e]);
    if (pos == kept.extra_first) list.order_row[kept.last_kept + 1] = key_block(key[e]);
    if (pos == kept.extra_second) list.order_row[kept.last_kept + 2] = key_block(key[e]);
    if (pos == kept.extra_third) list.order_row[kept.last_kept + 3] = key_block(key[e]);
  }
  finish_list(list, args.layout.max_k_blocks, kept.count, lane, 32);
}

// select_list_warp with the fewest keys per lane (a power of two from kElems up to kMaxElems)
// that hold the list's candidates.
template <int kElems, int kMaxElems>
__device__ __forceinline__ void select_list_fitting(const KapDeviceArgs& args, const SelectList& list,
                                                    const uint64_t* staged, int hrm_local, int lane) {
  if constexpr (kElems < kMaxElems) {
    if (list.last_diagonal + 1 > 32 * kElems) {
      select_list_fitting<2 * kElems, kMaxElems>(args, list, staged, hrm_local, lane);
      return;
    }
  }
  select_list_warp<kElems>(args, list, staged, hrm_local, lane);
}

// The warp of one list (kap_select_warp_kernel).
template <int kStride, int kMaxElems>
__device__ __forceinline__ void select_list_of_warp(const KapDeviceArgs& args, int head_local,
                                                    int q_block) {
  constexpr int kRowsPerBlock = kBlockSize / kStride;
  const int max_k_blocks = args.layout.max_k_blocks;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (q_block >= args.layout.num_q_blocks) return;
  const uint32_t* counter = block_scored_counter(args, args.head_begin + head_local, q_block);
  const uint32_t done = lane == 0 ? scored_warps(counter) : 0u;
  const SelectList list = locate_list<kStride>(args, head_local, q_block);
  if (!list.valid) {  // padding row
    finish_list(list, max_k_blocks, 0, lane, 32);
    return;
  }
  if (lane == 0) wait_until_scored(args, counter, done);
  __syncwarp();
  const int num_candidates = list.last_diagonal + 1;

  __shared__ float row_max_all[kSelectWarps][kRowsPerBlock];
  __shared__ uint64_t staged_all[kSelectWarps][32 * kMaxElems];
  float* row_max = row_max_all[warp];
  uint64_t* staged = staged_all[warp];
  stage_row_max<kStride>(list, row_max, lane);
  __syncwarp();
  // Scores, flags and sort keys, staged in shared memory (block j read by lane j % 32: coalesced).
  int hrm_local = 0;
  for (int j = lane; j < num_candidates; j += 32) {
    const uint64_t key = candidate_key<kStride>(list, row_max, max_k_blocks, j);
    hrm_local += key_hrm(key);
    staged[j] = key;
  }
  __syncwarp();
  select_list_fitting<1, kMaxElems>(args, list, staged, hrm_local, lane);
}

// One warp per (query head, query block); lists of at most 32 * kMaxElems <= kWarpSortMax
// candidates. The launch picks the smallest kMaxElems that holds the longest list: the register
// file and the shared memory that the longest sort needs are what limit how many lists an SM works
// on at once, and a list's sort is a chain of dependent shuffles that only other lists can hide.
// Up to 256 keys: 8 CTAs per SM, so at most 64 registers, which those sorts fit without spilling
// (longer sorts keep the 3 CTAs, 170 registers, they had).
template <int kStride, int kMaxElems>
__global__ void __launch_bounds__(32 * kSelectWarps, kMaxElems <= 8 ? 8 : 3)
    kap_select_warp_kernel(const KapDeviceArgs args) {
  static_assert(32 * kMaxElems <= kWarpSortMax, "the warp kernel sorts at most kWarpSortMax keys");
  // A dependent launch, and the query blocks' scoring counters, as kap_select_block_kernel.
  cudaTriggerProgrammaticLaunchCompletion();
  if (!inputs_rejected(args.layout)) {
    int head_local, first_q_block;
    select_grid_slot(args, kSelectWarps, head_local, first_q_block);
    select_list_of_warp<kStride, kMaxElems>(args, head_local,
                                            first_q_block + static_cast<int>(threadIdx.x) / 32);
  }
  cudaGridDependencySynchronize();
}

}  // namespace cosa::kap
