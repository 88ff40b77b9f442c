"""The defaults of the ops' tuning arguments, and their one source.

The Python API (cosa.api) and the reference (cosa.reference) import them; the C++ side reads them
from csrc/cosa_defaults.h, which this file writes (``python3 cosa/defaults.py > csrc/cosa_defaults.h``):
the op schemas of csrc/torch_binding.cpp (so that ``torch.ops.cosa.prefill(...)`` called without
them gets the same ones) and the parameter structs of csrc/cosa_params.h (what C API callers get).
tests/test_ops.py fails when that header is stale or the built extension disagrees with this file.
Plain Python, no imports. Why these values: docs/spec.md section 5."""

STRIDE = 8  # KAP's antidiagonal stride
TOP_P = 0.95  # KAP's stage-1 top-p
SOFTMAX_SCALE = None  # None: 1 / sqrt(head_dim)
DELTA = 2000.0  # OSK's skip scale; <= 0 turns the in-kernel skip off
VOTE = "warpgroup"  # who decides a skip together: each 64-row half of a tile ("warpgroup") or the tile
# What KAP's proxy GEMM multiplies: q and k as given ("native"), e4m3 copies ("fp8"), or "auto": the
# fp8 proxy where the longest key sequence has at least FP8_PROXY_MIN_KEYS tokens, the native one below.
PROXY_PRECISION = "auto"
FP8_PROXY_MIN_KEYS = 8192
# The fp8 proxy centres each sequence's keys on the channel midpoints of every KEY_CENTRE_STRIDE-th key
# (tokens 0, KEY_CENTRE_STRIDE, 2 * KEY_CENTRE_STRIDE, ...): spec section 2.
KEY_CENTRE_STRIDE = 8

# As the op schemas spell them: each entry becomes the macro COSA_DEFAULT_<NAME> of the header.
SCHEMA_DEFAULTS = {"STRIDE": STRIDE, "TOP_P": TOP_P, "SOFTMAX_SCALE": SOFTMAX_SCALE, "DELTA": DELTA, "VOTE": VOTE,
                   "PROXY_PRECISION": PROXY_PRECISION}


def c_header() -> str:
    """The text of csrc/cosa_defaults.h."""
    # The enumerators of csrc/cosa_params.h that the string defaults name.
    vote_enumerators = {"tile": "kTile", "warpgroup": "kWarpgroup"}
    precision_enumerators = {"native": "kNative", "fp8": "kE4M3", "auto": "kAuto"}
    lines = ["// The defaults of the ops' tuning arguments, written by `python3 cosa/defaults.py >",
             "// csrc/cosa_defaults.h` from cosa/defaults.py, their one source (tests/test_ops.py fails when",
             "// this file is stale). Edit that file, not this one.",
             "#pragma once", "",
             "// As the op schemas of csrc/torch_binding.cpp spell them (strings bare: the binding quotes them)."]
    lines += [f"#define COSA_DEFAULT_{name} {value if isinstance(value, str) else repr(value)}"
              for name, value in SCHEMA_DEFAULTS.items()]
    lines += ["", "// The enumerators of csrc/cosa_params.h that the string defaults name.",
              f"#define COSA_DEFAULT_VOTE_SCOPE {vote_enumerators[VOTE]}",
              f"#define COSA_DEFAULT_PROXY_PRECISION_ENUM {precision_enumerators[PROXY_PRECISION]}",
              "", "// proxy_precision \"auto\" takes the fp8 proxy from this many keys (the longest sequence's).",
              f"#define COSA_FP8_PROXY_MIN_KEYS {FP8_PROXY_MIN_KEYS}",
              "", "// The fp8 proxy centres the keys on the channel midpoints of every this-many-th key.",
              f"#define COSA_KEY_CENTRE_STRIDE {KEY_CENTRE_STRIDE}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(c_header(), end="")
