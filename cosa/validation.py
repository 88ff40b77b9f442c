"""The Python types of the API's arguments (cosa.api), checked before anything reads them.

The argument contract itself (devices, dtypes, shapes, values, the contents of the index tensors)
is written once, in C++ (csrc/binding/contract.cpp), and every path runs it: the CUDA ops, the CPU
ops (cosa/ops.py) and the wrappers, through ``torch.ops.cosa.check_args``; the tuning arguments'
domains are also checked in Python (cosa.tuning), where the wrappers and the integrations take them.
What the C++ side cannot see is the Python type of an argument: the op schemas would coerce ``stride=True`` to 1 and refuse
``stride=8.0``, or an int past int64, with a RuntimeError that names no argument. This module refuses
those with a TypeError (a ValueError for the int's range) naming the op and the argument."""

from __future__ import annotations

import numbers

import torch


def _fail(op, name, expected, value):
    raise TypeError(f"cosa.{op}: {name} must be {expected}, got {type(value).__name__} {value!r}")


def tensor(op, name, value):
    if not isinstance(value, torch.Tensor):
        _fail(op, name, "a torch.Tensor", value)
    return value


def integer(op, name, value, optional=False):
    """An int (numpy's integers included) and not a bool, returned as a Python int; None passes
    through when ``optional``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(op, name, "an int" + (" or None" if optional else ""), value)
    if not -2**63 <= value < 2**63:  # the op schemas' int is int64
        raise ValueError(f"cosa.{op}: {name} must fit in int64, got {value}")
    return int(value)


def positive_integer(op, name, value):
    """An int as :func:`integer` takes it, and at least 1 (a ValueError naming the argument otherwise)."""
    value = integer(op, name, value)
    if value < 1:
        raise ValueError(f"cosa.{op}: {name} must be >= 1, got {value}")
    return value


def real(op, name, value, optional=False):
    """A real number (an int or a float, numpy's included) and not a bool, returned as a Python
    float; None passes through when ``optional``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(op, name, "a real number" + (" or None" if optional else ""), value)
    return float(value)


def string(op, name, value):
    if not isinstance(value, str):
        _fail(op, name, "a str", value)
    return value
