#include "binding/messages.h"

#include <charconv>
#include <cstdlib>
#include <string>

namespace cosa::binding {

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

std::string tuple_str(c10::IntArrayRef values) {
  std::string out = "(";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
  return out + (values.size() == 1 ? ",)" : ")");
}

std::string float_repr(double value) {
  char text[32];
  const auto result = std::to_chars(text, text + sizeof(text), value);
  std::string repr(text, result.ptr);
  if (repr.find_first_of(".eEn") == std::string::npos) repr += ".0";  // "n": nan and inf
  return repr;
}

[[noreturn]] void fail_value(const char* op, const std::string& text) {
  TORCH_CHECK_VALUE(false, message("cosa.", op, ": ", text));
  std::abort();  // unreachable: TORCH_CHECK_VALUE(false, ...) always throws
}

}  // namespace cosa::binding
