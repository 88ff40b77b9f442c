// The ops' tuning arguments as cosa/tuning.py tabulates them, written by its c_header()
// (tests/test_ops.py fails when this file is stale). Edit that file, not this one. Needs no CUDA
// header: the binding's CPU-only build includes it through cosa_contract.h.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

// The defaults, as the op schemas of csrc/torch_binding.cpp spell them (strings bare: the binding
// quotes them).
#define COSA_DEFAULT_STRIDE 8
#define COSA_DEFAULT_TOP_P 0.95
#define COSA_DEFAULT_SOFTMAX_SCALE None
#define COSA_DEFAULT_DELTA 2000.0
#define COSA_DEFAULT_VOTE warpgroup
#define COSA_DEFAULT_PROXY_PRECISION auto

// proxy_precision "auto" takes the fp8 proxy from this many keys (the longest sequence's).
#define COSA_FP8_PROXY_MIN_KEYS 8192

// The fp8 proxy centres the keys on the channel midpoints of every this-many-th key.
#define COSA_KEY_CENTRE_STRIDE 8

namespace cosa {

// vote (tile or warpgroup): who decides together whether a listed block's P V work is skipped (spec
// section 3): the whole 128-row tile (both consumer warpgroups agree, one barrier across them per
// block), or each 64-row warpgroup for its own rows (no barrier between the two halves).
enum class VoteScope : int { kTile = 0, kWarpgroup = 1 };
constexpr VoteScope kDefaultVoteScope = VoteScope::kWarpgroup;
constexpr char kVoteScopeNames[] = "'tile' or 'warpgroup'";  // as the errors list them
// The VoteScope that a vote names; none for a name outside the set.
inline std::optional<VoteScope> parse_vote(std::string_view name) {
  if (name == "tile") return VoteScope::kTile;
  if (name == "warpgroup") return VoteScope::kWarpgroup;
  return std::nullopt;
}
inline bool valid_vote(VoteScope value) {
  return value == VoteScope::kTile || value == VoteScope::kWarpgroup;
}

// proxy_precision (native, fp8 or auto): what KAP's proxy GEMM multiplies (spec section 2): q and k
// as given, or e4m3 copies of them with one scale per 128-token block and head; auto: e4m3 where
// the longest key sequence has at least COSA_FP8_PROXY_MIN_KEYS tokens (where it measured faster),
// as given below that.
enum class ProxyPrecision : int { kNative = 0, kE4M3 = 1, kAuto = 2 };
constexpr ProxyPrecision kDefaultProxyPrecision = ProxyPrecision::kAuto;
constexpr char kProxyPrecisionNames[] = "'native', 'fp8' or 'auto'";  // as the errors list them
// The ProxyPrecision that a proxy_precision names; none for a name outside the set.
inline std::optional<ProxyPrecision> parse_proxy_precision(std::string_view name) {
  if (name == "native") return ProxyPrecision::kNative;
  if (name == "fp8") return ProxyPrecision::kE4M3;
  if (name == "auto") return ProxyPrecision::kAuto;
  return std::nullopt;
}
inline bool valid_proxy_precision(ProxyPrecision value) {
  return value == ProxyPrecision::kNative || value == ProxyPrecision::kE4M3 || value == ProxyPrecision::kAuto;
}

// The strides the CUDA KAP is built for (the reference takes any divisor of 128).
constexpr char kKapStrideNames[] = "4, 8 or 16";
inline bool valid_kap_stride(int64_t stride) {
  return stride == 4 || stride == 8 || stride == 16;
}

}  // namespace cosa
