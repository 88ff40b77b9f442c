// The torch binding of the CoSA ops, and the only file of the project that includes torch.
// Every build declares the op schemas (TORCH_LIBRARY) and holds the ops' argument contract: the
// checks below, with their messages. The CUDA build (COSA_WITH_CUDA) adds the ops' CUDA
// implementations: the contract, the kernels' own limits, output allocation, launch on the current
// stream. The CPU implementations (the Python reference) and the fake kernels are registered from
// Python (cosa/ops.py); they run the same checks through the op cosa::check_args.
//
// Why the contract is written here, once, rather than in Python: the CUDA path is the hot one and
// C++ checks keep Python off it, while the CPU path and the Python wrappers reach the very same
// code through one op call, so that every path raises the same errors (TypeError for a wrong dtype,
// ValueError for a wrong value, each naming the op and the argument) in the same order. Python keeps
// only what C++ cannot see, the Python types of the wrappers' arguments (cosa/validation.py).

// Python.h comes first, as CPython asks. The extension is built against the stable ABI
// (Py_LIMITED_API); its module has no methods: importing it runs the registrations below.
#include <Python.h>

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef COSA_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include "cosa_params.h"
#endif

// The defaults of the tuning arguments come from cosa/defaults.py, their one source, through the
// macros of cosa_defaults.h (which that file writes); the schemas below spell them.
#include "cosa_defaults.h"
#define COSA_SPELL_(value) #value
#define COSA_SPELL(value) COSA_SPELL_(value)
#define COSA_STRIDE_ARG "int stride=" COSA_SPELL(COSA_DEFAULT_STRIDE)
#define COSA_TOP_P_ARG "float top_p=" COSA_SPELL(COSA_DEFAULT_TOP_P)
#define COSA_SOFTMAX_SCALE_ARG "float? softmax_scale=" COSA_SPELL(COSA_DEFAULT_SOFTMAX_SCALE)
#define COSA_DELTA_ARG "float delta=" COSA_SPELL(COSA_DEFAULT_DELTA)
#define COSA_VOTE_ARG "str vote=\"" COSA_SPELL(COSA_DEFAULT_VOTE) "\""
#define COSA_PROXY_PRECISION_ARG "str proxy_precision=\"" COSA_SPELL(COSA_DEFAULT_PROXY_PRECISION) "\""

PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(cosa, m) {
  m.def("kap(Tensor q, Tensor k_cache, Tensor page_table, Tensor cu_seqlens_q, Tensor seqused_k, "
        "int max_seqlen_q, int max_seqlen_k, " COSA_STRIDE_ARG ", " COSA_TOP_P_ARG ", " COSA_SOFTMAX_SCALE_ARG
        ", " COSA_PROXY_PRECISION_ARG ") -> (Tensor order, Tensor counts)");
  m.def("osk(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor cu_seqlens_q, "
        "Tensor seqused_k, Tensor order, Tensor counts, int max_seqlen_q, " COSA_SOFTMAX_SCALE_ARG ", "
        COSA_DELTA_ARG ", " COSA_VOTE_ARG ") -> (Tensor out, Tensor lse, Tensor skipped)");
  m.def("prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor cu_seqlens_q, "
        "Tensor seqused_k, int max_seqlen_q, int max_seqlen_k, " COSA_STRIDE_ARG ", " COSA_TOP_P_ARG ", "
        COSA_SOFTMAX_SCALE_ARG ", " COSA_DELTA_ARG ", " COSA_VOTE_ARG ", " COSA_PROXY_PRECISION_ARG
        ") -> (Tensor out, Tensor lse, Tensor order, Tensor counts, Tensor skipped)");
  // The argument contract of the op named `op` (kap, osk or prefill), for any device: the arguments
  // that op lacks are None. A max length left None is derived from the lengths (read on the host);
  // returns (max_seqlen_q, max_seqlen_k). The contents of the index tensors are checked wherever
  // they can be read: always on the CPU, on CUDA while the device checks are on (or a length must
  // be derived) and no CUDA graph is being captured, never on 'meta'.
  m.def("check_args(str op, Tensor q, Tensor k_cache, Tensor page_table, Tensor cu_seqlens_q, Tensor seqused_k, "
        "Tensor? v_cache=None, Tensor? order=None, Tensor? counts=None, int? max_seqlen_q=None, "
        "int? max_seqlen_k=None, int? stride=None, float? top_p=None, float? softmax_scale=None, "
        "float? delta=None, str? vote=None, str? proxy_precision=None) -> (int max_seqlen_q, int max_seqlen_k)");
  // This thread's device-checks setting (see device_checks_enabled below); set_ returns the previous one.
  m.def("set_device_checks(bool enabled) -> bool");
  m.def("device_checks_enabled() -> bool");
}

