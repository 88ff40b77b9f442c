// Whether and how the ops check the contents of their index tensors: this thread's setting (every
// build), whether a CUDA graph is being captured, and (CUDA build) the device pass that checks them
// beside the kernels.
#pragma once

#include <ATen/core/Tensor.h>

#ifdef COSA_WITH_CUDA
#include <cuda_runtime_api.h>

#include "binding/contract.h"
#include "cosa_params.h"
#endif

namespace cosa::binding {

// Whether the CUDA ops check the contents of their index tensors (one small kernel and one host
// synchronisation per call). On by default; COSA_DEVICE_CHECKS=0 in the environment when the
// extension loads turns them off for the whole process. After that the setting belongs to each
// thread (cosa.set_device_checks): a library can turn them off around its own calls, whose index
// tensors are right by construction, without touching the calls of other threads.
bool set_device_checks(bool enabled);  // returns the previous setting
bool device_checks_enabled();

// Whether t is a CUDA tensor and the current stream is capturing a CUDA graph, when no device
// data may be read.
bool capturing_cuda_graph(const at::Tensor& t);

#ifdef COSA_WITH_CUDA

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
void enqueue_device_checks(const OpArgs& a, cosa::PagedLayout& layout, PendingDeviceChecks& pending);

void finish_device_checks(const OpArgs& a, const Sizes& s, const PendingDeviceChecks& pending);

#endif  // COSA_WITH_CUDA

}  // namespace cosa::binding
