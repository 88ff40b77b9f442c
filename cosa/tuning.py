"""The ops' tuning arguments: their one table, their checks in Python, and the C++ header made from them.

``stride``, ``top_p``, ``delta``, ``vote`` and ``proxy_precision`` are settings (:class:`Tuning`,
what the integrations hold); ``softmax_scale`` is an argument of each call. :func:`check` refuses a
value of the wrong Python type with a TypeError and one outside its domain with a ValueError, each
naming ``cosa.<op>`` and the argument, in the words of the ops' C++ contract (csrc/binding/contract.cpp),
which checks the same domains for callers of ``torch.ops.cosa`` through the predicates of
csrc/cosa_contract.h.

The C++ side reads this table from csrc/cosa_tuning.h, which :func:`c_header` writes (after a change
here: ``python3 -c 'from cosa import tuning; print(tuning.c_header(), end="")' > csrc/cosa_tuning.h``):
the defaults as the op schemas spell them, the value sets with their enumerators and parse
functions, and the strides of the CUDA KAP. tests/test_ops.py fails when that header is stale. Why
the default values: docs/spec.md section 5."""

from __future__ import annotations

import math
import textwrap
from dataclasses import InitVar, dataclass, fields

from . import defaults, validation

BLOCK = 128  # the logical block (spec section 1): a stride divides it
FLOAT32_MIN_NORMAL = 2.0 ** -126  # below it the kernels (built to flush subnormals) read 0
FLOAT32_MAX = float.fromhex("0x1.fffffep+127")

# The arguments whose values are names: what they choose, the C++ enum each one parses to, and each
# name with its enumerator, whose value is the name's position here (the C API's constants, cosa_c_api.h).
VALUE_SETS = {
    "vote": ("who decides together whether a listed block's P V work is skipped (spec section 3): the whole "
             "128-row tile (both consumer warpgroups agree, one barrier across them per block), or each 64-row "
             "warpgroup for its own rows (no barrier between the two halves)",
             "VoteScope", (("tile", "kTile"), ("warpgroup", "kWarpgroup"))),
    "proxy_precision": ("what KAP's proxy GEMM multiplies (spec section 2): q and k as given, or e4m3 copies of "
                        "them with one scale per 128-token block and head; auto: e4m3 where the longest key "
                        "sequence has at least COSA_FP8_PROXY_MIN_KEYS tokens (where it measured faster), as "
                        "given below that",
                        "ProxyPrecision", (("native", "kNative"), ("fp8", "kE4M3"), ("auto", "kAuto"))),
}
# The strides the CUDA KAP is built for (the contract, and the reference, take any divisor of BLOCK).
KAP_CUDA_STRIDES = (4, 8, 16)


def names(argument: str) -> tuple[str, ...]:
    """The values that ``argument`` (a key of VALUE_SETS) takes."""
    return tuple(name for name, _ in VALUE_SETS[argument][2])


def _listed(items) -> str:
    """'a', 'b' or 'c', as the errors list the values of a set."""
    items = list(items)
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def _names_listed(argument: str) -> str:
    return _listed(f"'{name}'" for name in names(argument))


def _in_domain(name: str, value) -> str | None:
    """Why ``value`` (of the right Python type) is outside the domain of the argument ``name``, or None."""
    if name == "stride" and not (value >= 1 and BLOCK % value == 0):
        return f"stride must be a positive divisor of {BLOCK}, got {value}"
    if name == "top_p" and not (math.isfinite(value) and 0.0 < value <= 1.0):
        return f"top_p must be in (0, 1], got {value!r}"
    if name == "softmax_scale" and value is not None and not FLOAT32_MIN_NORMAL <= value <= FLOAT32_MAX:
        # The kernels hold it in float32: it must stay a finite, normal float32 there.
        return (f"softmax_scale must be a positive number in float32's normal range [{FLOAT32_MIN_NORMAL!r}, "
                f"{FLOAT32_MAX!r}], got {value!r}")
    if name == "delta" and not (abs(value) <= FLOAT32_MAX and (value <= 0.0 or value >= FLOAT32_MIN_NORMAL)):
        # The kernels hold delta in float32, where a larger magnitude is infinite, and flush subnormals
        # to zero, where the skip would be off; the reference would keep it on.
        return (f"delta must be a number of magnitude at most {FLOAT32_MAX!r} (finite in float32), <= 0 (which "
                f"disables the in-kernel skip) or at least {FLOAT32_MIN_NORMAL!r} (float32's smallest normal "
                f"number), got {value!r}")
    if name in VALUE_SETS and value not in names(name):
        return f"{name} must be {_names_listed(name)}, got '{value}'"
    return None


_TYPES = {"stride": validation.integer, "top_p": validation.real, "delta": validation.real,
          "vote": validation.string, "proxy_precision": validation.string}


