// Device-side argument checks (see InputCheckParams in cosa_params.h). The binding used to express
// them as ~70 small tensor ops; as kernels they cost a launch or a few and one small read-back,
// which matters at short contexts where the attention itself takes a fraction of a millisecond.
#include <cstdint>

#include "common/query_blocks.cuh"
#include "cosa_params.h"

namespace cosa {
namespace {

__device__ void record(unsigned long long* slot, unsigned long long key) { atomicMin(slot, key); }

// Sequence b's lengths, by one thread, recorded into `report` (global or shared memory).
__device__ void check_lengths(const InputCheckParams& p, int b, unsigned long long* report) {
  const PagedLayout& l = p.layout;
  const int64_t cu0 = l.cu_seqlens_q[b], cu1 = l.cu_seqlens_q[b + 1];
  const int64_t lq = cu1 - cu0, lk = l.seqused_k[b];
  unsigned long long* slot = report + kCheckLengths;
  if (b == 0 && (l.cu_seqlens_q[0] != 0 || l.cu_seqlens_q[l.batch] != l.total_q)) record(slot, 0);
  if (lq < 0) {
    record(slot, 1 + b);
    return;
  }
  // The CPU path's order of conditions for one sequence.
  constexpr int kConditions = 4;
  const bool broken[kConditions] = {lq > l.max_seqlen_q, lk < lq, p.check_max_seqlen_k && lk > l.max_seqlen_k,
                                    lk > static_cast<int64_t>(l.max_pages_per_seq) * l.page_size};
  for (int c = 0; c < kConditions; ++c) {
    if (broken[c]) {
      record(slot, 1ull + l.batch + static_cast<unsigned long long>(kConditions) * b + c);
      return;
    }
  }
}

// Entry `page` of sequence b's page table row, recorded into `report` if it is outside the cache.
__device__ void check_page(const InputCheckParams& p, int b, int64_t page, unsigned long long* report) {
  const PagedLayout& l = p.layout;
  const int32_t id = l.page_table[b * l.page_table_stride + page];
  if (id < 0 || id >= l.num_pages) {
    record(report + kCheckPages, static_cast<unsigned long long>(b) * l.max_pages_per_seq + page);
  }
}

__device__ int64_t pages_of(const PagedLayout& l, int b) {
  const int64_t lk = l.seqused_k[b];
  const int64_t pages_used = lk > 0 ? (lk + l.page_size - 1) / l.page_size : 0;
  return pages_used < l.max_pages_per_seq ? pages_used : l.max_pages_per_seq;
}

// One CTA per sequence: thread 0 checks the lengths, every thread a share of the page ids.
__global__ void check_lengths_and_pages(InputCheckParams p) {
  const int b = blockIdx.x;
  if (threadIdx.x == 0) check_lengths(p, b, p.report);
  const int64_t pages = pages_of(p.layout, b);
  for (int64_t page = threadIdx.x; page < pages; page += blockDim.x) check_page(p, b, page, p.report);
}

// Small inputs without lists to check (up to kOneCtaMaxBatch sequences and kOneCtaMaxPages page
// table entries): the whole check in one CTA, the report kept in shared memory and written at the
// end both where the kernels' gate reads it and into the host's pinned copy. One launch where the
// general path takes three (the report's memset, the checks, the publication) and the gaps between
// them: about 3 us of every checked call on the H200.
constexpr int kOneCtaThreads = 512;
constexpr int kOneCtaMaxBatch = 512;
constexpr int64_t kOneCtaMaxPages = 65536;
__global__ void __launch_bounds__(kOneCtaThreads) check_lengths_and_pages_one_cta(InputCheckParams p) {
  __shared__ unsigned long long report[kNumInputChecks];
  __shared__ int64_t pages[kOneCtaMaxBatch];
  if (threadIdx.x < kNumInputChecks) report[threadIdx.x] = ~0ull;
  __syncthreads();
  for (int b = threadIdx.x; b < p.layout.batch; b += blockDim.x) {
    check_lengths(p, b, report);
    pages[b] = pages_of(p.layout, b);
  }
  __syncthreads();
  // The page table's entries side by side (at most kOneCtaMaxPages of them), each thread a stride
  // of them, whatever the lengths of the sequences.
  const int64_t row = p.layout.max_pages_per_seq;
  for (int64_t i = threadIdx.x; i < p.layout.batch * row; i += blockDim.x) {
    const int b = static_cast<int>(i / row);
    const int64_t page = i - b * row;
    if (page < pages[b]) check_page(p, b, page, report);
  }
  __syncthreads();
  if (threadIdx.x < kNumInputChecks) {
    p.report[threadIdx.x] = report[threadIdx.x];
    if (p.host_report != nullptr) p.host_report[threadIdx.x] = report[threadIdx.x];
  }
}

// One warp per list (row h * num_q_blocks + g), its lanes reading the entries side by side (and
// locating g together: locate_query_block is warp-collective).
__global__ void check_lists(InputCheckParams p) {
  const PagedLayout& l = p.layout;
  const int lane = threadIdx.x % 32;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (row >= static_cast<int64_t>(l.num_heads_q) * l.num_q_blocks) return;
  const QueryBlock block = locate_query_block(l, static_cast<int>(row % l.num_q_blocks));
  const int64_t last_candidate = block.valid ? block.last_diagonal : -1;  // a padding row lists nothing
  const int64_t count = p.counts[row];
  if (lane == 0) {
    if (count < 0 || count > last_candidate + 1) record(p.report + kCheckCountRange, row);
    if (count > p.order_row_len) record(p.report + kCheckCountRow, row);
  }
  const int64_t listed = count < p.order_row_len ? count : p.order_row_len;
  for (int64_t k = lane; k < listed; k += 32) {
    const int32_t j = p.order[row * p.order_row_len + k];
    if (j < 0 || j > last_candidate) {
      record(p.report + kCheckOrder, static_cast<unsigned long long>(row) * p.order_row_len + k);
      break;
    }
  }
}

// The finished report written straight into the host's pinned memory: a one-thread-per-word kernel
// right behind the checks, where a copy on the stream adds the copy engine's hand-offs before and
// after it (7-17 us a call with the gaps around it on the H200, against the checks' own 2 us).
__global__ void publish_report(const unsigned long long* report, unsigned long long* host_report) {
  if (threadIdx.x < kNumInputChecks) host_report[threadIdx.x] = report[threadIdx.x];
}

}  // namespace

cudaError_t run_input_checks(const InputCheckParams& params, cudaStream_t stream) {
  const PagedLayout& l = params.layout;
  if (params.order == nullptr && l.batch <= kOneCtaMaxBatch &&
      static_cast<int64_t>(l.batch) * l.max_pages_per_seq <= kOneCtaMaxPages) {
    check_lengths_and_pages_one_cta<<<1, kOneCtaThreads, 0, stream>>>(params);
    return cudaGetLastError();
  }
  cudaError_t error = cudaMemsetAsync(params.report, 0xff, kNumInputChecks * sizeof(unsigned long long), stream);
  if (error != cudaSuccess) return error;
  check_lengths_and_pages<<<params.layout.batch, 128, 0, stream>>>(params);
  if (params.order != nullptr) {
    const int64_t rows = static_cast<int64_t>(params.layout.num_heads_q) * params.layout.num_q_blocks;
    constexpr int kWarpsPerCta = 8;
    if (rows > 0) {
      const int64_t ctas = (rows + kWarpsPerCta - 1) / kWarpsPerCta;
      check_lists<<<static_cast<unsigned>(ctas), kWarpsPerCta * 32, 0, stream>>>(params);
    }
  }
  if (params.host_report != nullptr) publish_report<<<1, 32, 0, stream>>>(params.report, params.host_report);
  return cudaGetLastError();
}

}  // namespace cosa
