// Torch-free parameter structs shared by the torch binding (csrc/binding/launchers.cpp) and the CUDA
// kernels. Everything is plain data: raw pointers, element strides, sizes (composition, no
// inheritance: cosa_c_api.h mirrors them for C callers, and c_api.cpp checks every field of the
// mirror against these).
// Semantics: docs/spec.md (the contract that every implementation of the ops agrees on).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "cosa_contract.h"

namespace cosa {

enum class DType : int { kBFloat16 = 0, kFloat16 = 1 };

// The paged, varlen, GQA, prefix layout of spec section 1.
// Query block numbering: sequence b owns ceil(Lq_b / 128) query blocks, numbered back to back
// over the batch (block g of the packed numbering is block i of sequence b). The order/counts/
// skipped tensors have `num_q_blocks` rows: an upper bound of that total that the host can
// compute without reading cu_seqlens_q (no synchronisation). Rows past the real total are
// padding: KAP writes count 0 and -1 entries there, OSK writes skipped = 0 there.
struct PagedLayout {
  // q: [total_q, num_heads_q, head_dim], head_dim contiguous.
  const void* q = nullptr;
  int64_t q_row_stride = 0;   // elements between consecutive tokens
  int64_t q_head_stride = 0;  // elements between consecutive heads
  // k_cache, v_cache: [num_pages, page_size, num_heads_kv, head_dim], head_dim contiguous.
  const void* k_cache = nullptr;
  int64_t k_page_stride = 0, k_row_stride = 0, k_head_stride = 0;
  const void* v_cache = nullptr;  // unused by KAP
  int64_t v_page_stride = 0, v_row_stride = 0, v_head_stride = 0;
  // page_table: [batch, max_pages_per_seq]; token t of sequence b lives in page
  // page_table[b * page_table_stride + t / page_size], row t % page_size.
  const int32_t* page_table = nullptr;
  int64_t page_table_stride = 0;
  const int32_t* cu_seqlens_q = nullptr;  // [batch + 1]
  const int32_t* seqused_k = nullptr;     // [batch], Lk_b >= Lq_b (any prefix P_b = Lk_b - Lq_b)

