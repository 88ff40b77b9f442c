"""Non-finite inputs on the CPU path (cosa.prefill over the reference; spec section 6): NaN reaches
exactly the rows it touches, as in dense attention, and no row turns into zeros. The CUDA path is
held to the same outputs in tests/test_nonfinite_cuda.py."""

import math

import pytest
import torch

import cosa
from cosa import reference as R
from cosa.layout import kap_layout_args
from cosa.testing import random_problem

from helpers import assert_rows_close, dense_order, query_blocks, run_dense, run_kap, run_osk

NAN, INF = math.nan, math.inf


def problem(seed=0):
    # Two sequences (the second must stay clean), a cached prefix, GQA 2.
    return random_problem([300, 77], [300 + 256, 77], 4, 2, 64, page_size=16, dtype=torch.bfloat16, device="cpu",
                          structure="mixed", seed=seed)


def with_value(p, name, index, value):
    """``p`` with ``p[name][index] = value`` (a copy of that tensor)."""
    t = p[name].clone()
    t[index] = value
    return dict(p, **{name: t})


def cache_index(p, b, token, kv_head, dim):
    """Where token ``token`` of sequence ``b`` lives in the paged caches."""
    page_size = p["k_cache"].shape[1]
    return int(p["page_table"][b, token // page_size]), token % page_size, kv_head, dim


def prefill(p, **kw):
    return cosa.prefill(p["q"], p["k_cache"], p["v_cache"], p["page_table"], p["cu_seqlens_q"], p["seqused_k"],
                        return_stats=True, **kw)


def nan_rows(out):
    return out.isnan().any(-1)


def assert_matches_dense(p, out, stats):
    """Every row, NaN pattern included, as dense attention gives it (top_p = 1 and no skip: the
    sparse path visits every causal block)."""
    dense_out, dense_lse = run_dense(p)
    assert_rows_close(out, dense_out, atol=2e-2)
    assert_rows_close(stats["lse"][..., None], dense_lse[..., None], atol=1e-3, what="lse")


def test_a_nan_in_a_query_row_reaches_that_row_only():
    p = with_value(problem(), "q", (10, 1, 5), NAN)
    out, stats = prefill(p)
    expected = torch.zeros(out.shape[:2], dtype=torch.bool)
    expected[10, 1] = True
    assert torch.equal(nan_rows(out), expected)
    assert torch.equal(stats["lse"].isnan(), expected.T)
    assert_matches_dense(p, *prefill(p, top_p=1.0, delta=0.0))


@pytest.mark.parametrize("value", [INF, -INF])
def test_an_infinite_query_row_is_nan_as_in_dense_attention(value):
    p = problem()
    q = p["q"].clone()
    q[200, 2] = value  # the keys have entries of both signs: +inf and -inf logits, NaN in dense attention
    p = dict(p, q=q)
    out, stats = prefill(p)
    expected = torch.zeros(out.shape[:2], dtype=torch.bool)
    expected[200, 2] = True
    assert torch.equal(nan_rows(out), expected)
    assert_matches_dense(p, *prefill(p, top_p=1.0, delta=0.0))


def key_problem():
    """A NaN in one key: token 300 of sequence 0 (query block 0's diagonal is key block 2), KV head 0."""
    p = problem()
    return with_value(p, "k_cache", cache_index(p, 0, 300, 0, 3), NAN), 300


def test_a_nan_key_reaches_the_rows_that_see_it_as_in_dense_attention():
    p, token = key_problem()
    out, stats = prefill(p, top_p=1.0, delta=0.0)
    prefix = 256
    expected = torch.zeros(out.shape[:2], dtype=torch.bool)
    expected[token - prefix:300, :2] = True  # the rows at or after the key, the query heads of KV head 0
    assert torch.equal(nan_rows(out), expected)
    assert_matches_dense(p, out, stats)


@pytest.mark.parametrize("vote", R.VOTE_SCOPES)
def test_a_nan_key_reaches_exactly_the_rows_whose_list_takes_its_block(vote):
    """KAP's lists and OSK's skip decide which rows take key block 2: those rows (and only those)
    at or after the key are NaN; every other row equals OSK's output on the clean inputs."""
    p, token = key_problem()
    clean = problem()
    out, stats = prefill(p, delta=100.0, vote=vote)
    order, counts = stats["order"], stats["counts"]
    _, _, _, trace = run_osk(p, order, counts, delta=100.0, vote=vote, return_skip_trace=True)
    expected = torch.zeros(out.shape[:2], dtype=torch.bool)
    for g, prefix, i in query_blocks(p):
        if g >= 3:  # sequence 0's query blocks are 0..2
            break
        for h in range(2):
            for k in range(int(counts[h, g])):
                if int(order[h, g, k]) == token // R.BLOCK:
                    rows = torch.arange(i * R.BLOCK, min(300, (i + 1) * R.BLOCK))
                    taken = ~trace[h, g, k].repeat_interleave(R.HALF)[: len(rows)]
                    expected[rows[taken & (prefix + rows >= token)], h] = True
    assert bool(expected.any()), "no row takes the block: the test checks nothing"
    assert torch.equal(nan_rows(out), expected)
    clean_out, _, _ = run_osk(clean, order, counts, delta=100.0, vote=vote)
    assert_rows_close(out.masked_fill(expected[..., None], 0.0), clean_out.masked_fill(expected[..., None], 0.0),
                      atol=2e-2)


def test_a_nan_value_reaches_the_tiles_that_visit_its_block():
    """P V multiplies the whole block, zero weights included (0 * NaN = NaN, as on the GPU): every
    row of a tile that visits the block is NaN, the rows before the value in that block too."""
    p = problem()
    p = with_value(p, "v_cache", cache_index(p, 0, 300, 1, 7), NAN)
    order, counts = dense_order(p)
    out, lse, _ = run_osk(p, order, counts, delta=0.0)
    expected = torch.zeros(out.shape[:2], dtype=torch.bool)
    expected[:300, 2:4] = True  # sequence 0's tiles of query heads 2 and 3 all visit key block 2
    assert torch.equal(nan_rows(out), expected)
    assert torch.isfinite(lse).all()  # the softmax weights do not read V


def test_kap_keeps_every_candidate_of_a_query_block_whose_proxy_row_is_all_nan():
    """A NaN query row makes its stride row's proxy logits NaN: that (head, query block) keeps every
    causal block (its scores are NaN, which reach no top-p threshold); every other list is the one
    of the clean inputs."""
    clean = problem()
    p = with_value(clean, "q", (130, 3, 0), NAN)  # query block 1 of sequence 0, head 3
    order, counts = run_kap(p, top_p=0.5)
    clean_order, clean_counts = run_kap(clean, top_p=0.5)
    diagonal = 256 // R.BLOCK + 1
    assert int(clean_counts[3, 1]) < diagonal + 1 == int(counts[3, 1])
    assert sorted(order[3, 1, : diagonal + 1].tolist()) == list(range(diagonal + 1))
    same = (order == clean_order).all(-1) & (counts == clean_counts)
    same[3, 1] = True
    assert same.all()


def test_kap_drops_a_nan_proxy_cell_from_the_maxima():
    """A NaN key makes one cell of every stride row that sees it NaN: the cell drops out of the
    block maxima (as the kernel's fmaxf drops it) and the other cells score as they do on the clean
    inputs (here that cell is no block's maximum, so every score and flag is the clean one)."""
    p, _ = key_problem()
    scores, hrm = R.kap_scores(*kap_layout_args(p))
    clean_scores, clean_hrm = R.kap_scores(*kap_layout_args(problem()))
    assert torch.equal(scores, clean_scores) and torch.equal(hrm, clean_hrm)