// Each failed check names the op and the argument: TypeError for a wrong dtype, ValueError for
// everything else.
#define COSA_CHECK_VALUE(cond, op, ...) TORCH_CHECK_VALUE(cond, message("cosa.", op, ": ", __VA_ARGS__))
#define COSA_CHECK_TYPE(cond, op, ...) TORCH_CHECK_TYPE(cond, message("cosa.", op, ": ", __VA_ARGS__))

namespace {

constexpr int64_t kBlock = 128;  // the logical block (spec section 1)
#ifdef COSA_WITH_CUDA
static_assert(kBlock == cosa::kBlockSize);
#endif

// ---------------------------------------------------------------------------------------------
// Messages
// ---------------------------------------------------------------------------------------------

// Python's spelling of a dtype, so that the messages read like Python's.
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

// Python's repr of a float (shortest round trip, "1.0" not "1").
std::string float_repr(double value) {
  char text[32];
  const auto result = std::to_chars(text, text + sizeof(text), value);
  std::string repr(text, result.ptr);
  if (repr.find_first_of(".eEn") == std::string::npos) repr += ".0";  // "n": nan and inf
  return repr;
}

// Error messages are assembled without iostreams: formatting a number through an ostream inside
// this module crashed on an H200 build (torch 2.11 with GCC 13: the stream's numeric facet was
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

[[noreturn]] void fail_value(const char* op, const std::string& text) {
  TORCH_CHECK_VALUE(false, message("cosa.", op, ": ", text));
  std::abort();  // unreachable: TORCH_CHECK_VALUE(false, ...) always throws
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Rows of order/counts/skipped: spec section 2, "row count without host synchronisation".
int64_t num_q_blocks_bound(int64_t total_q, int64_t batch, int64_t max_seqlen_q) {
  return std::min(batch * ceil_div(max_seqlen_q, kBlock), (total_q + (kBlock - 1) * batch) / kBlock);
}

// ---------------------------------------------------------------------------------------------
// The device checks setting
// ---------------------------------------------------------------------------------------------

// Whether the CUDA ops check the contents of their index tensors (one small kernel and one host
// synchronisation per call). On by default; COSA_DEVICE_CHECKS=0 in the environment when the
// extension loads turns them off for the whole process. After that the setting belongs to each
// thread (cosa.set_device_checks): a library can turn them off around its own calls, whose index
// tensors are right by construction, without touching the calls of other threads.
const bool kDeviceChecksDefault = [] {
  const char* value = std::getenv("COSA_DEVICE_CHECKS");
  return value == nullptr || std::string_view(value) != "0";
}();
thread_local bool t_device_checks = kDeviceChecksDefault;

bool set_device_checks(bool enabled) { return std::exchange(t_device_checks, enabled); }
bool device_checks_enabled() { return t_device_checks; }

// ---------------------------------------------------------------------------------------------
// The argument contract (spec section 1 and the ops' arguments): every path runs it
// ---------------------------------------------------------------------------------------------

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
  COSA_CHECK_VALUE(page_size >= 16 && page_size <= 256 && (page_size & (page_size - 1)) == 0, op,
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

// The tuning arguments, and the max lengths that were given.
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
    COSA_CHECK_VALUE(*a.stride >= 1 && kBlock % *a.stride == 0, op, "stride must be a positive divisor of ", kBlock,
                     ", got ", *a.stride);
  }
  if (a.top_p) {
    COSA_CHECK_VALUE(std::isfinite(*a.top_p) && *a.top_p > 0.0 && *a.top_p <= 1.0, op,
                     "top_p must be in (0, 1], got ", *a.top_p);
  }
  if (a.softmax_scale) {
    // The kernels hold it in float32: it must stay a finite, normal float32 there.
    COSA_CHECK_VALUE(*a.softmax_scale >= std::numeric_limits<float>::min() &&
                         *a.softmax_scale <= std::numeric_limits<float>::max(),
                     op, "softmax_scale must be a positive number in float32's normal range [",
                     std::numeric_limits<float>::min(), ", ", std::numeric_limits<float>::max(), "], got ",
                     *a.softmax_scale);
  }
  if (a.delta) {
    // The kernels hold delta in float32 and flush subnormals to zero, where the skip would be off; the
    // reference would keep it on.
    COSA_CHECK_VALUE(std::isfinite(*a.delta) && (*a.delta <= 0.0 || *a.delta >= std::numeric_limits<float>::min()),
                     op, "delta must be a finite number, <= 0 (which disables the in-kernel skip) or at least ",
                     std::numeric_limits<float>::min(), " (float32's smallest normal number), got ", *a.delta);
  }
  if (a.vote) {
    COSA_CHECK_VALUE(*a.vote == "tile" || *a.vote == "warpgroup", op, "vote must be 'tile' or 'warpgroup', got '",
                     std::string(*a.vote), "'");
  }
  if (a.proxy_precision) {
    COSA_CHECK_VALUE(*a.proxy_precision == "native" || *a.proxy_precision == "fp8" || *a.proxy_precision == "auto",
                     op, "proxy_precision must be 'native', 'fp8' or 'auto', got '", std::string(*a.proxy_precision),
                     "'");
  }
}

// Shapes of the block lists given to OSK.
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

// Host copies of the index tensors, as int64, for the checks of their contents.
struct IndexData {
  std::vector<int64_t> cu, lk, page_table, order, counts;  // page_table, order, counts row-major
};

std::vector<int64_t> to_host(const at::Tensor& t) {
  const at::Tensor host = t.to(at::kCPU, at::kLong).contiguous();
  return {host.const_data_ptr<int64_t>(), host.const_data_ptr<int64_t>() + host.numel()};
}

IndexData read_index_data(const OpArgs& a) {
  IndexData d{to_host(a.cu_seqlens_q), to_host(a.seqused_k), to_host(a.page_table), {}, {}};
  if (a.order) {
    d.order = to_host(*a.order);
    d.counts = to_host(*a.counts);
  }
  return d;
}

// The lengths and the page table (spec section 1), in the order in which the device kernel
// (csrc/checks/) ranks its findings: the first broken condition is the one reported. A bound
// that is absent (a max length still to be derived, or OSK's max_seqlen_k) is not checked.
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
    if ((lk[b] - lq) % kBlock) {
      fail_value(op, message("the cached prefix of sequence ", b, " (seqused_k - query length = ", lk[b] - lq,
                             ") must be a multiple of ", kBlock));
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

// The block lists given to OSK: every count in [0, diagonal + 1] and within order's rows, every
// listed block a causal candidate of its query block, so that OSK never reads outside a
// sequence's pages. Needs the lengths checked first.
void check_lists_data(const OpArgs& a, const Sizes& s, const IndexData& d, int64_t max_seqlen_q) {
  if (!a.order) return;
  const char* op = a.op;
  const int64_t rows = num_q_blocks_bound(s.total_q, s.batch, max_seqlen_q), row_len = a.order->size(2);
  std::vector<int64_t> diagonal(rows, -1);  // the diagonal key block of each query block; -1: padding
  for (int64_t b = 0, g = 0; b < s.batch; ++b) {
    const int64_t lq = d.cu[b + 1] - d.cu[b];
    for (int64_t i = 0; i < ceil_div(lq, kBlock); ++i, ++g) diagonal[g] = (d.lk[b] - lq) / kBlock + i;
  }
  const int64_t lists = s.num_heads_q * rows;
  for (int64_t row = 0; row < lists; ++row) {
    const int64_t count = d.counts[row], g = row % rows;
    if (count < 0 || count > diagonal[g] + 1) {
      fail_value(op, message("counts[", row / rows, ", ", g, "] = ", count, " is outside [0, ", diagonal[g] + 1, "]"));
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
      if (j < 0 || j > diagonal[g]) {
        fail_value(op, message("order[", row / rows, ", ", g, ", ", k, "] = ", j,
                               " is not a causal block of its query block (0..", diagonal[g], ")"));
      }
    }
  }
}

bool capturing_cuda_graph(const at::Tensor& t) {
#ifdef COSA_WITH_CUDA
  return t.is_cuda() && c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
#else
  (void)t;  // without the CUDA kernels no cosa op runs inside a capture
  return false;
#endif
}

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

TORCH_LIBRARY_IMPL(cosa, CompositeExplicitAutograd, m) { m.impl("check_args", &check_args); }

TORCH_LIBRARY_IMPL(cosa, CompositeImplicitAutograd, m) {
  m.impl("set_device_checks", &set_device_checks);
  m.impl("device_checks_enabled", &device_checks_enabled);
}

#ifdef COSA_WITH_CUDA

namespace {

// ---------------------------------------------------------------------------------------------
// The CUDA implementations: the contract, the kernels' limits, then launches
// ---------------------------------------------------------------------------------------------

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

constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();

// Elements from a tensor's first to its last element, plus one (cosa::q_span_elements and
// cosa::k_cache_span_elements, which run_kap checks, are the same from the layout's sizes and strides).
int64_t element_span(const at::Tensor& t) {
  int64_t span = 1;
  for (int64_t dim = 0; dim < t.dim(); ++dim) span += (t.size(dim) - 1) * t.stride(dim);
  return t.numel() == 0 ? 0 : span;
}

cosa::ProxyPrecision proxy_precision_of(c10::string_view precision) {  // checked by check_scalars
  if (precision == "fp8") return cosa::ProxyPrecision::kE4M3;
  return precision == "auto" ? cosa::ProxyPrecision::kAuto : cosa::ProxyPrecision::kNative;
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
    COSA_CHECK_VALUE(cosa::valid_kap_stride(*a.stride), op,
                     "stride must be 4, 8 or 16 on CUDA, got ", *a.stride,
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
        a.proxy_precision && cosa::resolve_proxy_precision(proxy_precision_of(*a.proxy_precision),
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

// The contract, then the kernels' limits; the contents of the index tensors are checked later,
// on the device (enqueue_device_checks).
Sizes check_cuda_args(const OpArgs& a) {
  const Sizes s = check_tensors(a);
  check_scalars(a);
  check_list_shapes(a, s, *a.max_seqlen_q);
  check_cuda_limits(a, s);
  return s;
}

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

// The contents of the index tensors, checked on the device: one kernel pass (csrc/checks/) writes a
// report of kNumInputChecks integers and publishes it in pinned host memory (a kernel writing
// through unified addressing; an asynchronous copy where the memory has no device address). The
// caller enqueues its kernels right behind (they carry the report in PagedLayout::input_report and
// do nothing unless every check passed), and only then waits for the report (finish_device_checks):
// the GPU goes on from the checks to the kernels while the host reads the report. Only when a
// check failed are the tensors copied to the host, where the contract's own checks
// (check_lengths_data, check_lists_data) find the failure and word it, so that the message is the
// one every other path gives; the outputs are then never returned. Skipped while the current
// stream captures a CUDA graph (reading device data is not allowed then) and while this thread's
// device checks are off.
struct PendingDeviceChecks {
  at::Tensor report;       // [kNumInputChecks] on the device
  at::Tensor host_report;  // pinned host memory the report is published into
  cudaEvent_t published = nullptr;  // recorded once the report is in host_report; null: no checks ran
  PendingDeviceChecks() = default;
  PendingDeviceChecks(const PendingDeviceChecks&) = delete;
  PendingDeviceChecks& operator=(const PendingDeviceChecks&) = delete;
  ~PendingDeviceChecks() {
    if (published == nullptr) return;
    // On an error path the host may leave before finish_device_checks: the device must be done
    // writing host_report before its pinned block can go back to torch's cache for reuse.
    cudaEventSynchronize(published);
    cudaEventDestroy(published);
  }
};

// Fills `pending` (a struct that owns an event, so it is filled in place rather than returned).
void enqueue_device_checks(const OpArgs& a, cosa::PagedLayout& layout, PendingDeviceChecks& pending) {
  if (!device_checks_enabled() || capturing_cuda_graph(a.q)) return;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  pending.report = at::empty({cosa::kNumInputChecks}, a.q.options().dtype(at::kLong));
  cosa::InputCheckParams params;
  params.layout = layout;
  params.check_max_seqlen_k = a.max_seqlen_k.has_value();
  params.report = reinterpret_cast<unsigned long long*>(pending.report.mutable_data_ptr<int64_t>());
  pending.host_report =
      at::empty({cosa::kNumInputChecks}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  void* host_report_on_device = nullptr;
  if (cudaHostGetDevicePointer(&host_report_on_device, pending.host_report.mutable_data_ptr(), 0) == cudaSuccess) {
    params.host_report = static_cast<unsigned long long*>(host_report_on_device);
  } else {
    (void)cudaGetLastError();  // not addressable from the device: copied below instead
  }
  if (a.order) {
    params.order = a.order->const_data_ptr<int32_t>();
    params.counts = a.counts->const_data_ptr<int32_t>();
    params.order_row_len = static_cast<int>(a.order->size(2));
  }
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&pending.published, cudaEventDisableTiming));
  const cudaError_t error = cosa::run_input_checks(params, stream);
  if (error == cudaSuccess && params.host_report == nullptr) {
    pending.host_report.copy_(pending.report, /*non_blocking=*/true);
  }
  // Recorded before the launch error is raised, so that pending's destructor waits for whatever
  // was enqueued to write host_report (the checks' last kernel, or the copy).
  const cudaError_t recorded = cudaEventRecord(pending.published, stream);
  TORCH_CHECK(error == cudaSuccess, message("cosa.", a.op, ": the input checks failed to launch: ",
                                            cudaGetErrorString(error)));
  C10_CUDA_CHECK(recorded);
  layout.input_report = reinterpret_cast<const unsigned long long*>(pending.report.const_data_ptr<int64_t>());
}

void finish_device_checks(const OpArgs& a, const Sizes& s, const PendingDeviceChecks& pending) {
  if (pending.published == nullptr) return;
  // The one host synchronisation: it waits for the report, not for the kernels enqueued behind it.
  // Announced to torch's sync debug mode (torch.cuda.set_sync_debug_mode), as its own waits are.
  c10::cuda::warn_or_error_on_sync();
  C10_CUDA_CHECK(cudaEventSynchronize(pending.published));
  const auto* keys = reinterpret_cast<const uint64_t*>(pending.host_report.const_data_ptr<int64_t>());
  constexpr uint64_t kPassed = ~uint64_t{0};
  if (std::all_of(keys, keys + cosa::kNumInputChecks, [](uint64_t k) { return k == kPassed; })) return;
  const IndexData d = read_index_data(a);
  check_lengths_data(a, s, d);
  check_lists_data(a, s, d, *a.max_seqlen_q);
  TORCH_CHECK(false, message("cosa.", a.op, ": the device checks of the index tensors failed (report keys ", keys[0],
                             ", ", keys[1], ", ", keys[2], ", ", keys[3], ", ", keys[4],
                             ") but their host copies pass the same checks"));
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
  params.precision = proxy_precision_of(precision);
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

cosa::VoteScope vote_scope(c10::string_view vote) {
  return vote == "tile" ? cosa::VoteScope::kTile : cosa::VoteScope::kWarpgroup;  // checked by check_scalars
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
  params.vote = vote_scope(vote);
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

TORCH_LIBRARY_IMPL(cosa, CUDA, m) {
  m.impl("kap", &kap_cuda);
  m.impl("osk", &osk_cuda);
  m.impl("prefill", &prefill_cuda);
}

#endif  // COSA_WITH_CUDA
