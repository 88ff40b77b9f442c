// The gate that every KAP and OSK kernel passes right after its grid-dependency wait: when the
// binding enqueued the device input checks before them (PagedLayout::input_report), a kernel whose
// inputs failed a check returns before it touches them, so that a bad page id or length cannot
// make it read or write out of bounds while the host is still reading the report (it then raises
// the check's error and never returns the outputs).
#pragma once

#include "cosa_params.h"

namespace cosa {

// True when the checks ran and one of them failed. Call after cudaGridDependencySynchronize(): the
// report was written by a kernel before this one.
__device__ __forceinline__ bool inputs_rejected(const PagedLayout& layout) {
  const unsigned long long* report = layout.input_report;
  if (report == nullptr) return false;
  bool rejected = false;
#pragma unroll
  for (int check = 0; check < kNumInputChecks; ++check) rejected |= report[check] != ~0ull;
  return rejected;
}

}  // namespace cosa
