// The torch binding of the CoSA ops, and the only file of the project that includes torch.
// Every build declares the op schemas (TORCH_LIBRARY); the CUDA build (COSA_WITH_CUDA) adds their
// CUDA implementations: argument checks, output allocation, launch on the current stream. The CPU
// implementations (the Python reference) and the fake kernels are registered from Python
// (cosa/ops.py), and the argument checks here mirror cosa/validation.py, messages included.

// Python.h comes first, as CPython asks. The extension is built against the stable ABI
// (Py_LIMITED_API); its module has no methods: importing it runs the registrations below.
#include <Python.h>

#include <torch/library.h>

#ifdef COSA_WITH_CUDA
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <type_traits>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "cosa_params.h"
#endif

PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(cosa, m) {
  m.def(
      "kap(Tensor q, Tensor k_cache, Tensor page_table, Tensor cu_seqlens_q, Tensor seqused_k, "
      "int max_seqlen_q, int max_seqlen_k, int stride=8, float top_p=0.95, float? softmax_scale=None) "
      "-> (Tensor order, Tensor counts)");
  m.def(
      "osk(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor cu_seqlens_q, "
      "Tensor seqused_k, Tensor order, Tensor counts, int max_seqlen_q, float? softmax_scale=None, "
      "float delta=2000.0) -> (Tensor out, Tensor lse, Tensor skipped)");
  m.def(
      "prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor cu_seqlens_q, "
      "Tensor seqused_k, int max_seqlen_q, int max_seqlen_k, int stride=8, float top_p=0.95, "
      "float? softmax_scale=None, float delta=2000.0) "
      "-> (Tensor out, Tensor lse, Tensor order, Tensor counts, Tensor skipped)");
}

#ifdef COSA_WITH_CUDA

// Each failed check names the op and the argument: TypeError for a wrong dtype, ValueError for
// everything else (the exception types of the CPU path).
#define COSA_CHECK_VALUE(cond, op, ...) TORCH_CHECK_VALUE(cond, message("cosa.", op, ": ", __VA_ARGS__))
#define COSA_CHECK_TYPE(cond, op, ...) TORCH_CHECK_TYPE(cond, message("cosa.", op, ": ", __VA_ARGS__))

namespace {

constexpr int64_t kBlock = cosa::kBlockSize;
constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();

// Python's spelling of a dtype, so that the messages read like those of the CPU path.
std::string dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kBFloat16: return "torch.bfloat16";
    case at::kHalf: return "torch.float16";
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kBool: return "torch.bool";
    default: return std::string("torch.") + c10::toString(type);
  }
}

// Python's spelling of a shape or strides tuple: (2, 3), (5,), ().
std::string tuple_str(c10::IntArrayRef values) {
  std::string out = "(";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
  return out + (values.size() == 1 ? ",)" : ")");
}

// Python's repr of a float (shortest round trip, "1.0" not "1"), as the CPU path prints it.
std::string float_repr(double value) {
  char text[32];
  const auto result = std::to_chars(text, text + sizeof(text), value);
  std::string repr(text, result.ptr);
  if (repr.find_first_of(".eEn") == std::string::npos) repr += ".0";  // "n": nan and inf
  return repr;
}

// Error messages are assembled without iostreams: formatting a number through an ostream inside
// this module crashed on the GPU machine (torch 2.11 with GCC 13: the stream's numeric facet was
// not usable from the extension), so numbers are converted with std::to_string / std::to_chars.
void append(std::string& out, const char* text) { out += text; }
void append(std::string& out, const std::string& text) { out += text; }
void append(std::string& out, double value) { out += float_repr(value); }
void append(std::string& out, const c10::Device& device) { out += device.str(); }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
void append(std::string& out, T value) {
  out += std::to_string(value);
}

