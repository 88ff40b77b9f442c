"""The reference against the spec's properties (docs/spec.md sections 2-3) and against exact attention."""

import math

import pytest
import torch

from cosa import defaults
from cosa import reference as R
from cosa.layout import kap_layout_args, paged_from_contiguous
from cosa.testing import random_problem

from helpers import assert_rows_close, dense_order, permute_lists, query_blocks, rel_err, run_dense, run_kap, run_osk

F64 = dict(dtype=torch.float64)


def problem(seqlens_q=(300, 77), seqlens_k=(300 + 256, 77), hq=4, hkv=2, d=64, page_size=16, **kw):
    return random_problem(list(seqlens_q), list(seqlens_k), hq, hkv, d, page_size=page_size, **{**F64, **kw})


def test_dense_attention_matches_sdpa():
    p = problem(seqlens_q=(200, 129, 1), seqlens_k=(456, 129, 257), hq=6, hkv=3, seed=1)
    out, lse = run_dense(p)
    cu, lk = p["cu_seqlens_q"].tolist(), p["seqused_k"].tolist()
    for b in range(3):
        lq = cu[b + 1] - cu[b]
        k = R.gather_kv(p["k_cache"], p["page_table"], b, lk[b]).repeat_interleave(2, 1).transpose(0, 1)
        v = R.gather_kv(p["v_cache"], p["page_table"], b, lk[b]).repeat_interleave(2, 1).transpose(0, 1)
        q = p["q"][cu[b]:cu[b + 1]].transpose(0, 1)
        mask = torch.arange(lk[b])[None, :] <= (lk[b] - lq + torch.arange(lq))[:, None]
        expect = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1)
        assert_rows_close(out[cu[b]:cu[b + 1]], expect, atol=1e-12)
        logits = (q @ k.transpose(1, 2)) / math.sqrt(q.shape[-1])
        expect_lse = torch.logsumexp(logits.masked_fill(~mask, -math.inf), -1)
        assert torch.allclose(lse[:, cu[b]:cu[b + 1]].double(), expect_lse, atol=1e-5)


@pytest.mark.parametrize("structure", [None, "mixed"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (8, 1)])
def test_all_blocks_without_skip_equal_dense(structure, hq, hkv):
    p = problem(hq=hq, hkv=hkv, structure=structure, seed=hq + hkv)
    order, counts = run_kap(p, top_p=1.0)
    full_order, full_counts = dense_order(p)
    assert torch.equal(counts, full_counts), "top_p = 1 must keep every causal candidate"
    assert torch.equal(order.sort(-1).values, full_order.sort(-1).values)
    out, lse, skipped = run_osk(p, order, counts, delta=0.0)
    ref_out, ref_lse = run_dense(p)
    assert_rows_close(out, ref_out, atol=1e-12)
    assert torch.allclose(lse, ref_lse, atol=1e-5)
    assert int(skipped.sum()) == 0


def test_order_invariance_without_skip():
    p = problem(structure="mixed", seed=3)
    order, counts = run_kap(p, top_p=0.9)
    out, lse, _ = run_osk(p, order, counts, delta=-1.0)
    shuffled = permute_lists(order, counts, torch.Generator().manual_seed(0))
    assert not torch.equal(shuffled, order)
    out2, lse2, _ = run_osk(p, shuffled, counts, delta=-1.0)
    assert_rows_close(out2, out, atol=1e-12)
    assert torch.allclose(lse2, lse, atol=1e-10)


