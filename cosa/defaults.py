"""The defaults of the ops' tuning arguments, and their one source.

The Python API (cosa.api), the reference (cosa.reference) and the op schemas take them from here:
setup.py compiles these values into the schemas of csrc/torch_binding.cpp (so that
``torch.ops.cosa.prefill(...)`` called without them gets the same ones), and
tests/test_ops.py checks that the built extension agrees with this file. Plain Python, no imports:
setup.py reads it before the package (and its extension) exists. Why these values: docs/spec.md
section 5."""

STRIDE = 8  # KAP's antidiagonal stride
TOP_P = 0.95  # KAP's stage-1 top-p
SOFTMAX_SCALE = None  # None: 1 / sqrt(head_dim)
DELTA = 2000.0  # OSK's skip scale; <= 0 turns the in-kernel skip off
VOTE = "warpgroup"  # who decides a skip together: each 64-row half of a tile ("warpgroup") or the tile
PROXY_PRECISION = "native"  # what KAP's proxy GEMM multiplies: q and k as given, or "fp8" (e4m3) copies

# What setup.py compiles into the schemas: each entry becomes the macro COSA_DEFAULT_<NAME>.
SCHEMA_DEFAULTS = {"STRIDE": STRIDE, "TOP_P": TOP_P, "SOFTMAX_SCALE": SOFTMAX_SCALE, "DELTA": DELTA, "VOTE": VOTE,
                   "PROXY_PRECISION": PROXY_PRECISION}