def check(op: str, name: str, value):
    """``value`` of the tuning argument ``name`` (or ``softmax_scale``) as the ops take it (an int, a
    float, a str; None for the default softmax scale); a TypeError or ValueError naming ``cosa.<op>``
    and the argument otherwise."""
    if name == "softmax_scale":
        value = validation.real(op, name, value, optional=True)
    else:
        value = _TYPES[name](op, name, value)
    problem = _in_domain(name, value)
    if problem:
        raise ValueError(f"cosa.{op}: {problem}")
    return value


def checked(op: str, **given) -> dict:
    """The given tuning arguments (and softmax_scale), each checked by :func:`check`."""
    return {name: check(op, name, value) for name, value in given.items()}


@dataclass(frozen=True)
class Tuning:
    """The ops' tuning settings, checked when made (``op`` names the caller in the errors). The
    integrations' settings extend it; the wrappers' signatures take their defaults from it."""
    stride: int = defaults.STRIDE  # KAP's antidiagonal stride
    top_p: float = defaults.TOP_P  # KAP's stage-1 top-p
    delta: float = defaults.DELTA  # OSK's skip scale; <= 0 turns the in-kernel skip off
    vote: str = defaults.VOTE  # who decides a skip together
    proxy_precision: str = defaults.PROXY_PRECISION  # what KAP's proxy GEMM multiplies
    op: InitVar[str] = "Tuning"

    def __post_init__(self, op: str) -> None:
        for field in fields(Tuning):
            object.__setattr__(self, field.name, check(op, field.name, getattr(self, field.name)))


def _c_spelling(value) -> str:
    """A default as the op schemas spell it (strings bare: the binding quotes them)."""
    return value if isinstance(value, str) else repr(value)


def c_header() -> str:
    """The text of csrc/cosa_tuning.h."""
    lines = ["// The ops' tuning arguments as cosa/tuning.py tabulates them, written by its c_header()",
             "// (tests/test_ops.py fails when this file is stale). Edit that file, not this one. Needs no CUDA",
             "// header: the binding's CPU-only build includes it through cosa_contract.h.",
             "#pragma once", "", "#include <cstdint>", "#include <optional>", "#include <string_view>", "",
             "// The defaults, as the op schemas of csrc/torch_binding.cpp spell them (strings bare: the binding",
             "// quotes them)."]
    schema_defaults = {"stride": defaults.STRIDE, "top_p": defaults.TOP_P, "softmax_scale": defaults.SOFTMAX_SCALE,
                       "delta": defaults.DELTA, "vote": defaults.VOTE, "proxy_precision": defaults.PROXY_PRECISION}
    lines += [f"#define COSA_DEFAULT_{name.upper()} {_c_spelling(value)}" for name, value in schema_defaults.items()]
    lines += ["", "// proxy_precision \"auto\" takes the fp8 proxy from this many keys (the longest sequence's).",
              f"#define COSA_FP8_PROXY_MIN_KEYS {defaults.FP8_PROXY_MIN_KEYS}",
              "", "// The fp8 proxy centres the keys on the channel midpoints of every this-many-th key.",
              f"#define COSA_KEY_CENTRE_STRIDE {defaults.KEY_CENTRE_STRIDE}", "", "namespace cosa {"]
    for argument, (meaning, enum, members) in VALUE_SETS.items():
        default = dict(members)[getattr(defaults, argument.upper())]
        enumerators = ", ".join(f"{enumerator} = {value}" for value, (_, enumerator) in enumerate(members))
        summary = f"{argument} ({_listed(name for name, _ in members)}): {meaning}."
        lines += [""] + [f"// {line}" for line in textwrap.wrap(summary, 97)]
        lines += [f"enum class {enum} : int {{ {enumerators} }};",
                  f"constexpr {enum} kDefault{enum} = {enum}::{default};",
                  f"constexpr char k{enum}Names[] = \"{_names_listed(argument)}\";  // as the errors list them",
                  f"// The {enum} that a {argument} names; none for a name outside the set.",
                  f"inline std::optional<{enum}> parse_{argument}(std::string_view name) {{"]
        lines += [f"  if (name == \"{name}\") return {enum}::{enumerator};" for name, enumerator in members]
        lines += ["  return std::nullopt;", "}",
                  f"inline bool valid_{argument}({enum} value) {{",
                  "  return " + " || ".join(f"value == {enum}::{enumerator}" for _, enumerator in members) + ";",
                  "}"]
    lines += ["", "// The strides the CUDA KAP is built for (the reference takes any divisor of 128).",
              f"constexpr char kKapStrideNames[] = \"{_listed(str(s) for s in KAP_CUDA_STRIDES)}\";",
              "inline bool valid_kap_stride(int64_t stride) {",
              "  return " + " || ".join(f"stride == {s}" for s in KAP_CUDA_STRIDES) + ";", "}",
              "", "}  // namespace cosa"]
    return "\n".join(lines) + "\n"
