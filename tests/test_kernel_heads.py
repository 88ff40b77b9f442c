"""bench/kernel.py's head configurations: --heads parsing and speed-ups taken per configuration."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import kernel  # noqa: E402


def test_heads_argument():
    assert kernel.parse_args(["--heads", "12/2", "3/1"]).heads == [(12, 2), (3, 1)]
    assert kernel.parse_args([]).heads == [(32, 8)]
    every = kernel.parse_args(["--heads", "all", "12/2"]).heads
    assert every == list(kernel.HEAD_CONFIGS) and (12, 2) in every and (6, 1) in every and (64, 8) in every
    for bad in ("12", "12/5", "0/1", "a/b"):
        with pytest.raises(SystemExit):
            kernel.parse_args(["--heads", bad])


def test_speedups_and_shares_are_per_head_configuration():
    rows = [{"kind": "dense", "impl": "fa4", "n": 8192, "heads": "32/8", "ms": 1.0},
            {"kind": "dense", "impl": "fa4", "n": 8192, "heads": "12/2", "ms": 0.4},
            {"kind": "kap", "impl": "default", "n": 8192, "heads": "12/2", "ms": 0.04},
            {"kind": "kap", "impl": "default", "n": 8192, "heads": "32/8", "ms": 0.1},
            {"kind": "osk", "impl": "dense", "n": 8192, "heads": "6/1", "ms": 0.2}]
    kernel.add_speedups(rows)
    assert rows[2]["frac_of_fa4"] == pytest.approx(0.1) and rows[3]["frac_of_fa4"] == pytest.approx(0.1)
    assert rows[4]["x_fa4"] is None  # no FA4 row of its own configuration
