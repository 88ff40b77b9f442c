#include "binding/contract.h"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "binding/device_checks.h"
#include "binding/messages.h"

namespace cosa::binding {

int64_t num_q_blocks_bound(int64_t total_q, int64_t batch, int64_t max_seqlen_q) {
  return std::min(batch * ceil_div(max_seqlen_q, kBlock), (total_q + (kBlock - 1) * batch) / kBlock);
}

Sizes check_tensors(const OpArgs& a) {
  const char* op = a.op;
  const at::Tensor& q = a.q;
  std::vector<std::pair<const char*, const at::Tensor*>> tensors = {
      {"q", &q}, {"k_cache", &a.k_cache}, {"v_cache", a.v_cache}, {"page_table", &a.page_table},
      {"cu_seqlens_q", &a.cu_seqlens_q}, {"seqused_k", &a.seqused_k}, {"order", a.order}, {"counts", a.counts}};
  for (const auto& [name, t] : tensors) {
    if (!t) continue;
    COSA_CHECK_VALUE(t->device() == q.device(), op, name, " must be on ", q.device(), " like q, got ", t->device());
  }

  const auto dtype = q.scalar_type();
  COSA_CHECK_TYPE(dtype == at::kBFloat16 || dtype == at::kHalf, op, "q must be bfloat16 or float16, got ",
                  dtype_name(dtype));
  COSA_CHECK_VALUE(q.dim() == 3, op, "q must be 3-D [total_q, num_heads_q, head_dim], got shape ",
                   tuple_str(q.sizes()));
  const int64_t total_q = q.size(0), num_heads_q = q.size(1), head_dim = q.size(2);
  COSA_CHECK_VALUE(head_dim == 64 || head_dim == 128, op, "head dim must be 64 or 128, got ", head_dim,
                   " (q.shape[-1])");
  COSA_CHECK_VALUE(total_q >= 1, op, "q must hold at least one query token, got shape ", tuple_str(q.sizes()));
  COSA_CHECK_VALUE(num_heads_q >= 1, op, "q must have at least one head, got shape ", tuple_str(q.sizes()));
  for (const auto& [name, cache] : {std::pair{"k_cache", &a.k_cache}, std::pair{"v_cache", a.v_cache}}) {
    if (!cache) continue;
    COSA_CHECK_TYPE(cache->scalar_type() == dtype, op, name, " must have q's dtype ", dtype_name(dtype), ", got ",
                    dtype_name(cache->scalar_type()));
    COSA_CHECK_VALUE(cache->dim() == 4, op, name,
                     " must be 4-D [num_pages, page_size, num_heads_kv, head_dim], got shape ",
                     tuple_str(cache->sizes()));
    COSA_CHECK_VALUE(cache->size(3) == head_dim, op, name, " head dim ", cache->size(3), " differs from q's ",
                     head_dim);
  }
  const at::Tensor& k_cache = a.k_cache;
  COSA_CHECK_VALUE(!a.v_cache || a.v_cache->sizes() == k_cache.sizes(), op, "v_cache shape ",
                   tuple_str(a.v_cache ? a.v_cache->sizes() : k_cache.sizes()), " differs from k_cache shape ",
                   tuple_str(k_cache.sizes()));
  const int64_t num_pages = k_cache.size(0), page_size = k_cache.size(1), num_heads_kv = k_cache.size(2);
  COSA_CHECK_VALUE(cosa::valid_page_size(page_size), op,
                   "page size (k_cache.shape[1]) must be a power of two in [16, 256], got ", page_size);
  COSA_CHECK_VALUE(num_heads_kv > 0 && num_heads_q % num_heads_kv == 0, op, "num_heads_q (", num_heads_q,
                   ") must be a multiple of num_heads_kv (", num_heads_kv, ")");

  for (const auto& [name, t, dims] : {std::tuple{"page_table", &a.page_table, 2},
                                      std::tuple{"cu_seqlens_q", &a.cu_seqlens_q, 1},
                                      std::tuple{"seqused_k", &a.seqused_k, 1}, std::tuple{"order", a.order, 3},
                                      std::tuple{"counts", a.counts, 2}}) {
    if (!t) continue;
    COSA_CHECK_TYPE(t->scalar_type() == at::kInt, op, name, " must be int32, got ", dtype_name(t->scalar_type()));
    COSA_CHECK_VALUE(t->dim() == dims, op, name, " must be ", dims, "-D, got shape ", tuple_str(t->sizes()));
  }
  const int64_t batch = a.seqused_k.size(0);
  COSA_CHECK_VALUE(batch >= 1, op, "seqused_k must hold at least one sequence");
  COSA_CHECK_VALUE(a.cu_seqlens_q.size(0) == batch + 1, op, "cu_seqlens_q must have batch + 1 = ", batch + 1,
                   " entries, got ", a.cu_seqlens_q.size(0));
  COSA_CHECK_VALUE(a.page_table.size(0) == batch, op, "page_table must have batch = ", batch, " rows, got ",
                   a.page_table.size(0));
  return Sizes{batch, total_q, num_heads_q, num_heads_kv, head_dim, num_pages, page_size, a.page_table.size(1)};
}

void check_scalars(const OpArgs& a) {
  const char* op = a.op;
  if (a.max_seqlen_q) {
    COSA_CHECK_VALUE(*a.max_seqlen_q >= 1, op, "max_seqlen_q must be a positive int, got ", *a.max_seqlen_q);
  }
  if (a.max_seqlen_q && a.max_seqlen_k) {
    COSA_CHECK_VALUE(*a.max_seqlen_k >= *a.max_seqlen_q, op, "max_seqlen_k must be an int >= max_seqlen_q (",
                     *a.max_seqlen_q, "), got ", *a.max_seqlen_k);
  }
  if (a.stride) {
    COSA_CHECK_VALUE(cosa::valid_stride(*a.stride), op, "stride must be a positive divisor of ", kBlock,
                     ", got ", *a.stride);
  }
  if (a.top_p) {
    COSA_CHECK_VALUE(cosa::valid_top_p(*a.top_p), op, "top_p must be in (0, 1], got ", *a.top_p);
  }
  if (a.softmax_scale) {
    COSA_CHECK_VALUE(cosa::valid_softmax_scale(*a.softmax_scale), op,
                     "softmax_scale must be a positive number in float32's normal range [",
                     std::numeric_limits<float>::min(), ", ", std::numeric_limits<float>::max(), "], got ",
                     *a.softmax_scale);
  }
  if (a.delta) {
    COSA_CHECK_VALUE(cosa::valid_delta(*a.delta), op, "delta must be a number of magnitude at most ",
                     std::numeric_limits<float>::max(), " (finite in float32), <= 0 (which disables the "
                     "in-kernel skip) or at least ", std::numeric_limits<float>::min(),
                     " (float32's smallest normal number), got ", *a.delta);
  }
  if (a.vote) {
    COSA_CHECK_VALUE(cosa::parse_vote(*a.vote), op, "vote must be ", cosa::kVoteScopeNames, ", got '",
                     std::string(*a.vote), "'");
  }
  if (a.proxy_precision) {
    COSA_CHECK_VALUE(cosa::parse_proxy_precision(*a.proxy_precision), op, "proxy_precision must be ",
                     cosa::kProxyPrecisionNames, ", got '", std::string(*a.proxy_precision), "'");
  }
}

void check_list_shapes(const OpArgs& a, const Sizes& s, int64_t max_seqlen_q) {
  if (!a.order) return;
  const char* op = a.op;
  const int64_t hq = s.num_heads_q, rows = num_q_blocks_bound(s.total_q, s.batch, max_seqlen_q);
  const at::Tensor &order = *a.order, &counts = *a.counts;
  COSA_CHECK_VALUE(counts.size(0) == hq && counts.size(1) == rows, op,
                   "counts must have shape [num_heads_q, num_q_blocks] = (", hq, ", ", rows, "), got ",
                   tuple_str(counts.sizes()));
  COSA_CHECK_VALUE(order.size(0) == hq && order.size(1) == rows && order.size(2) >= 1, op, "order must have shape [",
                   hq, ", ", rows, ", max_k_blocks], got ", tuple_str(order.sizes()));
}

namespace {

std::vector<int64_t> to_host(const at::Tensor& t) {
  const at::Tensor host = t.to(at::kCPU, at::kLong).contiguous();
  return {host.const_data_ptr<int64_t>(), host.const_data_ptr<int64_t>() + host.numel()};
}

}  // namespace

IndexData read_index_data(const OpArgs& a) {
  IndexData d{to_host(a.cu_seqlens_q), to_host(a.seqused_k), to_host(a.page_table), {}, {}};
  if (a.order) {
    d.order = to_host(*a.order);
    d.counts = to_host(*a.counts);
  }
  return d;
}

void check_lengths_data(const OpArgs& a, const Sizes& s, const IndexData& d) {
  const char* op = a.op;
  const std::vector<int64_t>&cu = d.cu, &lk = d.lk;
  if (cu[0] != 0 || cu[s.batch] != s.total_q) {
    fail_value(op, message("cu_seqlens_q must start at 0 and end at total_q = ", s.total_q, ", got ", cu[0], " .. ",
                           cu[s.batch]));
  }
  for (int64_t b = 0; b < s.batch; ++b) {
    if (cu[b + 1] < cu[b]) {
      fail_value(op, message("cu_seqlens_q must be non-decreasing, got ", cu[b], " then ", cu[b + 1], " at index ", b));
    }
  }
  const int64_t capacity = s.max_pages * s.page_size;
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t lq = cu[b + 1] - cu[b];
    if (a.max_seqlen_q && lq > *a.max_seqlen_q) {
      fail_value(op, message("sequence ", b, " has ", lq, " queries, more than max_seqlen_q = ", *a.max_seqlen_q));
    }
    if (lk[b] < lq) fail_value(op, message("seqused_k[", b, "] = ", lk[b], " is shorter than the sequence's ", lq, " queries"));
    if (a.max_seqlen_k && lk[b] > *a.max_seqlen_k) {
      fail_value(op, message("seqused_k[", b, "] = ", lk[b], " exceeds max_seqlen_k = ", *a.max_seqlen_k));
    }
    if (lk[b] > capacity) {
      fail_value(op, message("seqused_k[", b, "] = ", lk[b], " exceeds page_table's capacity of ", capacity, " tokens"));
    }
  }
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t page = 0; page < ceil_div(lk[b], s.page_size); ++page) {
      const int64_t id = d.page_table[b * s.max_pages + page];
      if (id < 0 || id >= s.num_pages) {
        fail_value(op, message("page_table[", b, ", ", page, "] = ", id, " is outside the cache's ", s.num_pages,
                               " pages"));
      }
    }
  }
}

