"""The README's main command, `python -m cosa.demo`, on the CPU at a small size (the reference path),
and the needle bookkeeping it relies on."""

import pytest
import torch

from cosa import demo
from cosa import reference as R
from cosa.testing import NEEDLE_TOKENS, random_problem


def test_random_problem_reports_the_needles_it_plants():
    p, needles = random_problem([700, 1500], [700 + 128, 1500], 4, 2, 64, structure="needles", seed=5,
                                return_needles=True)
    plain = random_problem([700, 1500], [700 + 128, 1500], 4, 2, 64, structure="needles", seed=5)
    assert all(torch.equal(p[key], plain[key]) for key in ("q", "k_cache", "page_table"))  # same draw
    assert len(needles) == 6 and {b for b, *_ in needles} == {0, 1}
    for b, first, last, head in needles:
        assert last - first + 1 == NEEDLE_TOKENS
        k = R.gather_kv(p["k_cache"], p["page_table"], b, int(p["seqused_k"][b])).float()
        norms = k.norm(dim=-1)  # [Lk, Hkv]; random keys have norm ~8, a needle adds ~9 along one direction
        assert float(norms[first:last + 1, head].mean()) > float(norms[first:last + 1, 1 - head].mean()) + 2.5


def test_demo_runs_on_the_cpu(capsys):
    assert demo.main(["--device", "cpu", "--n", "1024", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "PyTorch reference" in out
    needles = [line for line in out.splitlines() if line.startswith("needle:")]
    assert len(needles) == 3


def test_demo_says_which_proxy_auto_took():
    assert demo.proxy_text("auto", 4096) == "auto: native at 4096 keys"
    assert demo.proxy_text("auto", 32768) == "auto: fp8 at 32768 keys"
    assert demo.proxy_text("fp8", 4096) == "fp8"


@pytest.mark.parametrize("flag, value", [("--stride", "3"), ("--stride", "0"), ("--stride", "256"),
                                         ("--stride", "-8"), ("--top-p", "0"), ("--top-p", "1.5"),
                                         ("--top-p", "-0.5"), ("--top-p", "nan"), ("--top-p", "inf"),
                                         ("--delta", "inf"), ("--delta", "-inf"), ("--delta", "nan")])
def test_demo_rejects_bad_arguments_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.parse_args([f"{flag}={value}"])  # "=" lets argparse read "-inf" as a value
    assert exit_info.value.code == 2
    assert f"error: {flag} must" in capsys.readouterr().err


def test_demo_accepts_the_edges_of_the_ranges():
    for stride in (1, 2, 4, 8, 16, 32, 64, 128):
        assert demo.parse_args(["--stride", str(stride)]).stride == stride
    args = demo.parse_args(["--top-p", "1", "--delta", "0"])
    assert (args.top_p, args.delta) == (1.0, 0.0)
    assert demo.parse_args(["--top-p", "1e-6", "--delta", "-1"]).delta == -1.0
