#include "binding/device_checks.h"

#include <cstdlib>
#include <string_view>
#include <utility>

#ifdef COSA_WITH_CUDA
#include <algorithm>
#include <cstdint>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#endif

#include <torch/library.h>

#include "binding/messages.h"

namespace cosa::binding {

namespace {

const bool kDeviceChecksDefault = [] {
  const char* value = std::getenv("COSA_DEVICE_CHECKS");
  return value == nullptr || std::string_view(value) != "0";
}();
thread_local bool t_device_checks = kDeviceChecksDefault;

}  // namespace

bool set_device_checks(bool enabled) { return std::exchange(t_device_checks, enabled); }
bool device_checks_enabled() { return t_device_checks; }

bool capturing_cuda_graph(const at::Tensor& t) {
#ifdef COSA_WITH_CUDA
  return t.is_cuda() && c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
#else
  (void)t;  // without the CUDA kernels no cosa op runs inside a capture
  return false;
#endif
}

#ifdef COSA_WITH_CUDA

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

#endif  // COSA_WITH_CUDA

}  // namespace cosa::binding

TORCH_LIBRARY_IMPL(cosa, CompositeImplicitAutograd, m) {
  m.impl("set_device_checks", &cosa::binding::set_device_checks);
  m.impl("device_checks_enabled", &cosa::binding::device_checks_enabled);
}