void check_lists_data(const OpArgs& a, const Sizes& s, const IndexData& d, int64_t max_seqlen_q) {
  if (!a.order) return;
  const char* op = a.op;
  const int64_t rows = num_q_blocks_bound(s.total_q, s.batch, max_seqlen_q), row_len = a.order->size(2);
  // The last causal candidate of each query block, its last diagonal block; -1: padding.
  std::vector<int64_t> last_candidate(rows, -1);
  for (int64_t b = 0, g = 0; b < s.batch; ++b) {
    const int64_t lq = d.cu[b + 1] - d.cu[b];
    for (int64_t i = 0; i < ceil_div(lq, kBlock); ++i, ++g) {
      last_candidate[g] = last_diagonal_block(d.lk[b] - lq, lq, i);
    }
  }
  const int64_t lists = s.num_heads_q * rows;
  for (int64_t row = 0; row < lists; ++row) {
    const int64_t count = d.counts[row], g = row % rows;
    if (count < 0 || count > last_candidate[g] + 1) {
      fail_value(op, message("counts[", row / rows, ", ", g, "] = ", count, " is outside [0, ", last_candidate[g] + 1,
                             "]"));
    }
  }
  for (int64_t row = 0; row < lists; ++row) {
    if (d.counts[row] > row_len) {
      fail_value(op, message("counts[", row / rows, ", ", row % rows, "] = ", d.counts[row],
                             " exceeds order's row length ", row_len));
    }
  }
  for (int64_t row = 0; row < lists; ++row) {
    const int64_t g = row % rows;
    for (int64_t k = 0; k < d.counts[row]; ++k) {
      const int64_t j = d.order[row * row_len + k];
      if (j < 0 || j > last_candidate[g]) {
        fail_value(op, message("order[", row / rows, ", ", g, ", ", k, "] = ", j,
                               " is not a causal block of its query block (0..", last_candidate[g], ")"));
      }
    }
  }
}

