"""bench/proxies.py: the oracle and the peers' proxies against brute-force definitions, the mask
helpers, the metrics, and the structured generator of bench/fidelity.py (CPU, small sizes)."""

import math
import sys
from pathlib import Path

import pytest
import torch

from cosa import reference as R
from cosa.layout import kap_layout_args, paged_from_contiguous
from cosa.testing import random_problem

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import proxies as P  # noqa: E402


def qkv(lq=600, lk=856, hq=4, hkv=2, d=64, seed=0, structure="mixed"):
    """One sequence with a 256-token prefix (Lk - Lq a multiple of 128) and a partial last block."""
    p = random_problem([lq], [lk], hq, hkv, d, page_size=64, dtype=torch.bfloat16, structure=structure, seed=seed)
    return P.contiguous(p)


def brute_probs(q, k, stride=1, scale=None):
    """Dense causal softmax [Hq, Lq/stride, Lk/stride] of the (antidiagonally downsampled) logits."""
    lq, hq, d = q.shape
    lk = k.shape[0]
    prefix = lk - lq
    scale = (1 / math.sqrt(d) if scale is None else scale) / stride
    qs, ks = P._strided(q, k, stride)
    z = scale * qs @ ks.transpose(1, 2)
    rows = torch.arange(qs.shape[1])[:, None]
    cols = torch.arange(ks.shape[1])[None, :]
    return torch.softmax(z.masked_fill(cols > rows + prefix // stride, -math.inf), -1)


def finite_row_sums(x):
    return torch.where(torch.isfinite(x), x, 0.0).sum(-1)


def test_oracle_mass_is_block_pooled_softmax():
    q, k, _ = qkv()
    mass = P.oracle_mass(q, k)
    lq, lk = q.shape[0], k.shape[0]
    probs = brute_probs(q, k)  # [Hq, Lq, Lk]
    nq, nk = R.cdiv(lq, 128), R.cdiv(lk, 128)
    padded = torch.zeros((q.shape[1], nq * 128, nk * 128))
    padded[:, :lq, :lk] = probs
    rows = torch.tensor([min(128, lq - 128 * i) for i in range(nq)], dtype=torch.float32)
    expect = padded.reshape(-1, nq, 128, nk, 128).sum((2, 4)) / rows[None, :, None]
    cand = P.candidate_mask(nq, nk, lk - lq)
    assert torch.equal(torch.isfinite(mass), cand.expand_as(mass))
    torch.testing.assert_close(mass[:, cand], expect[:, cand], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(finite_row_sums(mass), torch.ones(mass.shape[:2]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("stride", [8, 16])
def test_xattention_scores_are_sum_pooled_antidiagonal_softmax(stride):
    q, k, _ = qkv()
    scores = P.xattention_scores(q, k, stride)
    probs = brute_probs(q, k, stride)  # [Hq, nr, nc]
    per = 128 // stride
    nq, nk = scores.shape[1:]
    padded = torch.zeros((q.shape[1], nq * per, nk * per))
    padded[:, :probs.shape[1], :probs.shape[2]] = probs
    live = torch.tensor([min(per, probs.shape[1] - per * i) for i in range(nq)], dtype=torch.float32)
    expect = padded.reshape(-1, nq, per, nk, per).sum((2, 4)) / live[None, :, None]
    cand = torch.isfinite(scores)
    torch.testing.assert_close(scores[cand], expect[cand], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(finite_row_sums(scores), torch.ones(scores.shape[:2]), atol=1e-5, rtol=0)


def test_mean_pooling_scores_match_their_definition():
    q, k, _ = qkv()
    scores = P.mean_pooling_scores(q, k)
    lq, lk = q.shape[0], k.shape[0]
    qm = torch.stack([q[i:i + 128].float().mean(0) for i in range(0, lq, 128)], 1)  # [Hq, nq, d]
    km = torch.stack([k[j:j + 128].float().mean(0) for j in range(0, lk, 128)], 1).repeat_interleave(2, 0)
    z = qm @ km.transpose(1, 2) / math.sqrt(q.shape[-1])
    cand = P.candidate_mask(qm.shape[1], km.shape[1], lk - lq)
    expect = torch.softmax(z.masked_fill(~cand, -math.inf), -1)
    torch.testing.assert_close(scores[:, cand], expect[:, cand], atol=1e-5, rtol=1e-4)


def test_masks_hold_candidates_and_forced_blocks():
    q, k, _ = qkv()
    prefix = k.shape[0] - q.shape[0]
    mass = P.oracle_mass(q, k)
    nq, nk = mass.shape[1:]
    cand, forced = P.candidate_mask(nq, nk, prefix), P.forced_mask(nq, nk, prefix)
    masks = {"oracle": P.cumulative_mask(mass, 0.9), "kap": P.kap_mask(q, k, 8, 0.9),
             "flexprefill": P.flexprefill(q, k)[1]}
    for name in P.PEERS:
        masks[f"{name}-natural"] = P.peer_selection(name, q, k)[1]
        masks[f"{name}-budget"] = P.budget_mask(P.peer_selection(name, q, k)[0], 0.3, prefix)
    for name, mask in masks.items():
        assert mask.shape == mass.shape, name
        assert not (mask & ~cand).any(), name
        assert (mask | ~forced).all(), name
    assert torch.equal(P.cumulative_mask(mass, 1.0), cand.expand_as(mass))


def test_budget_mask_counts_and_ranking():
    q, k, _ = qkv()
    prefix = k.shape[0] - q.shape[0]
    mass = P.oracle_mass(q, k)
    nq, nk = mass.shape[1:]
    for budget in (0.1, 0.5, 1.0):
        mask = P.budget_mask(mass, budget, prefix)
        want = P.budget_counts(nq, nk, prefix, budget)
        assert torch.equal(mask.sum(-1), want.expand(mask.shape[:2]))
    # The kept non-forced blocks outrank every dropped candidate.
    mask = P.budget_mask(mass, 0.4, prefix)
    free = P.candidate_mask(nq, nk, prefix) & ~P.forced_mask(nq, nk, prefix)
    kept = torch.where(mask & free, mass, math.inf).amin(-1)
    dropped = torch.where(~mask & free, mass, -math.inf).amax(-1)
    assert (kept >= dropped).all()


def test_kap_rank_puts_hrm_first_and_matches_kap_lists():
    q, k, _ = qkv()
    scores, hrm = P.kap_scores(q, k)
    rank = P.kap_rank(scores, hrm)
    lowest_hrm = torch.where(hrm, rank, math.inf).amin(-1)
    highest_other = torch.where(~hrm & torch.isfinite(rank), rank, -math.inf).amax(-1)
    assert (lowest_hrm >= highest_other).all()
    order, counts = R.kap(*kap_layout_args(paged_from_contiguous(q, k)), stride=8, top_p=0.9)
    assert torch.equal(P.kap_mask(q, k, 8, 0.9), P.lists_to_mask(order, counts))


def test_lists_round_trip_and_osk_on_every_block_is_dense():
    q, k, v = qkv()
    prefix = k.shape[0] - q.shape[0]
    nq, nk = R.cdiv(q.shape[0], 128), R.cdiv(k.shape[0], 128)
    mask = P.candidate_mask(nq, nk, prefix).expand(q.shape[1], nq, nk).clone()
    mask[0, -1, 1] = False
    order, counts = P.mask_to_lists(mask)
    assert torch.equal(P.lists_to_mask(order, counts), mask)
    assert (order[..., :-1] <= order[..., 1:]).logical_or(order[..., 1:] == -1).all()  # ascending
    layout = paged_from_contiguous(q, k, v)
    full_order, full_counts = P.mask_to_lists(P.candidate_mask(nq, nk, prefix).expand(q.shape[1], nq, nk))
    args = [layout[x] for x in ("q", "k_cache", "v_cache", "page_table", "cu_seqlens_q", "seqused_k")]
    out, _, _ = R.osk(*args, full_order, full_counts, layout["max_seqlen_q"], delta=0.0)
    dense, _ = R.dense_attention(*args)
    torch.testing.assert_close(out.float(), dense.float(), atol=2e-2, rtol=2e-2)


def test_metrics():
    a = torch.zeros((1, 2, 4), dtype=torch.bool)
    a[..., :2] = True
    b = torch.zeros_like(a)
    b[..., 1:3] = True
    assert P.mask_metrics(a, a) == {"recall": 1.0, "iou": 1.0, "budget": None}
    m = P.mask_metrics(a, b)
    assert m["recall"] == pytest.approx(0.5) and m["iou"] == pytest.approx(1 / 3)
    mass = torch.tensor([[[0.5, 0.3, 0.2, -math.inf], [0.1, 0.2, 0.3, 0.4]]])
    m = P.mask_metrics(a, b, mass)
    assert m["mass"] == pytest.approx((0.8 + 0.3) / 2) and m["budget"] == pytest.approx(4 / 7)


def test_needle_blocks_are_found():
    """A planted needle's key block is in the oracle's, KAP's and XAttention's masks of every query
    block after it (the blocks every proxy must keep)."""
    q, k, _ = qkv(lq=1024, lk=1024, structure="needles", seed=3)
    mass = P.oracle_mass(q, k)
    truth = P.cumulative_mask(mass, 0.95)
    for mask in (P.kap_mask(q, k, 8, 0.95), P.peer_selection("xattention", q, k)[1]):
        assert P.mask_metrics(mask, truth, mass)["mass"] > 0.8


def test_flexprefill_vertical_slash_finds_a_column_the_last_queries_read():
    torch.manual_seed(0)
    n, d = 1024, 64
    q = torch.randn(n, 2, d) * 0.1
    k = torch.randn(n, 1, d) * 0.1
    k[300, 0] = 8.0 * torch.nn.functional.normalize(torch.ones(d), dim=0)
    q[:, :, :] += 8.0 * torch.nn.functional.normalize(torch.ones(d), dim=0)  # every query reads token 300
    q[:128] -= 8.0 * torch.nn.functional.normalize(torch.ones(d), dim=0)
    scores, mask, query_aware = P.flexprefill(q.bfloat16(), k.bfloat16(), gamma=0.9)
    assert query_aware.shape == (2,)
    assert mask[:, 3:, 2].all()  # key block 2 holds token 300: kept for every later query block
    assert torch.isfinite(scores).sum() == 2 * sum(i + 1 for i in range(8))


def test_structured_problem_plants_stripes_and_slashes():
    p = P.structured_problem(2048, 4, 2, 64, seed=1)
    q, k, v = P.contiguous(p)
    assert q.shape == (2048, 4, 64) and k.shape == v.shape == (2048, 2, 64)
    assert len(p["stripes"]) == 2 and all(len(s) == P.STRIPES_PER_HEAD for s in p["stripes"])
    # The last query's logit at each stripe stands far above its typical logit.
    qf, kf = q.float(), k.float()
    for g, stripes in enumerate(p["stripes"]):
        logits = qf[-1, 2 * g] @ kf[:, g].T / 8.0
        assert all(float(logits[t] - logits.median()) > 5.0 for t in stripes if t < 2047)
    # Slash ridge: query t's logit at key t - 1000 beats its median logit.
    t = torch.arange(1500, 2048)
    ridge = (qf[t, 0] * kf[t - 1000, 0]).sum(-1)
    typical = (qf[t, 0] @ kf[:, 0].T).median(-1).values
    assert (ridge > typical).float().mean() > 0.75
