// The ops' argument contract (spec section 1 and the ops' arguments), which every path runs: the
// CUDA ops before they launch (csrc/binding/launchers.cpp), the CPU ops and the Python wrappers
// through the op cosa::check_args (registered in contract.cpp). The checks of the kernels' own limits, which only the CUDA ops
// have, are in csrc/binding/cuda_limits.cpp.
//
// Why the contract is written here, once, rather than in Python: the CUDA path is the hot one and
// C++ checks keep Python off it, while the CPU path and the Python wrappers reach the very same
// code through one op call, so that every path raises the same errors (TypeError for a wrong dtype,
// ValueError for a wrong value, each naming the op and the argument) in the same order. Python checks
// what C++ cannot see, the Python types of the wrappers' arguments (cosa/validation.py), and the
// tuning arguments' domains, which the wrappers and the integrations check before any call
// (cosa/tuning.py, in the same words: both languages' predicates follow one table, cosa_tuning.h).
#pragma once

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include "cosa_contract.h"

namespace cosa::binding {

constexpr int64_t kBlock = cosa::kBlockSize;  // the logical block (spec section 1)

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Rows of order/counts/skipped: spec section 2, "row count without host synchronisation".
int64_t num_q_blocks_bound(int64_t total_q, int64_t batch, int64_t max_seqlen_q);

// The arguments of kap / osk / prefill that the contract covers; what an op lacks is null or empty.
struct OpArgs {
  const char* op;
  const at::Tensor& q;
  const at::Tensor& k_cache;
  const at::Tensor* v_cache;
  const at::Tensor& page_table;
  const at::Tensor& cu_seqlens_q;
  const at::Tensor& seqused_k;
  const at::Tensor* order;
  const at::Tensor* counts;
  std::optional<int64_t> max_seqlen_q;
  std::optional<int64_t> max_seqlen_k;
  std::optional<int64_t> stride;
  std::optional<double> top_p;
  std::optional<double> softmax_scale;
  std::optional<double> delta;
  std::optional<c10::string_view> vote;
  std::optional<c10::string_view> proxy_precision = std::nullopt;
};

// Sizes of the paged layout, read from checked shapes.
struct Sizes {
  int64_t batch, total_q, num_heads_q, num_heads_kv, head_dim, num_pages, page_size, max_pages;
};

// Devices, dtypes and shapes of the tensors (spec section 1); reads no tensor data.
Sizes check_tensors(const OpArgs& a);
// The tuning arguments (the domains of cosa_contract.h), and the max lengths that were given.
void check_scalars(const OpArgs& a);
// Shapes of the block lists given to OSK.
void check_list_shapes(const OpArgs& a, const Sizes& s, int64_t max_seqlen_q);

// Host copies of the index tensors, as int64, for the checks of their contents.
struct IndexData {
  std::vector<int64_t> cu, lk, page_table, order, counts;  // page_table, order, counts row-major
};
IndexData read_index_data(const OpArgs& a);

// The lengths and the page table (spec section 1), in the order in which the device kernel
// (csrc/checks/) ranks its findings: the first broken condition is the one reported. A bound
// that is absent (a max length still to be derived, or OSK's max_seqlen_k) is not checked.
void check_lengths_data(const OpArgs& a, const Sizes& s, const IndexData& d);
// The block lists given to OSK: every count in [0, last diagonal block + 1] and within order's rows, every
// listed block a causal candidate of its query block, so that OSK never reads outside a
// sequence's pages. Needs the lengths checked first.
void check_lists_data(const OpArgs& a, const Sizes& s, const IndexData& d, int64_t max_seqlen_q);

}  // namespace cosa::binding