namespace {

// The op cosa::check_args (its schema, in csrc/torch_binding.cpp, says what it does).
std::tuple<int64_t, int64_t> check_args(c10::string_view op_name, const at::Tensor& q, const at::Tensor& k_cache,
                                        const at::Tensor& page_table, const at::Tensor& cu_seqlens_q,
                                        const at::Tensor& seqused_k, const std::optional<at::Tensor>& v_cache,
                                        const std::optional<at::Tensor>& order,
                                        const std::optional<at::Tensor>& counts, std::optional<int64_t> max_seqlen_q,
                                        std::optional<int64_t> max_seqlen_k, std::optional<int64_t> stride,
                                        std::optional<double> top_p, std::optional<double> softmax_scale,
                                        std::optional<double> delta, std::optional<c10::string_view> vote,
                                        std::optional<c10::string_view> proxy_precision) {
  const std::string op(op_name);
  TORCH_CHECK_VALUE(order.has_value() == counts.has_value(), "cosa.check_args: order and counts come together");
  OpArgs a{op.c_str(), q, k_cache, v_cache ? &*v_cache : nullptr, page_table, cu_seqlens_q, seqused_k,
           order ? &*order : nullptr, counts ? &*counts : nullptr, max_seqlen_q, max_seqlen_k, stride, top_p,
           softmax_scale, delta, vote, proxy_precision};
  const Sizes s = check_tensors(a);
  check_scalars(a);
  if (max_seqlen_q) check_list_shapes(a, s, *max_seqlen_q);

  const bool derive = !max_seqlen_q || !max_seqlen_k;
  const bool readable = !q.is_meta() && !capturing_cuda_graph(q);
  if (!derive && (!readable || (!q.is_cpu() && !device_checks_enabled()))) return {*max_seqlen_q, *max_seqlen_k};
  COSA_CHECK_VALUE(readable, a.op, "max_seqlen_q and max_seqlen_k must be given ",
                   q.is_meta() ? "for tensors on meta" : "while a CUDA graph is being captured",
                   " (they are derived by reading cu_seqlens_q and seqused_k on the host)");
  const IndexData d = read_index_data(a);
  check_lengths_data(a, s, d);
  if (!max_seqlen_q) {
    int64_t longest = 0;  // >= 1: total_q >= 1, and cu_seqlens_q ends at total_q
    for (int64_t b = 0; b < s.batch; ++b) longest = std::max(longest, d.cu[b + 1] - d.cu[b]);
    a.max_seqlen_q = longest;
    check_list_shapes(a, s, longest);
  }
  if (!max_seqlen_k) {
    // At least max_seqlen_q, as the contract wants: a given max_seqlen_q may exceed every length.
    a.max_seqlen_k = std::max(*std::max_element(d.lk.begin(), d.lk.end()), *a.max_seqlen_q);
  }
  check_lists_data(a, s, d, *a.max_seqlen_q);
  return {*a.max_seqlen_q, *a.max_seqlen_k};
}

}  // namespace

}  // namespace cosa::binding

TORCH_LIBRARY_IMPL(cosa, CompositeExplicitAutograd, m) { m.impl("check_args", &cosa::binding::check_args); }
