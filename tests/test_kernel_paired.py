"""bench/kernel.py's paired rounds for OSK on the CPU: which calls are interleaved, and the ratios
and quartiles they give the rows (the kernels themselves need a Hopper GPU)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import kernel  # noqa: E402


class FakeSets:
    def take(self):
        return "set"


def paired_bench(monkeypatch, times):
    """A Bench whose interleaved rounds return ``times`` and record the calls they were given."""
    bench = kernel.Bench.__new__(kernel.Bench)
    bench.cosa = None
    seen = {}

    def interleaved(fns, rounds):
        seen.update(fns=fns, rounds=rounds)
        return times

    monkeypatch.setattr(kernel, "interleaved_ms", interleaved)
    return bench, seen


def lists():
    return kernel.Lists("random-25%", order=None, counts=None, ref=None, budget=0.25, flops=1.0)


def test_paired_rounds_give_the_peer_ratio_and_the_skip_tax(monkeypatch):
    times = {"off": [2.0, 2.0, 4.0], "tile": [2.2, 2.0, 4.4], "warpgroup": [2.0, 2.1, 4.0],
             "peer": [2.2, 2.4, 4.0]}
    bench, seen = paired_bench(monkeypatch, times)
    off = {"note": ""}
    on = {"tile": {"note": "skip on"}, "warpgroup": {"note": "skip on"}}
    bench.osk_paired({"n": 4096, "sets": FakeSets()}, lists(), off, on, ("flex-flash", lambda s: None))
    assert set(seen["fns"]) == {"off", "tile", "warpgroup", "peer"} and seen["rounds"] == kernel.PAIRED_ROUNDS
    assert off["x_peer_paired"] == pytest.approx(1.1) and off["peer_paired"] == "flex-flash"
    assert off["x_peer_paired_quartiles"] == pytest.approx([1.05, 1.15])
    assert on["tile"]["skip_tax_paired"] == pytest.approx(1.1) and on["warpgroup"]["skip_tax_paired"] == pytest.approx(1.0)
    assert "1.100x flex-flash" in off["note"] and on["tile"]["note"].endswith("paired 1.100x")


def test_without_a_peer_only_the_skip_tax_is_paired(monkeypatch):
    bench, seen = paired_bench(monkeypatch, {"off": [1.0, 1.0], "tile": [1.5, 1.5]})
    off, on = {"note": ""}, {"tile": {"note": ""}}
    bench.osk_paired({"n": 4096, "sets": FakeSets()}, lists(), off, on, None)
    assert set(seen["fns"]) == {"off", "tile"} and "x_peer_paired" not in off
    assert on["tile"]["skip_tax_paired"] == pytest.approx(1.5)


def test_paired_skip_costs_are_taken_round_by_round():
    """Per round (skip - first) / (full - first), then the median: a round whose clock ran slow for
    every call gives the same cost as the others."""
    rows = {"tile": {"note": ""}, "warpgroup": {"note": ""}}
    times = {"full": [10.0, 20.0, 10.0], "first": [2.0, 4.0, 2.0], "tile": [6.0, 12.0, 6.0],
             "warpgroup": [4.0, 8.0, 5.0]}
    kernel.add_paired_skip_costs(rows, times)
    assert rows["tile"]["skip_cost_paired"] == pytest.approx(0.5)
    assert rows["warpgroup"]["skip_cost_paired"] == pytest.approx(0.25)
    assert rows["warpgroup"]["skip_cost_paired_quartiles"] == pytest.approx([0.25, 0.3125])
    assert "paired 0.50" in rows["tile"]["note"]
