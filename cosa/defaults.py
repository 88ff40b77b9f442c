"""The defaults of the ops' tuning arguments, and their one source.

cosa.tuning (the tuning arguments' table, types and domains: the Python API, the reference and the
integrations take their defaults from its ``Tuning``) reads them, and writes them into
csrc/cosa_tuning.h for the C++ side: the op schemas of csrc/torch_binding.cpp (so that
``torch.ops.cosa.prefill(...)`` called without them gets the same ones) and the parameter structs of
csrc/cosa_params.h (what C API callers get). tests/test_ops.py fails when that header is stale or
the built extension disagrees with this file. Plain Python, no imports. Why these values:
docs/spec.md section 5."""

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
