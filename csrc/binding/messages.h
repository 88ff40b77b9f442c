// The wording of the ops' errors: Python's spellings of dtypes, shapes and floats, and the
// messages assembled from them, each naming the op and the argument (TypeError for a wrong dtype,
// ValueError for everything else).
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#define COSA_CHECK_VALUE(cond, op, ...) \
  TORCH_CHECK_VALUE(cond, ::cosa::binding::message("cosa.", op, ": ", __VA_ARGS__))
#define COSA_CHECK_TYPE(cond, op, ...) \
  TORCH_CHECK_TYPE(cond, ::cosa::binding::message("cosa.", op, ": ", __VA_ARGS__))

namespace cosa::binding {

// Python's spelling of a dtype, so that the messages read like Python's.
std::string dtype_name(at::ScalarType type);
// Python's spelling of a shape or strides tuple: (2, 3), (5,), ().
std::string tuple_str(c10::IntArrayRef values);
// Python's repr of a float (shortest round trip, "1.0" not "1").
std::string float_repr(double value);

// Error messages are assembled without iostreams: formatting a number through an ostream inside
// this module crashed on an H200 build (torch 2.11 with GCC 13: the stream's numeric facet was
// not usable from the extension), so numbers are converted with std::to_string / std::to_chars.
inline void append(std::string& out, const char* text) { out += text; }
inline void append(std::string& out, const std::string& text) { out += text; }
inline void append(std::string& out, double value) { out += float_repr(value); }
inline void append(std::string& out, const c10::Device& device) { out += device.str(); }
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

// Raises the ValueError "cosa.<op>: <text>".
[[noreturn]] void fail_value(const char* op, const std::string& text);

}  // namespace cosa::binding