  int batch = 0;
  int num_heads_q = 0;
  int num_heads_kv = 0;  // num_heads_q % num_heads_kv == 0; q head h reads kv head h / (Hq/Hkv)
  int head_dim = 0;      // 64 or 128
  int page_size = 0;     // power of two, 16..256 (valid_page_size)
  int num_pages = 0;
  int max_pages_per_seq = 0;
  int total_q = 0;
  int max_seqlen_q = 0;
  int max_seqlen_k = 0;
  int num_q_blocks = 0;  // rows of order/counts/skipped (see above)
  int max_k_blocks = 0;  // ceil(max_seqlen_k / 128): last dim of order
  DType dtype = DType::kBFloat16;
  float softmax_scale = 0.f;  // sigma
  // When set: the report (InputCheckParams::report, kNumInputChecks words) that the device input
  // checks wrote earlier on the stream. Every KAP and OSK kernel then does nothing unless each check
  // passed, so that the host can enqueue the kernels before it reads the report back and the GPU
  // does not wait for that round trip.
  const unsigned long long* input_report = nullptr;
};

// Rows the kernels read in 16-byte chunks: a 16-byte aligned base and strides that are non-negative
// multiples of 8 elements (2-byte elements, head_dim contiguous; a tensor's strides are never negative,
// and the TMA descriptors take none).
inline bool rows_aligned(const void* base, int64_t stride_a, int64_t stride_b, int64_t stride_c = 0) {
  return reinterpret_cast<uintptr_t>(base) % 16 == 0 && stride_a >= 0 && stride_b >= 0 && stride_c >= 0 &&
         stride_a % 8 == 0 && stride_b % 8 == 0 && stride_c % 8 == 0;
}

// What run_kap and run_osk check of a layout's plain data before any launch (cudaErrorInvalidValue
// otherwise), so that a C API caller's zeroed or mistaken struct fails there instead of in a kernel.
// The torch binding checks all of it, and the contents of the index tensors, with messages.
inline bool valid_layout(const PagedLayout& l) {
  return l.q != nullptr && l.k_cache != nullptr && l.page_table != nullptr && l.cu_seqlens_q != nullptr &&
         l.seqused_k != nullptr && l.batch >= 1 && l.num_heads_q >= 1 && l.num_heads_kv >= 1 &&
         l.num_heads_q % l.num_heads_kv == 0 && (l.head_dim == 64 || l.head_dim == 128) &&
         valid_page_size(l.page_size) && (l.dtype == DType::kBFloat16 || l.dtype == DType::kFloat16) &&
         valid_softmax_scale(l.softmax_scale) && l.total_q >= 0 && l.num_q_blocks >= 0 &&
         l.max_k_blocks >= 0 && l.max_seqlen_q >= 0 && l.max_seqlen_k >= 0 && l.page_table_stride >= 0 &&
         rows_aligned(l.q, l.q_row_stride, l.q_head_stride) &&
         rows_aligned(l.k_cache, l.k_page_stride, l.k_row_stride, l.k_head_stride);
}

// log2 of a valid page size: token t lies in page-table entry t >> log2_page_size, row
// t & (page_size - 1). One bit-scan instruction on either side.
__host__ __device__ inline int log2_page_size(int page_size) {
#ifdef __CUDA_ARCH__
  return __ffs(page_size) - 1;
#else
  return __builtin_ctz(static_cast<unsigned>(page_size));
#endif
}

// The proxy that `precision` selects for a problem whose longest key sequence is max_seqlen_k.
inline ProxyPrecision resolve_proxy_precision(ProxyPrecision precision, int max_seqlen_k) {
  if (precision != ProxyPrecision::kAuto) return precision;
  return max_seqlen_k >= COSA_FP8_PROXY_MIN_KEYS ? ProxyPrecision::kE4M3 : ProxyPrecision::kNative;
}

// KAP (spec section 2). The binding validates the inputs, data included, before launch; run_kap
// refuses what valid_kap_params does not accept.
struct KapParams {
  PagedLayout layout;
  int stride = COSA_DEFAULT_STRIDE;         // valid_kap_stride
  float top_p = float(COSA_DEFAULT_TOP_P);  // (0, 1]
  ProxyPrecision precision = kDefaultProxyPrecision;
  // Outputs, contiguous: order [num_heads_q, num_q_blocks, max_k_blocks] (list then -1 padding),
  // counts [num_heads_q, num_q_blocks].
  int32_t* order = nullptr;
  int32_t* counts = nullptr;
  // Scratch memory of kap_workspace_bytes(params) bytes, allocated by the caller (may be null
  // when that size is 0). Contents on entry are undefined.
  void* workspace = nullptr;
};

// OSK (spec section 3).
struct OskParams {
  PagedLayout layout;
  const int32_t* order = nullptr;   // [num_heads_q, num_q_blocks, max_k_blocks]
  const int32_t* counts = nullptr;  // [num_heads_q, num_q_blocks]
  float delta = float(COSA_DEFAULT_DELTA);  // valid_delta; <= 0 disables the in-kernel skip
  VoteScope vote = kDefaultVoteScope;
  // out: [total_q, num_heads_q, head_dim], same dtype as q, head_dim contiguous; written in
  // 16-byte chunks, so its base is 16-byte aligned and its strides are multiples of 8 elements.
  void* out = nullptr;
  int64_t out_row_stride = 0, out_head_stride = 0;
  float* lse = nullptr;        // [num_heads_q, total_q], contiguous
  // [num_heads_q, num_q_blocks], contiguous: the 64-row halves of the tile whose P V work the vote
  // skipped, summed over the list (a tile-wide skip counts 2).
  int32_t* skipped = nullptr;
};

// KAP sorts each list in shared memory (kap/kap_select_kernel.cuh): at most this many key blocks.
constexpr int64_t kKapMaxKeyBlocks = 16384;

// KAP's scoring kernels hold row starts as 32-bit offsets in 16-byte units: q and the key cache
// each span at most 2^32 such units (2^35 two-byte elements).
constexpr int64_t kKapMaxSpanElements = (int64_t{1} << 32) * 8;

// Elements from the first to the last element of q, and of the key cache, plus one (0 when empty):
// what the binding computes from the tensors' sizes and strides, here from the layout's.
inline int64_t q_span_elements(const PagedLayout& l) {
  if (l.total_q <= 0 || l.num_heads_q <= 0) return 0;
  return (int64_t{l.total_q} - 1) * l.q_row_stride + (int64_t{l.num_heads_q} - 1) * l.q_head_stride + l.head_dim;
}
inline int64_t k_cache_span_elements(const PagedLayout& l) {
  if (l.num_pages <= 0 || l.page_size <= 0 || l.num_heads_kv <= 0) return 0;
  return (int64_t{l.num_pages} - 1) * l.k_page_stride + (int64_t{l.page_size} - 1) * l.k_row_stride +
         (int64_t{l.num_heads_kv} - 1) * l.k_head_stride + l.head_dim;
}

// The fp8 proxy's copy of the keys holds every sequence at the longest one's length, one byte an
// element, and the scoring kernels address it by 32-bit offsets in 16-byte units: at most 2^36 bytes.
constexpr int64_t kKapMaxFp8KeyCopyBytes = int64_t{16} << 32;
inline int64_t kap_fp8_key_copy_bytes(int64_t batch, int64_t max_seqlen_k, int64_t num_heads_kv, int64_t head_dim) {
  return batch * ((max_seqlen_k + 127) / 128 * 128) * num_heads_kv * head_dim;
}

// KAP scores its proxy rows in tiles of 128 rows of one sequence, one scoring CTA row per tile along
// the grid's z dimension, which CUDA caps at 65535.
constexpr int kKapScoreTileRows = 128;
constexpr int64_t kKapMaxScoreTiles = 65535;

// The scoring tiles KAP launches, from shapes alone: an upper bound of sum_b ceil(ceil(Lq_b / s) /
// 128), the smaller of the longest sequence's count times the batch and the bound from total_q.
inline int64_t kap_score_tiles_bound(int64_t batch, int64_t max_seqlen_q, int64_t total_q, int stride) {
  const int64_t rows_max = (max_seqlen_q + stride - 1) / stride;
  const int64_t by_max = batch * ((rows_max + kKapScoreTileRows - 1) / kKapScoreTileRows);
  const int64_t rows_total_bound = (total_q + batch * (stride - 1)) / stride;
  const int64_t by_total = (rows_total_bound + batch * (kKapScoreTileRows - 1)) / kKapScoreTileRows;
  return by_max < by_total ? by_max : by_total;
}

// The plain-data checks of run_kap and run_osk (see valid_layout), with the tuning arguments' domains
// of cosa_contract.h (top_p's is [0, 1] here: a top_p that the binding accepts may round to 0 in
// float32). KAP's also hold its size limits,
// past which its 32-bit offsets would wrap (wrong lists, no error): the binding refuses the same
// sizes with messages (check_cuda_limits in csrc/binding/cuda_limits.cpp).
inline bool valid_kap_params(const KapParams& p) {
  const PagedLayout& l = p.layout;
  if (!valid_layout(l) || !valid_kap_stride(p.stride) || !valid_proxy_precision(p.precision)) {
    return false;
  }
  const bool fp8_proxy = resolve_proxy_precision(p.precision, l.max_seqlen_k) == ProxyPrecision::kE4M3;
  return kap_score_tiles_bound(l.batch, l.max_seqlen_q, l.total_q, p.stride) <= kKapMaxScoreTiles &&
         // Each list has room for every candidate block of the longest key sequence.
         int64_t{l.max_k_blocks} * kBlockSize >= l.max_seqlen_k && l.max_k_blocks <= kKapMaxKeyBlocks &&
         q_span_elements(l) <= kKapMaxSpanElements && k_cache_span_elements(l) <= kKapMaxSpanElements &&
         // The copy's rows per sequence are the lists' length in keys (the binding's max_seqlen_k
         // rounded up to 128).
         (!fp8_proxy || kap_fp8_key_copy_bytes(l.batch, int64_t{l.max_k_blocks} * kBlockSize, l.num_heads_kv,
                                               l.head_dim) <= kKapMaxFp8KeyCopyBytes) &&
         p.top_p >= 0.f && p.top_p <= 1.f &&  // 0: a top_p below float32's range
         p.order != nullptr && p.counts != nullptr;
}

inline bool valid_osk_params(const OskParams& p) {
  const PagedLayout& l = p.layout;
  return valid_layout(l) && l.v_cache != nullptr &&
         rows_aligned(l.v_cache, l.v_page_stride, l.v_row_stride, l.v_head_stride) && p.order != nullptr &&
         p.counts != nullptr && p.out != nullptr && rows_aligned(p.out, p.out_row_stride, p.out_head_stride) &&
         p.lse != nullptr && p.skipped != nullptr && valid_delta(p.delta) && valid_vote(p.vote);
}

// The data-dependent argument checks of the binding (csrc/checks/input_checks.cu): the conditions of
// spec section 1 on the lengths and the page table and, when `order` is set, those of spec section 3
// on the block lists, evaluated on the device in one pass. Each slot of `report` receives the
// smallest key of a failing element (UINT64_MAX when none), in the order in which the CPU path
// (cosa/validation.py) reports failures, so the host reads back kNumInputChecks integers.
enum InputCheck : int {
  kCheckLengths = 0,     // key 0: cu_seqlens_q ends; 1 + b: decreasing at b; 1 + B + 4 b + c: condition c of b
  kCheckPages = 1,       // key b * max_pages_per_seq + p: page id outside the cache
  kCheckCountRange = 2,  // key h * num_q_blocks + g: counts outside [0, last diagonal block + 1]
  kCheckCountRow = 3,    // key h * num_q_blocks + g: counts longer than order's rows
  kCheckOrder = 4,       // key (h * num_q_blocks + g) * order_row_len + k: not a causal candidate
  kNumInputChecks = 5,
};

struct InputCheckParams {
  PagedLayout layout;
  bool check_max_seqlen_k = true;   // OSK has no max_seqlen_k argument
  const int32_t* order = nullptr;   // null: lengths and pages only
  const int32_t* counts = nullptr;
  int order_row_len = 0;
  unsigned long long* report = nullptr;  // [kNumInputChecks], written by run_input_checks
  // Where run_input_checks publishes the finished report for the host: pinned host memory, as the
  // device addresses it (unified addressing). Null: the caller copies `report` back itself.
  unsigned long long* host_report = nullptr;
};

// Launchers: enqueue on `stream`, never synchronise, return the launch error (if any).
size_t kap_workspace_bytes(const KapParams& params);
cudaError_t run_kap(const KapParams& params, cudaStream_t stream);
cudaError_t run_osk(const OskParams& params, cudaStream_t stream);
cudaError_t run_input_checks(const InputCheckParams& params, cudaStream_t stream);

}  // namespace cosa