def _block_logits(p, h, g, j):
    """Exact scaled logits [rows, 128] of query block g (head h) against key block j."""
    for g2, prefix, i in query_blocks(p):
        if g2 == g:
            break
    cu, lk = p["cu_seqlens_q"].tolist(), p["seqused_k"].tolist()
    b = max(x for x in range(len(lk)) if sum(R.cdiv(cu[y + 1] - cu[y], 128) for y in range(x)) <= g)
    q0 = cu[b] + 128 * i
    q = p["q"][q0:min(cu[b + 1], q0 + 128), h]
    hkv = p["k_cache"].shape[2]
    k = R.gather_kv(p["k_cache"], p["page_table"], b, lk[b])[:, h // (p["q"].shape[1] // hkv)]
    k_pos = torch.arange(128 * j, min(lk[b], 128 * j + 128))
    s = (q @ k[k_pos].T) / math.sqrt(q.shape[-1])
    q_pos = prefix + 128 * i + torch.arange(q.shape[0])
    return s.masked_fill(k_pos[None, :] > q_pos[:, None], -math.inf), lk[b]


@pytest.mark.parametrize("vote", R.VOTE_SCOPES)
def test_skipped_block_never_raises_running_max(vote):
    p = problem(seqlens_q=(640,), seqlens_k=(1024,), hq=2, hkv=1, structure="mixed", seed=4)
    delta = 200.0
    order, counts = run_kap(p, top_p=1.0)
    _, _, skipped, trace = run_osk(p, order, counts, delta=delta, vote=vote, return_skip_trace=True)
    assert int(skipped.sum()) > 0, "the input must make the vote skip something"
    assert torch.equal(trace.sum((-1, -2), dtype=torch.int32), skipped)
    if vote == "tile":
        assert torch.equal(trace[..., 0], trace[..., 1]), "the tile-wide vote skips both halves or neither"
    for h in range(order.shape[0]):
        for g in range(int((counts[h] > 0).sum())):
            running = None
            for k in range(int(counts[h, g])):
                s, n = _block_logits(p, h, g, int(order[h, g, k]))
                m_loc = s.amax(-1)
                skipped_rows = trace[h, g, k].repeat_interleave(R.HALF)[:m_loc.shape[0]]
                if bool(skipped_rows.any()):
                    assert k > 0
                    below = m_loc - running < math.log(delta / n)
                    assert bool(below[skipped_rows].all())
                    assert bool((m_loc < running)[skipped_rows].all()), "a skipped block raised the running max"
                if running is None:
                    running = m_loc
                else:
                    running = torch.where(skipped_rows, running, torch.maximum(running, m_loc))


def test_warpgroup_vote_skips_at_least_what_the_tile_vote_skips():
    p = problem(seqlens_q=(640,), seqlens_k=(1024,), hq=2, hkv=1, structure="mixed", seed=4)
    order, counts = run_kap(p, top_p=1.0)
    _, _, tile_skipped = run_osk(p, order, counts, delta=200.0, vote="tile")
    _, _, half_skipped = run_osk(p, order, counts, delta=200.0, vote="warpgroup")
    assert int(half_skipped.sum()) >= int(tile_skipped.sum()) > 0


def test_skip_changes_output_little_and_is_off_when_delta_reaches_n():
    p = problem(seqlens_q=(640,), seqlens_k=(1024,), hq=2, hkv=1, structure="mixed", seed=5)
    order, counts = run_kap(p, top_p=1.0)
    exact, _, _ = run_osk(p, order, counts, delta=0.0)
    out, _, skipped = run_osk(p, order, counts, delta=200.0)
    assert int(skipped.sum()) > 0
    assert rel_err(out, exact) < 0.05
    off, _, none_skipped = run_osk(p, order, counts, delta=1024.0)  # delta >= N: exact
    assert int(none_skipped.sum()) == 0
    assert torch.equal(off, exact)


def test_delta_and_tau_are_taken_in_float32():
    """As the kernels hold them: a delta whose float32 is N switches the skip off, and delta / N below
    float32's normal range gives tau = -inf, where no live row skips (a half past Lq still does)."""
    p = problem(seqlens_q=(552,), seqlens_k=(1064,), hq=2, hkv=1, structure="sinks", seed=6, scale_logit=25.0)
    order, counts = run_kap(p, top_p=1.0)
    assert int(run_osk(p, order, counts, delta=1063.0)[2].sum()) > 0
    assert float(torch.tensor(1063.99999, dtype=torch.float32)) == 1064.0
    assert int(run_osk(p, order, counts, delta=1063.99999)[2].sum()) == 0
    # 552 queries: the last query block's second half (rows 576-639) holds no live row.
    _, _, skipped = run_osk(p, order, counts, delta=1.5 * 2.0 ** -126)
    expected = torch.zeros_like(skipped)
    expected[:, 4] = counts[:, 4] - 1
    assert torch.equal(skipped, expected)


def test_top_p_that_rounds_to_one_in_float32_keeps_every_candidate():
    """Key block 1 anti-aligned with every query: its proxy score is exactly 0, so a top_p below 1
    leaves it out, and one that is 1 in float32 (as the kernels hold it) keeps it."""
    direction = torch.zeros(64, dtype=torch.float64)
    direction[0] = 20.0
    q = direction.expand(384, 1, 64).clone()
    k = direction.expand(384, 1, 64).clone()
    k[128:256] *= -1
    p = paged_from_contiguous(q, k, torch.randn(384, 1, 64, dtype=torch.float64))
    lists = {top_p: run_kap(p, top_p=top_p) for top_p in (1.0, 1.0 - 1e-9, 0.999)}
    assert int(lists[1.0][1][0, 2]) == 3 and int(lists[0.999][1][0, 2]) == 2
    assert all(torch.equal(a, b) for a, b in zip(lists[1.0], lists[1.0 - 1e-9]))


def test_hrm_first_sorted_and_forced_blocks_kept():
    p = problem(seqlens_q=(1000, 300), seqlens_k=(1000 + 512, 300), structure="mixed", seed=6)
    scores, hrm = R.kap_scores(p["q"], p["k_cache"], p["page_table"], p["cu_seqlens_q"], p["seqused_k"],
                               p["max_seqlen_q"], p["max_seqlen_k"])
    order, counts = run_kap(p, top_p=0.8)
    for g, prefix, i in query_blocks(p):
        diagonal = prefix // 128 + i
        for h in range(order.shape[0]):
            lst = order[h, g, :counts[h, g]].tolist()
            assert order[h, g, counts[h, g]:].eq(-1).all()
            assert len(set(lst)) == len(lst)
            assert 0 in lst and diagonal in lst
            assert all(0 <= j <= diagonal for j in lst)
            flagged = set(torch.nonzero(hrm[h, g]).flatten().tolist())
            assert flagged and flagged <= set(lst), "every HRM block is kept"
            keys = [(-int(hrm[h, g, j]), -float(scores[h, g, j]), j) for j in lst]
            assert keys == sorted(keys), "HRM first, then by score, then by block id"


def test_top_p_prefix_matches_definition():
    p = problem(seqlens_q=(777,), seqlens_k=(777 + 384,), structure="band", seed=7)
    scores, hrm = R.kap_scores(p["q"], p["k_cache"], p["page_table"], p["cu_seqlens_q"], p["seqused_k"],
                               p["max_seqlen_q"], p["max_seqlen_k"])
    top_p = 0.7
    order, counts = run_kap(p, top_p=top_p)
    for g, prefix, i in query_blocks(p):
        diagonal = prefix // 128 + i
        for h in range(order.shape[0]):
            cand = sorted(range(diagonal + 1), key=lambda j: (-int(hrm[h, g, j]), -float(scores[h, g, j]), j))
            total = sum(float(scores[h, g, j]) for j in cand)
            kept, acc = [], 0.0
            for j in cand:
                if acc < top_p * total:
                    kept.append(j)
                acc += float(scores[h, g, j])
            expect = [j for j in cand if j in kept or hrm[h, g, j] or j in (0, diagonal)]
            assert order[h, g, :counts[h, g]].tolist() == expect


def test_stage1_budget_grows_with_top_p():
    p = problem(seqlens_q=(1024,), seqlens_k=(2048,), structure="mixed", seed=8)
    totals = [int(run_kap(p, top_p=t)[1].sum()) for t in (0.3, 0.6, 0.9, 0.99, 1.0)]
    assert totals == sorted(totals) and totals[0] < totals[-1]
    _, counts = dense_order(p)
    assert totals[-1] == int(counts.sum())


@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_paged_equals_contiguous(page_size):
    kw = dict(seqlens_q=(300, 77), seqlens_k=(556, 77), structure="mixed", seed=9, dtype=torch.float32)
    contiguous = problem(page_size=128, shuffle_pages=False, **kw)
    paged = problem(page_size=page_size, shuffle_pages=True, **kw)
    assert not torch.equal(paged["page_table"][:, :2], torch.arange(2, dtype=torch.int32).expand(2, 2))
    lists = run_kap(contiguous, top_p=0.9)
    for a, b in zip(lists, run_kap(paged, top_p=0.9)):
        assert torch.equal(a, b)
    for a, b in zip(run_osk(contiguous, *lists, delta=50.0), run_osk(paged, *lists, delta=50.0)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_gqa_maps_query_head_to_its_kv_head(ratio):
    hkv = 2
    grouped = problem(hq=hkv * ratio, hkv=hkv, structure="mixed", seed=10)
    expanded = dict(grouped)
    expanded["k_cache"] = grouped["k_cache"].repeat_interleave(ratio, dim=2)
    expanded["v_cache"] = grouped["v_cache"].repeat_interleave(ratio, dim=2)
    lists = run_kap(grouped, top_p=0.9)
    for a, b in zip(lists, run_kap(expanded, top_p=0.9)):
        assert torch.equal(a, b)
    for a, b in zip(run_osk(grouped, *lists, delta=100.0), run_osk(expanded, *lists, delta=100.0)):
        assert torch.allclose(a.double(), b.double(), atol=1e-12)


def test_varlen_batch_equals_sequences_alone():
    seqlens_q, seqlens_k = [131, 1, 255, 129], [131 + 128, 1, 255, 129 + 384]
    batch = problem(seqlens_q=seqlens_q, seqlens_k=seqlens_k, structure="mixed", seed=11, dtype=torch.float32)
    order, counts = run_kap(batch, top_p=0.9)
    out, lse, skipped = run_osk(batch, order, counts, delta=100.0)
    cu = batch["cu_seqlens_q"].tolist()
    g0 = 0
    for b, (lq, lk) in enumerate(zip(seqlens_q, seqlens_k)):
        nq = R.cdiv(lq, 128)
        one = dict(q=batch["q"][cu[b]:cu[b + 1]], k_cache=batch["k_cache"], v_cache=batch["v_cache"],
                   page_table=batch["page_table"][b:b + 1], cu_seqlens_q=torch.tensor([0, lq], dtype=torch.int32),
                   seqused_k=torch.tensor([lk], dtype=torch.int32), max_seqlen_q=lq, max_seqlen_k=lk)
        o1, c1 = run_kap(one, top_p=0.9)
        assert torch.equal(c1, counts[:, g0:g0 + nq])
        assert torch.equal(o1, order[:, g0:g0 + nq, :o1.shape[2]])
        out1, lse1, sk1 = run_osk(one, o1, c1, delta=100.0)
        assert torch.equal(out1, out[cu[b]:cu[b + 1]])
        assert torch.equal(lse1, lse[:, cu[b]:cu[b + 1]])
        assert torch.equal(sk1, skipped[:, g0:g0 + nq])
        g0 += nq


def test_padding_rows_are_empty():
    p = problem(seqlens_q=(200, 100), seqlens_k=(200, 228), seed=12)
    assert R.num_q_blocks_bound(300, 2, 200) == 4  # 3 real query blocks + 1 padding row
    order, counts = run_kap(p)
    assert counts.shape[1] == 4 and int(counts[:, 3].abs().sum()) == 0 and bool(order[:, 3].eq(-1).all())
    _, _, skipped = run_osk(p, order, counts)
    assert int(skipped[:, 3].abs().sum()) == 0


@pytest.mark.parametrize("stride", [1, 4, 16, 128])
def test_every_stride_keeps_dense_semantics_at_top_p_one(stride):
    p = problem(seed=13)
    order, counts = run_kap(p, top_p=1.0, stride=stride)
    assert torch.equal(counts, dense_order(p)[1])


def test_kap_finds_needles():
    p = random_problem([2048], [2048], 4, 1, 128, dtype=torch.float32, structure="needles", seed=14)
    order, counts = run_kap(p, top_p=0.9)
    dense = dense_order(p)[1]
    assert int(counts.sum()) < 0.6 * int(dense.sum()), "needles alone should need few blocks"
    out, _, _ = run_osk(p, order, counts, delta=0.0)
    assert rel_err(out, run_dense(p)[0]) < 0.05


def _e4m3_grid():
    """Every finite non-negative float8 e4m3 value."""
    return torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def test_e4m3_block_values_keep_values_on_the_scaled_grid():
    # A block whose amax is 448 * 2^k holds scale 2^k exactly: values on that scaled grid come back.
    grid = _e4m3_grid()
    x = torch.zeros(256, 2, 128)
    x[:128, 0] = grid[torch.randint(0, grid.numel(), (128, 128), generator=torch.Generator().manual_seed(0))] * 0.25
    x[0, 0, 0] = 448.0 * 0.25
    x[128:, 1] = -grid[torch.randint(0, grid.numel(), (128, 128), generator=torch.Generator().manual_seed(1))] * 8.0
    x[129, 1, 3] = -448.0 * 8.0
    assert torch.equal(R.e4m3_block_values(x.to(torch.bfloat16)), x)


def test_e4m3_blocks_and_heads_are_scaled_independently():
    x = torch.randn(300, 3, 64, generator=torch.Generator().manual_seed(2))
    big = x.clone()
    big[128:256, 1] *= 1000.0  # one (block, head) only
    a, b = R.e4m3_block_values(x), R.e4m3_block_values(big)
    same = torch.ones(300, 3, dtype=torch.bool)
    same[128:256, 1] = False
    assert torch.equal(a[same], b[same])
    assert torch.allclose(b[128:256, 1], 1000.0 * a[128:256, 1], rtol=1e-6)
    # Relative error of one e4m3 rounding (3 mantissa bits) against the block's amax.
    err = (a - x).abs().amax() / x.abs().amax()
    assert 0 < err <= 2.0 ** -4


def test_e4m3_block_values_nan_and_zero_blocks():
    x = torch.randn(256, 2, 64, generator=torch.Generator().manual_seed(3))
    x[130, 0, 7] = math.nan
    x[:128, 1] = 0.0
    v = R.e4m3_block_values(x)
    assert v[128:, 0].isnan().all() and not v[:128].isnan().any() and not v[128:, 1].isnan().any()
    assert (v[:128, 1] == 0).all()


@pytest.mark.parametrize("stride", [8, 16])
def test_fp8_proxy_keeps_the_kept_sets_of_clear_structure(stride):
    # Near-tied scores may swap places within a list; the blocks kept stay the same.
    p = random_problem([1024, 300], [1024 + 256, 300], 4, 2, 64, dtype=torch.float32, structure="needles",
                       seed=stride)
    native_order, native_counts = run_kap(p, stride=stride)
    fp8_order, fp8_counts = run_kap(p, stride=stride, proxy_precision="fp8")
    assert torch.equal(native_counts, fp8_counts)
    assert torch.equal(native_order.sort(-1).values, fp8_order.sort(-1).values)


@pytest.mark.parametrize("longest_keys,chosen", [(defaults.FP8_PROXY_MIN_KEYS - 128, "native"),
                                                (defaults.FP8_PROXY_MIN_KEYS, "fp8")])
def test_auto_proxy_is_fp8_from_the_threshold_on(longest_keys, chosen):
    """proxy_precision "auto" (the default) scores with the fp8 proxy exactly where the longest key
    sequence has FP8_PROXY_MIN_KEYS tokens or more, whatever the other sequences' lengths."""
    p = random_problem([128, 64], [longest_keys, 64], 1, 1, 64, page_size=128, dtype=torch.float32, seed=5)
    args = kap_layout_args(p)
    auto, _ = R.kap_scores(*args, proxy_precision="auto")
    assert torch.equal(auto, R.kap_scores(*args, proxy_precision=chosen)[0])
    assert not torch.equal(auto, R.kap_scores(*args, proxy_precision={"native": "fp8", "fp8": "native"}[chosen])[0])


def test_key_centres_are_the_midpoints_of_the_finite_sampled_keys():
    stride = defaults.KEY_CENTRE_STRIDE
    k = torch.full((2 * stride + 1, 1, 4), 1000.0)  # [Lk, Hkv 1, d 4]; keys off the sample: ignored
    k[0::stride, 0] = torch.tensor([[1.0, -2.0, math.nan, math.inf],
                                    [3.0, 6.0, math.nan, -7.0],
                                    [-5.0, 0.5, math.nan, 9.0]])
    centres = R.key_centres(k)
    assert centres.shape == (1, 1, 4)
    # -inf and NaN are passed over; a channel with no finite value is centred on 0.
    assert torch.equal(centres, torch.tensor([[[-1.0, 2.0, 0.0, 1.0]]]))


def test_fp8_lists_do_not_move_with_a_key_offset_per_channel():
    """The fp8 proxy quantises each sequence's keys around their channel midpoints (spec section 2):
    an offset shared by every key of a channel, which moves all proxy logits of a query row alike,
    leaves its lists exactly as they were. Uncentred, the offset would set every block's amax."""
    p = random_problem([700, 300], [700 + 256, 300], 4, 2, 64, dtype=torch.float32, structure="needles", seed=7)
    # Values on a grid of 1/64, so that adding the offset and centring are exact in float32.
    p["q"] = (p["q"] * 64).round() / 64
    p["k_cache"] = (p["k_cache"] * 64).round() / 64
    offset = torch.zeros(2, 64)
    offset[0, ::3] = 64.0
    offset[1, 1::4] = -96.0
    shifted = {**p, "k_cache": p["k_cache"] + offset}
    order, counts = run_kap(p, stride=8, proxy_precision="fp8")
    shifted_order, shifted_counts = run_kap(shifted, stride=8, proxy_precision="fp8")
    assert torch.equal(counts, shifted_counts)
    assert torch.equal(order, shifted_order)


def test_the_row_check_catches_one_wrong_row():
    """One zeroed (token, head) row hides in a whole-tensor norm; the per-row check names it."""
    p = problem(structure="mixed", seed=5)
    out, _ = run_dense(p)
    wrong = out.clone()
    wrong[123, 1] = 0.0
    assert rel_err(wrong, out) < 0.1
    with pytest.raises(AssertionError, match=r"1 of \d+ rows differ; worst row \(123, 1\)"):
        assert_rows_close(wrong, out, atol=1e-6)


# Any prefix (spec section 1): the reference places query blocks at each sequence's first query
# whatever the prefix (the CUDA kernels against it: tests/test_kap_cuda.py, test_osk_cuda.py).
UNALIGNED = dict(seqlens_q=(300, 77, 129, 20), seqlens_k=(300 + 100, 77 + 1, 129 + 255, 20 + 100))
UNALIGNED_LQ = [lq for lq in UNALIGNED["seqlens_q"] for _ in range(R.cdiv(lq, R.BLOCK))]  # Lq of each query block


def test_diagonal_blocks_for_any_prefix():
    first, last = R.diagonal_blocks(256, 300)
    assert first.tolist() == last.tolist() == [2, 3, 4]  # aligned: one diagonal block, P/128 + i
    first, last = R.diagonal_blocks(100, 300)  # positions 100-227, 228-355, 356-399
    assert first.tolist() == [0, 1, 2] and last.tolist() == [1, 2, 3]
    first, last = R.diagonal_blocks(100, 20)  # positions 100-119: within key block 0
    assert first.tolist() == last.tolist() == [0]
    assert [t.tolist() for t in R.diagonal_blocks(5, 0)] == [[], []]


def test_any_prefix_at_top_p_one_equals_dense():
    p = problem(**UNALIGNED, structure="mixed", seed=21)
    order, counts = run_kap(p, top_p=1.0)
    full_order, full_counts = dense_order(p)
    assert torch.equal(counts, full_counts), "top_p = 1 must keep every causal candidate"
    assert torch.equal(order.sort(-1).values, full_order.sort(-1).values)
    for g, prefix, i in query_blocks(p):  # every candidate up to the block of its last query's position
        assert int(full_counts[0, g]) == int(R.diagonal_blocks(prefix, UNALIGNED_LQ[g])[1][i]) + 1
    out, lse, skipped = run_osk(p, order, counts, delta=0.0)
    ref_out, ref_lse = run_dense(p)
    assert_rows_close(out, ref_out, atol=1e-12)
    assert torch.allclose(lse, ref_lse, atol=1e-5)
    assert R.budgets(counts, skipped, p["cu_seqlens_q"], p["seqused_k"]) == (1.0, 1.0)


def test_any_prefix_lists_keep_the_sink_and_both_diagonal_blocks():
    p = problem(**UNALIGNED, structure="mixed", seed=22)
    order, counts = run_kap(p, top_p=0.3)
    for g, prefix, i in query_blocks(p):
        first, last = (int(t[i]) for t in R.diagonal_blocks(prefix, UNALIGNED_LQ[g]))
        for h in range(order.shape[0]):
            listed = order[h, g, : int(counts[h, g])].tolist()
            assert {0, first, last} <= set(listed) and max(listed) == last, (h, g, listed)
    # With the skip on, the lists still give attention close to dense on clear structure.
    out, _, _ = run_osk(p, order, counts, delta=100.0)
    assert rel_err(out, run_dense(p)[0]) < 0.1  # 0.055 here
