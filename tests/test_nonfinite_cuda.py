"""Non-finite inputs on the CUDA path agree with the reference (spec section 6; the CPU side is
tests/test_nonfinite.py): KAP's lists are the reference's, and OSK's rows are NaN exactly where the
reference's are and equal it elsewhere, with the skip on and off, for both vote scopes."""

import math

import pytest
import torch

from cosa import reference as R
from cosa.layout import kap_layout_args
from cosa.testing import random_problem

from helpers import assert_rows_close, dense_order, run_osk

pytestmark = pytest.mark.gpu

NAN, INF = math.nan, math.inf


def problem():
    return random_problem([1000, 300], [1000 + 512, 300], 8, 2, 128, page_size=64, dtype=torch.bfloat16,
                          device="cuda", structure="mixed", seed=3)


def cache_index(p, b, token, kv_head, dim):
    page_size = p["k_cache"].shape[1]
    return int(p["page_table"][b, token // page_size]), token % page_size, kv_head, dim


def planted(name):
    """The problem with one non-finite input: a query row's entry, a key's or a value's."""
    p = problem()
    where = {"q_nan": ("q", (700, 3, 9), NAN), "q_inf": ("q", (1100, 5, 0), INF),
             "k_nan": ("k_cache", cache_index(p, 0, 1200, 1, 17), NAN),
             "v_nan": ("v_cache", cache_index(p, 0, 1200, 0, 5), NAN)}[name]
    key, index, value = where
    p[key] = p[key].clone()
    p[key][index] = value
    return p


CASES = ["q_nan", "q_inf", "k_nan", "v_nan"]


@pytest.mark.parametrize("case", ["q_nan", "k_nan"])
def test_kap_lists_match_the_reference(ops, case):
    p = planted(case)
    order, counts = ops.kap(*kap_layout_args(p), 8, 0.9, None)
    ref_order, ref_counts = R.kap(*kap_layout_args(p), stride=8, top_p=0.9)
    same = (order == ref_order).all(-1) & (counts == ref_counts)
    assert same.all(), f"{int((~same).sum())} of {same.numel()} lists differ from the reference"


@pytest.mark.parametrize("vote", R.VOTE_SCOPES)
@pytest.mark.parametrize("delta", [0.0, 200.0])
@pytest.mark.parametrize("case", CASES)
def test_osk_rows_match_the_reference(ops, case, delta, vote):
    """On the lists of the CUDA prefill: NaN in exactly the reference's rows, every other row within
    the usual tolerance (finite lse where the reference's is finite)."""
    p = planted(case)
    out, lse, order, counts, skipped = ops.prefill(p["q"], p["k_cache"], p["v_cache"], *kap_layout_args(p)[2:], 8, 0.9, None,
                                                   delta, vote)
    ref_out, ref_lse, ref_skipped = run_osk(p, order, counts, delta=delta, vote=vote)
    assert bool(ref_out.isnan().any()), "the planted value reaches no row: the test checks nothing"
    assert_rows_close(out, ref_out, atol=2e-2)
    finite = torch.isfinite(ref_lse)
    assert_rows_close(lse[finite][:, None], ref_lse[finite][:, None], atol=1e-3, what="lse")
    assert torch.equal(skipped, ref_skipped)


@pytest.mark.parametrize("case", ["q_nan", "k_nan"])
def test_osk_lse_is_nan_on_the_rows_a_nan_logit_reaches(ops, case):
    p = planted(case)
    order, counts = dense_order(p)
    _, lse, _ = ops.osk(p["q"], p["k_cache"], p["v_cache"], p["page_table"], p["cu_seqlens_q"], p["seqused_k"],
                        order, counts, p["max_seqlen_q"], None, 0.0)
    _, ref_lse, _ = run_osk(p, order, counts, delta=0.0)
    assert bool(ref_lse.isnan().any())
    assert_rows_close(lse[..., None], ref_lse[..., None], atol=1e-3, what="lse")


@pytest.mark.parametrize("name", ["k_cache", "page_table", "seqused_k"])
@pytest.mark.parametrize("other", ["meta", "cpu"])
def test_mixed_devices_are_refused(ops, name, other):
    p = problem()
    p[name] = p[name].to(other)
    with pytest.raises(ValueError, match=f"cosa.kap: {name} must be on cuda:0 like q, got {other}"):
        ops.kap(*kap_layout_args(p), 8, 0.9, None)
