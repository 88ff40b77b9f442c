// The contract of the ops' scalar arguments in C++: the logical block, the page sizes the kernels
// run, and the domains of the tuning arguments, as predicates that the torch binding (both of its
// builds, with and without CUDA: csrc/binding/contract.cpp), the parameter structs' checks
// (cosa_params.h, what run_kap, run_osk and the C API refuse) and the schemas share. Needs no CUDA
// header. The value sets, their enums and parse functions, and the defaults are tabulated in
// cosa/tuning.py, which writes cosa_tuning.h; that module checks the same domains in Python, in the
// same words as the binding's errors.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "cosa_tuning.h"

namespace cosa {

// Logical block size for queries and keys (spec section 1); fixed by the method.
constexpr int kBlockSize = 128;

// The diagonal blocks of query block i of a sequence with lq queries after a prefix of `prefix`
// cached keys (spec section 1): the key blocks that hold the positions of its first and of its last
// query, prefix + 128 i and prefix + min(128 (i + 1), lq) - 1; one block when the prefix is a
// multiple of 128. For a prefix >= 0 (the length checks refuse others). The binding's list checks
// and the kernels' query-block locator (common/query_blocks.cuh) take them from here, in int64_t
// and int respectively.
template <class Int>
constexpr Int first_diagonal_block(Int prefix, Int i) {
  return prefix / kBlockSize + i;
}
template <class Int>
constexpr Int last_diagonal_block(Int prefix, Int lq, Int i) {
  const Int end = (i + 1) * kBlockSize;  // one past the block's queries, if it is full
  return (prefix + (end < lq ? end : lq) - 1) / kBlockSize;
}

// The page sizes the kernels run (their page arithmetic is shifts and masks).
inline bool valid_page_size(int64_t page_size) {
  return page_size >= 16 && page_size <= 256 && (page_size & (page_size - 1)) == 0;
}

// KAP's antidiagonal stride: a positive divisor of the block (the reference takes any; the CUDA KAP
// only valid_kap_stride's, cosa_tuning.h).
inline bool valid_stride(int64_t stride) { return stride >= 1 && kBlockSize % stride == 0; }

// KAP's stage-1 top-p, in (0, 1].
inline bool valid_top_p(double top_p) { return std::isfinite(top_p) && top_p > 0.0 && top_p <= 1.0; }

// The kernels hold softmax_scale in float32: it must stay a finite, normal float32 there.
inline bool valid_softmax_scale(double scale) {
  return scale >= std::numeric_limits<float>::min() && scale <= std::numeric_limits<float>::max();
}

// OSK's skip scale: finite in float32, <= 0 (which turns the in-kernel skip off) or at least float32's
// smallest normal number: the kernels hold delta in float32, where a larger magnitude is infinite, and
// flush subnormals to zero, where the skip would be off while the reference would keep it on.
inline bool valid_delta(double delta) {
  return std::abs(delta) <= std::numeric_limits<float>::max() &&
         (delta <= 0.0 || delta >= std::numeric_limits<float>::min());
}

// Whether a launch with this delta may skip blocks at all (spec section 3).
inline bool skip_enabled(float delta) { return delta > 0.f; }

}  // namespace cosa
