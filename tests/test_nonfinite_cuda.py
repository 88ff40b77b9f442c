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


def keys_minus_inf_in_dim_0(p, tokens):
    """q's dim 0 set to 1 and those keys' dim 0 to -inf: their logits are -inf for every query."""
    p["q"] = p["q"].clone()
    p["q"][..., 0] = 1.0
    p["k_cache"] = p["k_cache"].clone()
    for token in tokens:
        page, row, _, _ = cache_index(p, 0, token, 0, 0)
        p["k_cache"][page, row, :, 0] = -INF


@pytest.mark.parametrize("delta", [0.0, 200.0])
def test_a_row_with_no_live_key_then_logits_far_below_zero(ops, delta):
    """Block 0's logits are -inf, block 1's about -100 nats, block 2's (the diagonal) of order 1. A
    row's running max is still -inf after block 0, so the kernel without the skip took block 1's
    exponentials against 0, where they underflow; rebasing them made the row NaN (0 * inf)."""
    p = random_problem([128], [384], 2, 1, 128, page_size=64, dtype=torch.bfloat16, device="cuda", seed=21)
    keys_minus_inf_in_dim_0(p, range(128))
    direction = p["q"][0, 0].float().sign()
    direction[0] = 0.0
    p["q"][..., 1:] = direction[1:].to(p["q"].dtype)
    for token in range(128, 256):  # logit -100: q . k * d^-1/2 with k = -(100 / sqrt(d)) * direction
        page, row, _, _ = cache_index(p, 0, token, 0, 0)
        p["k_cache"][page, row] = (-100.0 / math.sqrt(128) * direction).to(p["k_cache"].dtype)
    order, counts = dense_order(p)
    got = ops.osk(p["q"], p["k_cache"], p["v_cache"], p["page_table"], p["cu_seqlens_q"], p["seqused_k"],
                  order, counts, p["max_seqlen_q"], None, delta)
    ref_out, ref_lse, _ = run_osk(p, order, counts, delta=delta)
    assert not bool(ref_out.isnan().any())
    assert_rows_close(got[0], ref_out, atol=2e-2)
    assert_rows_close(got[1][..., None], ref_lse[..., None], atol=1e-3, what="lse")


def test_a_row_with_no_live_key_is_zero_even_where_v_is_nan(ops):
    """Every logit -inf (spec section 6: out 0, lse -inf), and a NaN in V: P = 0 times NaN made O NaN,
    which the epilogue's multiplication by 1 / l = 0 kept."""
    p = random_problem([256], [256], 2, 1, 128, page_size=64, dtype=torch.bfloat16, device="cuda", seed=22)
    keys_minus_inf_in_dim_0(p, range(256))
    p["v_cache"] = p["v_cache"].clone()
    p["v_cache"][cache_index(p, 0, 10, 0, 5)] = NAN
    order, counts = dense_order(p)
    out, lse, _ = ops.osk(p["q"], p["k_cache"], p["v_cache"], p["page_table"], p["cu_seqlens_q"], p["seqused_k"],
                          order, counts, p["max_seqlen_q"], None, 0.0)
    ref_out, ref_lse, _ = run_osk(p, order, counts, delta=0.0)
    assert bool((ref_out == 0).all()) and bool((ref_lse == -INF).all())
    assert bool((out == 0).all()) and bool((lse == -INF).all())
