"""torch.ops.cosa.prefill on the GPU: KAP then OSK against the reference chain, the Python API,
and CUDA-graph capture (no host synchronisation inside the op)."""

import pytest
import torch

import cosa
from cosa import defaults
from cosa import reference as R
from cosa.testing import random_problem

from cosa.layout import kap_layout_args

from helpers import assert_rows_close, diagonal_blocks, rel_err, run_dense, run_osk

pytestmark = pytest.mark.gpu


def problem(**kw):
    args = dict(seqlens_q=[1000, 130], seqlens_k=[1000 + 512, 130], num_heads_q=8, num_heads_kv=2, head_dim=128,
                page_size=64, dtype=torch.bfloat16, device="cuda", structure="mixed", seed=0)
    args.update(kw)
    return random_problem(args.pop("seqlens_q"), args.pop("seqlens_k"), args.pop("num_heads_q"),
                          args.pop("num_heads_kv"), args.pop("head_dim"), **args)


def prefill(p, **kw):
    return torch.ops.cosa.prefill(p["q"], p["k_cache"], p["v_cache"], p["page_table"], p["cu_seqlens_q"],
                                  p["seqused_k"], p["max_seqlen_q"], p["max_seqlen_k"],
                                  kw.get("stride", defaults.STRIDE), kw.get("top_p", defaults.TOP_P), None,
                                  kw.get("delta", defaults.DELTA))


def test_prefill_matches_osk_reference_on_its_own_lists(ops):
    p = problem()
    out, lse, order, counts, skipped = prefill(p, delta=200.0)
    torch.cuda.synchronize()
    assert out.shape == p["q"].shape and not out.isnan().any()
    ref_out, ref_lse, _ = run_osk(p, order, counts, delta=200.0)
    assert rel_err(out, ref_out) < 1e-2
    assert int(counts.sum()) > 0
    stage1, realised = R.budgets(counts, skipped, p["cu_seqlens_q"], p["seqused_k"])
    assert 0 < realised <= stage1 <= 1


def test_prefill_at_full_budget_is_dense_attention(ops):
    p = problem(seed=1)
    out, lse, *_ = prefill(p, top_p=1.0, delta=0.0)
    ref_out, ref_lse = run_dense(p)
    assert rel_err(out, ref_out) < 1e-2
    assert torch.allclose(lse, ref_lse.to(lse.device), atol=1e-3)


def test_sparse_attention_contiguous_api(ops):
    q = torch.randn(1, 640, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 640, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 640, 2, 128, device="cuda", dtype=torch.bfloat16)
    out = cosa.sparse_attention(q, k, v, top_p=1.0, delta=0.0)
    expect = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True).transpose(1, 2)
    assert rel_err(out, expect) < 1e-2


# Any prefix (spec section 1): prefixes 100, 1, 255, 129 and 0 in one batch, odd query lengths.
UNALIGNED = dict(seqlens_q=[1001, 129, 77, 1, 300], seqlens_k=[1001 + 100, 129 + 1, 77 + 255, 1 + 129, 300])


def poisoned_prefill(p, **kw):
    """prefill with the caching allocator's free memory filled with NaN first, so that an output row
    the kernels never write cannot pass as a right answer."""
    poison = torch.full((64 << 20,), float("nan"), device="cuda")
    del poison
    result = prefill(p, **kw)
    torch.cuda.synchronize()
    return result


@pytest.mark.parametrize("page_size", [16, 128])
def test_prefill_for_any_prefix_matches_the_reference_chain(ops, page_size):
    """KAP's lists equal the reference's (clear margins: planted structure), and the output and LSE
    equal the reference OSK's on those lists row by row, with the skip on."""
    p = problem(**UNALIGNED, page_size=page_size, seed=page_size)
    out, lse, order, counts, skipped = poisoned_prefill(p, delta=200.0)
    ref_order, ref_counts = R.kap(*kap_layout_args(p), stride=defaults.STRIDE, top_p=defaults.TOP_P)
    assert torch.equal(counts, ref_counts.to(counts.device)) and torch.equal(order, ref_order.to(order.device))
    for g, first, last in diagonal_blocks(p):
        for h in range(order.shape[0]):
            listed = set(order[h, g, : int(counts[h, g])].tolist())
            assert {0, first, last} <= listed and max(listed) == last
    ref_out, ref_lse, ref_skipped = run_osk(p, order, counts, delta=200.0)
    assert_rows_close(out, ref_out, atol=2e-2)
    assert_rows_close(lse[..., None], ref_lse.to(lse.device)[..., None], atol=1e-3, what="lse")
    assert torch.equal(skipped, ref_skipped.to(skipped.device))
    stage1, realised = R.budgets(counts, skipped, p["cu_seqlens_q"], p["seqused_k"])
    assert 0 < realised <= stage1 <= 1


@pytest.mark.parametrize("page_size", [16, 128])
def test_prefill_for_any_prefix_at_full_budget_is_dense_attention(ops, page_size):
    p = problem(**UNALIGNED, page_size=page_size, structure=None, seed=page_size + 1)
    out, lse, order, counts, skipped = poisoned_prefill(p, top_p=1.0, delta=0.0)
    ref_out, ref_lse = run_dense(p)
    assert_rows_close(out, ref_out, atol=2e-2)
    assert_rows_close(lse[..., None], ref_lse.to(lse.device)[..., None], atol=1e-3, what="lse")
    assert R.budgets(counts, skipped, p["cu_seqlens_q"], p["seqused_k"]) == (1.0, 1.0)


def test_sparse_attention_for_any_prefix(ops):
    q = torch.randn(2, 333, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 333 + 100, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 333 + 100, 2, 128, device="cuda", dtype=torch.bfloat16)
    out = cosa.sparse_attention(q, k, v, top_p=1.0, delta=0.0)
    mask = torch.ones(333, 433, dtype=torch.bool, device="cuda").tril(100)  # query r sees keys up to r + 100
    expect = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True).transpose(1, 2)
    assert_rows_close(out.float(), expect.float(), atol=2e-2)


def test_prefill_is_capturable_in_a_cuda_graph(ops):
    p = problem(seed=2)
    eager = prefill(p)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        prefill(p)  # warm-up on the side stream, as graph capture requires
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = prefill(p)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured):
        assert torch.equal(a, b)
