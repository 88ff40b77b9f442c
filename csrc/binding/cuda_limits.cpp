#include "binding/cuda_limits.h"

#include <utility>

#include <ATen/ATen.h>

#include "binding/messages.h"

namespace cosa::binding {

namespace {

// The kernels address q/k/v rows with 16-byte vector loads or TMA: the head dim must be
// contiguous, every other stride a whole number of 16-byte units, the base 16-byte aligned.
void check_rows_aligned(const char* op, const char* name, const at::Tensor& t) {
  bool strides_ok = t.stride(-1) == 1;
  for (int64_t dim = 0; dim + 1 < t.dim(); ++dim) strides_ok = strides_ok && t.stride(dim) % 8 == 0;
  COSA_CHECK_VALUE(strides_ok, op, name,
                   " must have a contiguous last dim and its other strides multiples of 8 elements "
                   "(16-byte aligned rows), got strides ",
                   tuple_str(t.strides()));
  COSA_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0, op, name,
                   "'s data must be 16-byte aligned");
}

// Elements from a tensor's first to its last element, plus one (cosa::q_span_elements and
// cosa::k_cache_span_elements, which run_kap checks, are the same from the layout's sizes and strides).
int64_t element_span(const at::Tensor& t) {
  int64_t span = 1;
  for (int64_t dim = 0; dim < t.dim(); ++dim) span += (t.size(dim) - 1) * t.stride(dim);
  return t.numel() == 0 ? 0 : span;
}

// What the kernels and their plain-data view (cosa_params.h) need beyond the contract.
void check_cuda_limits(const OpArgs& a, const Sizes& s) {
  const char* op = a.op;
  COSA_CHECK_VALUE(a.q.is_cuda(), op, "q must be a CUDA tensor, got one on ", a.q.device());
  if (a.stride) {
    constexpr int64_t kKapMaxSeqlenK = cosa::kKapMaxKeyBlocks * kBlock;
    COSA_CHECK_VALUE(*a.max_seqlen_k <= kKapMaxSeqlenK, op, "max_seqlen_k = ", *a.max_seqlen_k,
                     " exceeds the CUDA KAP limit of ", kKapMaxSeqlenK,
                     " tokens (16384 key blocks, each list sorted in shared memory)");
    COSA_CHECK_VALUE(cosa::valid_kap_stride(*a.stride), op, "stride must be ", cosa::kKapStrideNames,
                     " on CUDA, got ", *a.stride,
                     " (the reference, cosa.reference.kap, accepts any divisor of ", kBlock, ")");
    const int64_t score_tiles =
        cosa::kap_score_tiles_bound(s.batch, *a.max_seqlen_q, s.total_q, static_cast<int>(*a.stride));
    COSA_CHECK_VALUE(score_tiles <= cosa::kKapMaxScoreTiles, op, "the batch of ", s.batch,
                     " sequences (cu_seqlens_q) needs ", score_tiles, " KAP scoring tiles of 128 rows at stride ",
                     *a.stride, ", more than CUDA's 65535 (a grid dimension): call with fewer sequences");
    for (const auto& [name, tensor] : {std::pair<const char*, const at::Tensor*>{"q", &a.q},
                                       std::pair<const char*, const at::Tensor*>{"k_cache", &a.k_cache}}) {
      COSA_CHECK_VALUE(element_span(*tensor) <= cosa::kKapMaxSpanElements, op, name, " spans ",
                       element_span(*tensor), " elements, more than the CUDA KAP limit of ",
                       cosa::kKapMaxSpanElements, " (2^32 16-byte units)");
    }
    const bool fp8_proxy =
        a.proxy_precision && cosa::resolve_proxy_precision(*cosa::parse_proxy_precision(*a.proxy_precision),
                                                           static_cast<int>(*a.max_seqlen_k)) ==
                                 cosa::ProxyPrecision::kE4M3;
    const int64_t key_copy_bytes =
        cosa::kap_fp8_key_copy_bytes(s.batch, *a.max_seqlen_k, s.num_heads_kv, s.head_dim);
    COSA_CHECK_VALUE(!fp8_proxy || key_copy_bytes <= cosa::kKapMaxFp8KeyCopyBytes, op,
                     "the fp8 proxy's copy of the keys (batch x max_seqlen_k rounded up to 128 x num_heads_kv x "
                     "head_dim = ", key_copy_bytes, " bytes) exceeds the CUDA KAP limit of 2^36 bytes: call with "
                     "fewer sequences, or proxy_precision='native'");
  }
  check_rows_aligned(op, "q", a.q);
  check_rows_aligned(op, "k_cache", a.k_cache);
  if (a.v_cache) check_rows_aligned(op, "v_cache", *a.v_cache);
  COSA_CHECK_VALUE(a.page_table.size(1) <= 1 || a.page_table.stride(1) == 1, op,
                   "page_table rows must be contiguous (stride 1 along dim 1), got strides ",
                   tuple_str(a.page_table.strides()));
  COSA_CHECK_VALUE(a.cu_seqlens_q.is_contiguous(), op, "cu_seqlens_q must be contiguous");
  COSA_CHECK_VALUE(a.seqused_k.is_contiguous(), op, "seqused_k must be contiguous");
  for (const auto& [name, value] : {std::pair{"total_q (q.shape[0])", s.total_q},
                                    std::pair{"num_pages (k_cache.shape[0])", s.num_pages},
                                    std::pair{"max_pages (page_table.shape[1])", s.max_pages},
                                    std::pair{"max_seqlen_q", *a.max_seqlen_q},
                                    std::pair{"max_seqlen_k", a.max_seqlen_k.value_or(0)}}) {
    COSA_CHECK_VALUE(value <= kMaxInt, op, name, " = ", value, " exceeds the kernels' int32 range");
  }
  if (a.order) {
    COSA_CHECK_VALUE(a.order->size(2) <= kMaxInt, op, "order's last dim ", a.order->size(2),
                     " exceeds the kernels' int32 range");
    COSA_CHECK_VALUE(a.order->is_contiguous(), op, "order must be contiguous");
    COSA_CHECK_VALUE(a.counts->is_contiguous(), op, "counts must be contiguous");
  }
}

}  // namespace

Sizes check_cuda_args(const OpArgs& a) {
  const Sizes s = check_tensors(a);
  check_scalars(a);
  check_list_shapes(a, s, *a.max_seqlen_q);
  check_cuda_limits(a, s);
  return s;
}

}  // namespace cosa::binding
