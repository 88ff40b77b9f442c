// The CUDA implementations of the ops kap, osk and prefill (CUDA build only): the contract and the
// kernels' limits, the device checks of the index tensors, output allocation, and the launches on
// the current stream.
#include <algorithm>
#include <cmath>

#include <cstdint>
#include <optional>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "binding/contract.h"
#include "binding/cuda_limits.h"
#include "binding/device_checks.h"
#include "binding/messages.h"
#include "cosa_params.h"

namespace cosa::binding {

namespace {

cosa::PagedLayout make_layout(const Sizes& s, const OpArgs& a, int64_t max_seqlen_k, int64_t max_k_blocks) {
  cosa::PagedLayout l;
  l.q = a.q.const_data_ptr();
  l.q_row_stride = a.q.stride(0);
  l.q_head_stride = a.q.stride(1);
  l.k_cache = a.k_cache.const_data_ptr();
  l.k_page_stride = a.k_cache.stride(0);
  l.k_row_stride = a.k_cache.stride(1);
  l.k_head_stride = a.k_cache.stride(2);
  if (a.v_cache) {
    l.v_cache = a.v_cache->const_data_ptr();
    l.v_page_stride = a.v_cache->stride(0);
    l.v_row_stride = a.v_cache->stride(1);
    l.v_head_stride = a.v_cache->stride(2);
  }
  l.page_table = a.page_table.const_data_ptr<int32_t>();
  l.page_table_stride = a.page_table.stride(0);
  l.cu_seqlens_q = a.cu_seqlens_q.const_data_ptr<int32_t>();
  l.seqused_k = a.seqused_k.const_data_ptr<int32_t>();
  l.batch = static_cast<int>(s.batch);
  l.num_heads_q = static_cast<int>(s.num_heads_q);
  l.num_heads_kv = static_cast<int>(s.num_heads_kv);
  l.head_dim = static_cast<int>(s.head_dim);
  l.page_size = static_cast<int>(s.page_size);
  l.num_pages = static_cast<int>(s.num_pages);
  l.max_pages_per_seq = static_cast<int>(s.max_pages);
  l.total_q = static_cast<int>(s.total_q);
  l.max_seqlen_q = static_cast<int>(*a.max_seqlen_q);
  l.max_seqlen_k = static_cast<int>(max_seqlen_k);
  l.num_q_blocks = static_cast<int>(num_q_blocks_bound(s.total_q, s.batch, *a.max_seqlen_q));
  l.max_k_blocks = static_cast<int>(max_k_blocks);
  l.dtype = a.q.scalar_type() == at::kBFloat16 ? cosa::DType::kBFloat16 : cosa::DType::kFloat16;
  l.softmax_scale = static_cast<float>(a.softmax_scale.value_or(1.0 / std::sqrt(static_cast<double>(s.head_dim))));
  return l;
}

void check_launch(const char* op, const char* kernel, cudaError_t error) {
  TORCH_CHECK(error == cudaSuccess, message("cosa.", op, ": the ", kernel, " launch failed: ", cudaGetErrorString(error)));
}

std::tuple<at::Tensor, at::Tensor> launch_kap(const char* op, const cosa::PagedLayout& layout, const at::Tensor& q,
                                              int64_t stride, double top_p, c10::string_view precision,
                                              cudaStream_t stream) {
  const auto int_options = q.options().dtype(at::kInt);
  at::Tensor order = at::empty({layout.num_heads_q, layout.num_q_blocks, layout.max_k_blocks}, int_options);
  at::Tensor counts = at::empty({layout.num_heads_q, layout.num_q_blocks}, int_options);
  cosa::KapParams params;
  params.layout = layout;
  params.stride = static_cast<int>(stride);
  params.top_p = static_cast<float>(top_p);
  params.precision = *cosa::parse_proxy_precision(precision);  // checked by check_scalars
  params.order = order.mutable_data_ptr<int32_t>();
  params.counts = counts.mutable_data_ptr<int32_t>();
  // The caching allocator ties the workspace to the current stream: releasing it when this
  // function returns is safe, since later users of the block are ordered after the kernel.
  at::Tensor workspace;
  if (const size_t bytes = cosa::kap_workspace_bytes(params); bytes > 0) {
    workspace = at::empty({static_cast<int64_t>(bytes)}, q.options().dtype(at::kByte));
    params.workspace = workspace.mutable_data_ptr();
  }
  if (layout.num_q_blocks > 0) check_launch(op, "KAP", cosa::run_kap(params, stream));
  return {order, counts};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> launch_osk(const char* op, const cosa::PagedLayout& layout,
                                                          const at::Tensor& q, const at::Tensor& order,
                                                          const at::Tensor& counts, double delta,
                                                          c10::string_view vote, cudaStream_t stream) {
  at::Tensor out = at::empty({layout.total_q, layout.num_heads_q, layout.head_dim}, q.options());
  at::Tensor lse = at::empty({layout.num_heads_q, layout.total_q}, q.options().dtype(at::kFloat));
  at::Tensor skipped = at::empty({layout.num_heads_q, layout.num_q_blocks}, q.options().dtype(at::kInt));
  cosa::OskParams params;
  params.layout = layout;
  params.order = order.const_data_ptr<int32_t>();
  params.counts = counts.const_data_ptr<int32_t>();
  params.delta = static_cast<float>(delta);
  params.vote = *cosa::parse_vote(vote);  // checked by check_scalars
  params.out = out.mutable_data_ptr();
  params.out_row_stride = out.stride(0);
  params.out_head_stride = out.stride(1);
  params.lse = lse.mutable_data_ptr<float>();
  params.skipped = skipped.mutable_data_ptr<int32_t>();
  if (layout.num_q_blocks > 0) check_launch(op, "OSK", cosa::run_osk(params, stream));
  return {out, lse, skipped};
}

std::tuple<at::Tensor, at::Tensor> kap_cuda(const at::Tensor& q, const at::Tensor& k_cache,
                                            const at::Tensor& page_table, const at::Tensor& cu_seqlens_q,
                                            const at::Tensor& seqused_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                                            int64_t stride, double top_p, std::optional<double> softmax_scale,
                                            c10::string_view proxy_precision) {
  const OpArgs a{"kap", q, k_cache, nullptr, page_table, cu_seqlens_q, seqused_k, nullptr, nullptr, max_seqlen_q,
                 max_seqlen_k, stride, top_p, softmax_scale, std::nullopt, std::nullopt, proxy_precision};
  const Sizes s = check_cuda_args(a);
  const c10::cuda::CUDAGuard device_guard(q.device());
  cosa::PagedLayout layout = make_layout(s, a, max_seqlen_k, ceil_div(max_seqlen_k, kBlock));
  PendingDeviceChecks checks;
  enqueue_device_checks(a, layout, checks);
  auto lists = launch_kap(a.op, layout, q, stride, top_p, proxy_precision, at::cuda::getCurrentCUDAStream().stream());
  finish_device_checks(a, s, checks);
  return lists;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> osk_cuda(const at::Tensor& q, const at::Tensor& k_cache,
                                                        const at::Tensor& v_cache, const at::Tensor& page_table,
                                                        const at::Tensor& cu_seqlens_q, const at::Tensor& seqused_k,
                                                        const at::Tensor& order, const at::Tensor& counts,
                                                        int64_t max_seqlen_q, std::optional<double> softmax_scale,
                                                        double delta, c10::string_view vote) {
  const OpArgs a{"osk", q, k_cache, &v_cache, page_table, cu_seqlens_q, seqused_k, &order, &counts, max_seqlen_q,
                 std::nullopt, std::nullopt, std::nullopt, softmax_scale, delta, vote};
  const Sizes s = check_cuda_args(a);
  const c10::cuda::CUDAGuard device_guard(q.device());
  // OSK takes no max_seqlen_k: the page table's capacity bounds every KV length (checked on the
  // device), and order's last dim is the row length of the lists.
  const int64_t kv_capacity = std::min(s.max_pages * s.page_size, kMaxInt);
  cosa::PagedLayout layout = make_layout(s, a, kv_capacity, order.size(2));
  PendingDeviceChecks checks;
  enqueue_device_checks(a, layout, checks);
  auto result = launch_osk(a.op, layout, q, order, counts, delta, vote, at::cuda::getCurrentCUDAStream().stream());
  finish_device_checks(a, s, checks);
  return result;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> prefill_cuda(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& page_table,
    const at::Tensor& cu_seqlens_q, const at::Tensor& seqused_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    int64_t stride, double top_p, std::optional<double> softmax_scale, double delta, c10::string_view vote,
    c10::string_view proxy_precision) {
  const OpArgs a{"prefill", q, k_cache, &v_cache, page_table, cu_seqlens_q, seqused_k, nullptr, nullptr,
                 max_seqlen_q, max_seqlen_k, stride, top_p, softmax_scale, delta, vote, proxy_precision};
  const Sizes s = check_cuda_args(a);
  const c10::cuda::CUDAGuard device_guard(q.device());
  cosa::PagedLayout layout = make_layout(s, a, max_seqlen_k, ceil_div(max_seqlen_k, kBlock));
  PendingDeviceChecks checks;
  enqueue_device_checks(a, layout, checks);
  // KAP then OSK on one stream, the host never waiting in between; the lists that KAP just wrote
  // satisfy the contract by construction, so they are not checked again.
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  auto [order, counts] = launch_kap(a.op, layout, q, stride, top_p, proxy_precision, stream);
  auto [out, lse, skipped] = launch_osk(a.op, layout, q, order, counts, delta, vote, stream);
  finish_device_checks(a, s, checks);
  return {out, lse, order, counts, skipped};
}

}  // namespace

}  // namespace cosa::binding

TORCH_LIBRARY_IMPL(cosa, CUDA, m) {
  m.impl("kap", &cosa::binding::kap_cuda);
  m.impl("osk", &cosa::binding::osk_cuda);
  m.impl("prefill", &cosa::binding::prefill_cuda);
}