template <typename... Args>
std::string message(const Args&... parts) {
  std::string out;
  (append(out, parts), ...);
  return out;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Rows of order/counts/skipped: spec section 2, "row count without host synchronisation".
int64_t num_q_blocks_bound(int64_t total_q, int64_t batch, int64_t max_seqlen_q) {
  return std::min(batch * ceil_div(max_seqlen_q, kBlock), (total_q + (kBlock - 1) * batch) / kBlock);
}

// Sizes of the paged layout, read from checked shapes.
struct Sizes {
  int64_t batch, total_q, num_heads_q, num_heads_kv, head_dim, num_pages, page_size, max_pages;
};

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

// Dtypes, devices and shapes of the paged layout (spec section 1); reads no device data.
// v_cache is null for KAP; max_seqlen_k is absent for OSK.
Sizes check_layout(const char* op, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor* v_cache,
                   const at::Tensor& page_table, const at::Tensor& cu_seqlens_q, const at::Tensor& seqused_k,
                   int64_t max_seqlen_q, std::optional<int64_t> max_seqlen_k) {
  std::vector<std::pair<const char*, const at::Tensor*>> tensors = {
      {"q", &q}, {"k_cache", &k_cache}, {"page_table", &page_table},
      {"cu_seqlens_q", &cu_seqlens_q}, {"seqused_k", &seqused_k}};
  if (v_cache) tensors.emplace_back("v_cache", v_cache);
  for (const auto& [name, t] : tensors) {
    COSA_CHECK_VALUE(t->device() == q.device(), op, name, " must be on ", q.device(), " like q, got ",
                     t->device());
  }
  COSA_CHECK_VALUE(q.is_cuda(), op, "q must be a CUDA tensor, got one on ", q.device());

  const auto dtype = q.scalar_type();
  COSA_CHECK_TYPE(dtype == at::kBFloat16 || dtype == at::kHalf, op, "q must be bfloat16 or float16, got ",
                  dtype_name(dtype));
  COSA_CHECK_VALUE(q.dim() == 3, op, "q must be 3-D [total_q, num_heads_q, head_dim], got shape ",
                   tuple_str(q.sizes()));
  const int64_t total_q = q.size(0), num_heads_q = q.size(1), head_dim = q.size(2);
  COSA_CHECK_VALUE(head_dim == 64 || head_dim == 128, op, "head dim must be 64 or 128, got ", head_dim,
                   " (q.shape[-1])");
  for (const auto& [name, cache] : {std::pair{"k_cache", &k_cache}, std::pair{"v_cache", v_cache}}) {
    if (!cache) continue;
    COSA_CHECK_TYPE(cache->scalar_type() == dtype, op, name, " must have q's dtype ", dtype_name(dtype), ", got ",
                    dtype_name(cache->scalar_type()));
    COSA_CHECK_VALUE(cache->dim() == 4, op, name,
                     " must be 4-D [num_pages, page_size, num_heads_kv, head_dim], got shape ",
                     tuple_str(cache->sizes()));
    COSA_CHECK_VALUE(cache->size(3) == head_dim, op, name, " head dim ", cache->size(3), " differs from q's ",
                     head_dim);
  }
  COSA_CHECK_VALUE(!v_cache || v_cache->sizes() == k_cache.sizes(), op, "v_cache shape ",
                   tuple_str(v_cache ? v_cache->sizes() : k_cache.sizes()), " differs from k_cache shape ",
                   tuple_str(k_cache.sizes()));
  const int64_t num_pages = k_cache.size(0), page_size = k_cache.size(1), num_heads_kv = k_cache.size(2);
  COSA_CHECK_VALUE(page_size >= 16 && page_size <= 256 && (page_size & (page_size - 1)) == 0, op,
                   "page size (k_cache.shape[1]) must be a power of two in [16, 256], got ", page_size);
  COSA_CHECK_VALUE(num_heads_kv > 0 && num_heads_q % num_heads_kv == 0, op, "num_heads_q (", num_heads_q,
                   ") must be a multiple of num_heads_kv (", num_heads_kv, ")");

  for (const auto& [name, t, dims] : {std::tuple{"page_table", &page_table, 2},
                                      std::tuple{"cu_seqlens_q", &cu_seqlens_q, 1},
                                      std::tuple{"seqused_k", &seqused_k, 1}}) {
    COSA_CHECK_TYPE(t->scalar_type() == at::kInt, op, name, " must be int32, got ", dtype_name(t->scalar_type()));
    COSA_CHECK_VALUE(t->dim() == dims, op, name, " must be ", dims, "-D, got shape ", tuple_str(t->sizes()));
  }
  const int64_t batch = seqused_k.size(0);
  COSA_CHECK_VALUE(batch >= 1, op, "seqused_k must hold at least one sequence");
  COSA_CHECK_VALUE(cu_seqlens_q.size(0) == batch + 1, op, "cu_seqlens_q must have batch + 1 = ", batch + 1,
                   " entries, got ", cu_seqlens_q.size(0));
  COSA_CHECK_VALUE(page_table.size(0) == batch, op, "page_table must have batch = ", batch, " rows, got ",
                   page_table.size(0));
  COSA_CHECK_VALUE(max_seqlen_q >= 1, op, "max_seqlen_q must be a positive int, got ", max_seqlen_q);
  COSA_CHECK_VALUE(!max_seqlen_k || *max_seqlen_k >= max_seqlen_q, op, "max_seqlen_k must be an int >= max_seqlen_q (",
                   max_seqlen_q, "), got ", max_seqlen_k.value_or(0));

  // What the kernels' plain-data view (cosa_params.h) needs beyond the contract's shapes.
  COSA_CHECK_VALUE(num_heads_q > 0, op, "q must have at least one head, got shape ", tuple_str(q.sizes()));
  check_rows_aligned(op, "q", q);
  check_rows_aligned(op, "k_cache", k_cache);
  if (v_cache) check_rows_aligned(op, "v_cache", *v_cache);
  COSA_CHECK_VALUE(page_table.size(1) <= 1 || page_table.stride(1) == 1, op,
                   "page_table rows must be contiguous (stride 1 along dim 1), got strides ",
                   tuple_str(page_table.strides()));
  COSA_CHECK_VALUE(cu_seqlens_q.is_contiguous(), op, "cu_seqlens_q must be contiguous");
  COSA_CHECK_VALUE(seqused_k.is_contiguous(), op, "seqused_k must be contiguous");
  for (const auto& [name, value] : {std::pair{"total_q (q.shape[0])", total_q},
                                    std::pair{"num_pages (k_cache.shape[0])", num_pages},
                                    std::pair{"max_pages (page_table.shape[1])", page_table.size(1)},
                                    std::pair{"max_seqlen_q", max_seqlen_q},
                                    std::pair{"max_seqlen_k", max_seqlen_k.value_or(0)}}) {
    COSA_CHECK_VALUE(value <= kMaxInt, op, name, " = ", value, " exceeds the kernels' int32 range");
  }
  return Sizes{batch, total_q, num_heads_q, num_heads_kv, head_dim, num_pages, page_size, page_table.size(1)};
}

void check_scale(const char* op, std::optional<double> softmax_scale) {
  COSA_CHECK_VALUE(!softmax_scale || (std::isfinite(*softmax_scale) && *softmax_scale > 0), op,
                   "softmax_scale must be a finite positive number, got ", float_repr(softmax_scale.value_or(0.0)));
}

// KAP sorts each list in shared memory (csrc/kap/kap_select_kernel.cuh): 16384 key blocks at most.
constexpr int64_t kKapMaxSeqlenK = 16384 * kBlock;

void check_kap_args(const char* op, int64_t stride, double top_p, std::optional<double> softmax_scale,
                    int64_t max_seqlen_k) {
  COSA_CHECK_VALUE(max_seqlen_k <= kKapMaxSeqlenK, op, "max_seqlen_k = ", max_seqlen_k,
                   " exceeds the CUDA KAP limit of ", kKapMaxSeqlenK,
                   " tokens (16384 key blocks, each list sorted in shared memory)");
  COSA_CHECK_VALUE(stride == 4 || stride == 8 || stride == 16, op, "stride must be 4, 8 or 16 on CUDA, got ",
                   stride, " (the reference, cosa.reference.kap, accepts any divisor of ", kBlock, ")");
  COSA_CHECK_VALUE(std::isfinite(top_p) && top_p > 0.0 && top_p <= 1.0, op, "top_p must be in (0, 1], got ",
                   float_repr(top_p));
  check_scale(op, softmax_scale);
}

void check_delta(const char* op, double delta) {
  COSA_CHECK_VALUE(std::isfinite(delta), op,
                   "delta must be a finite number (<= 0 disables the in-kernel skip), got ", float_repr(delta));
}

// Shapes of the block lists given to OSK.
void check_order_shapes(const char* op, const at::Tensor& q, const at::Tensor& order, const at::Tensor& counts,
                        int64_t num_q_blocks) {
  for (const auto& [name, t, dims] : {std::tuple{"order", &order, 3}, std::tuple{"counts", &counts, 2}}) {
    COSA_CHECK_TYPE(t->scalar_type() == at::kInt, op, name, " must be int32, got ", dtype_name(t->scalar_type()));
    COSA_CHECK_VALUE(t->device() == q.device(), op, name, " must be on ", q.device(), " like q, got ", t->device());
    COSA_CHECK_VALUE(t->dim() == dims, op, name, " must be ", dims, "-D, got shape ", tuple_str(t->sizes()));
  }
  const int64_t hq = q.size(1);
  COSA_CHECK_VALUE(counts.size(0) == hq && counts.size(1) == num_q_blocks, op,
                   "counts must have shape [num_heads_q, num_q_blocks] = (", hq, ", ", num_q_blocks, "), got ",
                   tuple_str(counts.sizes()));
  COSA_CHECK_VALUE(order.size(0) == hq && order.size(1) == num_q_blocks && order.size(2) >= 1, op,
                   "order must have shape [", hq, ", ", num_q_blocks, ", max_k_blocks], got ",
                   tuple_str(order.sizes()));
  COSA_CHECK_VALUE(order.size(2) <= kMaxInt, op, "order's last dim ", order.size(2),
                   " exceeds the kernels' int32 range");
  COSA_CHECK_VALUE(order.is_contiguous(), op, "order must be contiguous");
  COSA_CHECK_VALUE(counts.is_contiguous(), op, "counts must be contiguous");
}

cosa::PagedLayout make_layout(const Sizes& s, const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor* v_cache, const at::Tensor& page_table,
                              const at::Tensor& cu_seqlens_q, const at::Tensor& seqused_k, int64_t max_seqlen_q,
                              int64_t max_seqlen_k, int64_t max_k_blocks, std::optional<double> softmax_scale) {
  cosa::PagedLayout l;
  l.q = q.const_data_ptr();
  l.q_row_stride = q.stride(0);
  l.q_head_stride = q.stride(1);
  l.k_cache = k_cache.const_data_ptr();
  l.k_page_stride = k_cache.stride(0);
  l.k_row_stride = k_cache.stride(1);
  l.k_head_stride = k_cache.stride(2);
  if (v_cache) {
    l.v_cache = v_cache->const_data_ptr();
    l.v_page_stride = v_cache->stride(0);
    l.v_row_stride = v_cache->stride(1);
    l.v_head_stride = v_cache->stride(2);
  }
  l.page_table = page_table.const_data_ptr<int32_t>();
  l.page_table_stride = page_table.stride(0);
  l.cu_seqlens_q = cu_seqlens_q.const_data_ptr<int32_t>();
  l.seqused_k = seqused_k.const_data_ptr<int32_t>();
  l.batch = static_cast<int>(s.batch);
  l.num_heads_q = static_cast<int>(s.num_heads_q);
  l.num_heads_kv = static_cast<int>(s.num_heads_kv);
  l.head_dim = static_cast<int>(s.head_dim);
  l.page_size = static_cast<int>(s.page_size);
  l.num_pages = static_cast<int>(s.num_pages);
  l.max_pages_per_seq = static_cast<int>(s.max_pages);
  l.total_q = static_cast<int>(s.total_q);
  l.max_seqlen_q = static_cast<int>(max_seqlen_q);
  l.max_seqlen_k = static_cast<int>(max_seqlen_k);
  l.num_q_blocks = static_cast<int>(num_q_blocks_bound(s.total_q, s.batch, max_seqlen_q));
  l.max_k_blocks = static_cast<int>(max_k_blocks);
  l.dtype = q.scalar_type() == at::kBFloat16 ? cosa::DType::kBFloat16 : cosa::DType::kFloat16;
  l.softmax_scale = static_cast<float>(softmax_scale.value_or(1.0 / std::sqrt(static_cast<double>(s.head_dim))));
  return l;
}

// The diagonal key block of packed query block g (-1 for a padding row), from host copies of the
// lengths: only needed to word an error message.
int64_t diagonal_block(const std::vector<int64_t>& cu, const std::vector<int64_t>& lk, int64_t g) {
  int64_t first_row = 0;
  for (size_t b = 0; b < lk.size(); ++b) {
    const int64_t lq = cu[b + 1] - cu[b], nq = ceil_div(std::max<int64_t>(lq, 0), kBlock);
    if (g < first_row + nq) return (lk[b] - lq) / kBlock + (g - first_row);
    first_row += nq;
  }
  return -1;
}

[[noreturn]] void fail_value(const char* op, const std::string& text) {
  TORCH_CHECK_VALUE(false, message("cosa.", op, ": ", text));
  std::abort();  // unreachable: TORCH_CHECK_VALUE(false, ...) always throws
}

std::vector<int64_t> to_host(const at::Tensor& t) {
  const at::Tensor host = t.to(at::kCPU, at::kLong).contiguous();
  return {host.const_data_ptr<int64_t>(), host.const_data_ptr<int64_t>() + host.numel()};
}

// The contract's conditions on the lengths and the page table (spec section 1) and, for the
// standalone OSK op, on the block lists: every listed block must be a causal candidate of its
// query block, so that OSK never reads outside a sequence's pages. One kernel pass on the device
// (csrc/checks/) and one read-back of kNumInputChecks integers; the values that word a message
// are fetched only when a check failed. Skipped while the current stream captures a CUDA graph
// (reading device data is not allowed then).
// COSA_DEVICE_CHECKS=0 in the environment turns these checks off (read on every call, so that
// cosa.set_device_checks can flip it at run time): for callers whose index tensors are right by
// construction and who cannot pay the host synchronisation. The checks on shapes, dtypes and
// devices above always run.
bool device_checks_enabled() {
  const char* value = std::getenv("COSA_DEVICE_CHECKS");
  return value == nullptr || std::string_view(value) != "0";
}

void check_device_data(const char* op, const cosa::PagedLayout& layout, const at::Tensor& q,
                       const at::Tensor& page_table, const at::Tensor& cu_seqlens_q, const at::Tensor& seqused_k,
                       bool check_max_seqlen_k, const at::Tensor* order, const at::Tensor* counts) {
  if (!device_checks_enabled()) return;
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) return;
  at::Tensor report = at::empty({cosa::kNumInputChecks}, q.options().dtype(at::kLong));
  cosa::InputCheckParams params;
  params.layout = layout;
  params.check_max_seqlen_k = check_max_seqlen_k;
  params.report = reinterpret_cast<unsigned long long*>(report.mutable_data_ptr<int64_t>());
  if (order) {
    params.order = order->const_data_ptr<int32_t>();
    params.counts = counts->const_data_ptr<int32_t>();
    params.order_row_len = static_cast<int>(order->size(2));
  }
  const cudaError_t error = cosa::run_input_checks(params, at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(error == cudaSuccess, message("cosa.", op, ": the input checks failed to launch: ",
                                            cudaGetErrorString(error)));
  const at::Tensor host = report.cpu();  // the one host synchronisation
  const auto* keys = reinterpret_cast<const uint64_t*>(host.const_data_ptr<int64_t>());
  constexpr uint64_t kPassed = ~uint64_t{0};
  if (std::all_of(keys, keys + cosa::kNumInputChecks, [](uint64_t k) { return k == kPassed; })) return;

  const std::vector<int64_t> cu = to_host(cu_seqlens_q), lk = to_host(seqused_k);
  const int64_t batch = layout.batch;
  const auto fail = [op](const std::string& text) { fail_value(op, text); };
  if (const uint64_t key = keys[cosa::kCheckLengths]; key != kPassed) {
    if (key == 0) {
      fail(message("cu_seqlens_q must start at 0 and end at total_q = ", layout.total_q, ", got ", cu[0], " .. ",
                   cu[batch]));
    }
    if (key <= static_cast<uint64_t>(batch)) {
      const int64_t b = static_cast<int64_t>(key) - 1;
      fail(message("cu_seqlens_q must be non-decreasing, got ", cu[b], " then ", cu[b + 1], " at index ", b));
    }
    const int64_t b = static_cast<int64_t>(key - 1 - batch) / 5, condition = static_cast<int64_t>(key - 1 - batch) % 5;
    const int64_t lq = cu[b + 1] - cu[b];
    switch (condition) {
      case 0: fail(message("sequence ", b, " has ", lq, " queries, more than max_seqlen_q = ", layout.max_seqlen_q));
      case 1: fail(message("seqused_k[", b, "] = ", lk[b], " is shorter than the sequence's ", lq, " queries"));
      case 2: fail(message("seqused_k[", b, "] = ", lk[b], " exceeds max_seqlen_k = ", layout.max_seqlen_k));
      case 3:
        fail(message("the cached prefix of sequence ", b, " (seqused_k - query length = ", lk[b] - lq,
                     ") must be a multiple of ", kBlock));
      default:
        fail(message("seqused_k[", b, "] = ", lk[b], " exceeds page_table's capacity of ",
                     int64_t{layout.max_pages_per_seq} * layout.page_size, " tokens"));
    }
  }
  if (const uint64_t key = keys[cosa::kCheckPages]; key != kPassed) {
    const int64_t b = static_cast<int64_t>(key) / layout.max_pages_per_seq;
    const int64_t page = static_cast<int64_t>(key) % layout.max_pages_per_seq;
    fail(message("page_table[", b, ", ", page, "] = ", page_table[b][page].item<int64_t>(), " is outside the cache's ",
                 layout.num_pages, " pages"));
  }
  const int64_t rows = layout.num_q_blocks, row_len = params.order_row_len;
  if (const uint64_t key = keys[cosa::kCheckCountRange]; key != kPassed) {
    const int64_t h = static_cast<int64_t>(key) / rows, g = static_cast<int64_t>(key) % rows;
    fail(message("counts[", h, ", ", g, "] = ", (*counts)[h][g].item<int64_t>(), " is outside [0, ",
                 diagonal_block(cu, lk, g) + 1, "]"));
  }
  if (const uint64_t key = keys[cosa::kCheckCountRow]; key != kPassed) {
    const int64_t h = static_cast<int64_t>(key) / rows, g = static_cast<int64_t>(key) % rows;
    fail(message("counts[", h, ", ", g, "] = ", (*counts)[h][g].item<int64_t>(), " exceeds order's row length ",
                 row_len));
  }
  const uint64_t key = keys[cosa::kCheckOrder];
  const int64_t row = static_cast<int64_t>(key) / row_len, k = static_cast<int64_t>(key) % row_len;
  const int64_t h = row / rows, g = row % rows;
  fail(message("order[", h, ", ", g, ", ", k, "] = ", (*order)[h][g][k].item<int64_t>(),
               " is not a causal block of its query block (0..", diagonal_block(cu, lk, g), ")"));
}

void check_launch(const char* op, const char* kernel, cudaError_t error) {
  TORCH_CHECK(error == cudaSuccess, message("cosa.", op, ": the ", kernel, " launch failed: ", cudaGetErrorString(error)));
}

std::tuple<at::Tensor, at::Tensor> launch_kap(const char* op, const cosa::PagedLayout& layout, const at::Tensor& q,
                                              int64_t stride, double top_p, cudaStream_t stream) {
  const auto int_options = q.options().dtype(at::kInt);
  at::Tensor order = at::empty({layout.num_heads_q, layout.num_q_blocks, layout.max_k_blocks}, int_options);
  at::Tensor counts = at::empty({layout.num_heads_q, layout.num_q_blocks}, int_options);
  cosa::KapParams params;
  params.layout = layout;
  params.stride = static_cast<int>(stride);
  params.top_p = static_cast<float>(top_p);
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
                                                          cudaStream_t stream) {
  at::Tensor out = at::empty({layout.total_q, layout.num_heads_q, layout.head_dim}, q.options());
  at::Tensor lse = at::empty({layout.num_heads_q, layout.total_q}, q.options().dtype(at::kFloat));
  at::Tensor skipped = at::empty({layout.num_heads_q, layout.num_q_blocks}, q.options().dtype(at::kInt));
  cosa::OskParams params;
  params.layout = layout;
  params.order = order.const_data_ptr<int32_t>();
  params.counts = counts.const_data_ptr<int32_t>();
  params.delta = static_cast<float>(delta);
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
                                            int64_t stride, double top_p, std::optional<double> softmax_scale) {
  const char* op = "kap";
  const Sizes s = check_layout(op, q, k_cache, nullptr, page_table, cu_seqlens_q, seqused_k, max_seqlen_q,
                               max_seqlen_k);
  check_kap_args(op, stride, top_p, softmax_scale, max_seqlen_k);
  const c10::cuda::CUDAGuard device_guard(q.device());
  const cosa::PagedLayout layout = make_layout(s, q, k_cache, nullptr, page_table, cu_seqlens_q, seqused_k,
                                               max_seqlen_q, max_seqlen_k, ceil_div(max_seqlen_k, kBlock),
                                               softmax_scale);
  check_device_data(op, layout, q, page_table, cu_seqlens_q, seqused_k, /*check_max_seqlen_k=*/true, nullptr,
                    nullptr);
  return launch_kap(op, layout, q, stride, top_p, at::cuda::getCurrentCUDAStream().stream());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> osk_cuda(const at::Tensor& q, const at::Tensor& k_cache,
                                                        const at::Tensor& v_cache, const at::Tensor& page_table,
                                                        const at::Tensor& cu_seqlens_q, const at::Tensor& seqused_k,
                                                        const at::Tensor& order, const at::Tensor& counts,
                                                        int64_t max_seqlen_q, std::optional<double> softmax_scale,
                                                        double delta) {
  const char* op = "osk";
  const Sizes s = check_layout(op, q, k_cache, &v_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q,
                               std::nullopt);
  check_scale(op, softmax_scale);
  check_delta(op, delta);
  check_order_shapes(op, q, order, counts, num_q_blocks_bound(s.total_q, s.batch, max_seqlen_q));
  const c10::cuda::CUDAGuard device_guard(q.device());
  // OSK takes no max_seqlen_k: the page table's capacity bounds every KV length (checked below),
  // and order's last dim is the row length of the lists.
  const int64_t kv_capacity = std::min(s.max_pages * s.page_size, kMaxInt);
  const cosa::PagedLayout layout = make_layout(s, q, k_cache, &v_cache, page_table, cu_seqlens_q, seqused_k,
                                               max_seqlen_q, kv_capacity, order.size(2), softmax_scale);
  check_device_data(op, layout, q, page_table, cu_seqlens_q, seqused_k, /*check_max_seqlen_k=*/false, &order,
                    &counts);
  return launch_osk(op, layout, q, order, counts, delta, at::cuda::getCurrentCUDAStream().stream());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> prefill_cuda(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& page_table,
    const at::Tensor& cu_seqlens_q, const at::Tensor& seqused_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    int64_t stride, double top_p, std::optional<double> softmax_scale, double delta) {
  const char* op = "prefill";
  const Sizes s = check_layout(op, q, k_cache, &v_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q,
                               max_seqlen_k);
  check_kap_args(op, stride, top_p, softmax_scale, max_seqlen_k);
  check_delta(op, delta);
  const c10::cuda::CUDAGuard device_guard(q.device());
  const cosa::PagedLayout layout = make_layout(s, q, k_cache, &v_cache, page_table, cu_seqlens_q, seqused_k,
                                               max_seqlen_q, max_seqlen_k, ceil_div(max_seqlen_k, kBlock),
                                               softmax_scale);
  check_device_data(op, layout, q, page_table, cu_seqlens_q, seqused_k, /*check_max_seqlen_k=*/true, nullptr,
                    nullptr);
  // KAP then OSK on one stream, the host never waiting in between; the lists that KAP just wrote
  // satisfy the contract by construction, so they are not checked again.
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  auto [order, counts] = launch_kap(op, layout, q, stride, top_p, stream);
  auto [out, lse, skipped] = launch_osk(op, layout, q, order, counts, delta, stream);
  return {out, lse, order, counts, skipped};
}

}  // namespace

TORCH_LIBRARY_IMPL(cosa, CUDA, m) {
  m.impl("kap", &kap_cuda);
  m.impl("osk", &osk_cuda);
  m.impl("prefill", &prefill_cuda);
}

#endif  // COSA_WITH_CUDA
