"""The head shapes one GPU sees under tensor parallelism, on the GPU against the reference: vLLM
gives each rank Hq / TP query heads and max(1, Hkv / TP) KV heads (a KV head replicated where TP
exceeds them). Qwen2.5-Coder-1.5B's 12 / 2 heads at TP 1, 2, 4 (12/2, 6/1, 3/1: query heads per KV
head that are not powers of two) and a 32 / 8 model at TP 2, 4, 8 (16/4, 8/2, 4/1). For each: KAP's
lists identical to the reference's on inputs with clear margins, OSK on those lists with the skip on
(both votes) row by row against the reference, and the whole prefill at full budget against dense
attention, every row checked."""

import pytest
import torch

from helpers import assert_rows_close, run_dense, run_kap
from test_kap_cuda import assert_identical
from test_osk_cuda import assert_matches_reference, osk, problem

pytestmark = pytest.mark.gpu

# (query heads, KV heads) per rank, named by the model and TP size they come from.
RANK_SHAPES = {
    "12/2-tp1": (12, 2), "12/2-tp2": (6, 1), "12/2-tp4": (3, 1),
    "32/8-tp2": (16, 4), "32/8-tp4": (8, 2), "32/8-tp8": (4, 1),
}
# A varlen batch with odd lengths and a prefix, as a chunked prefill sends it.
SEQLENS_Q, SEQLENS_K = [900, 257], [900 + 384, 257]


@pytest.mark.parametrize("heads", RANK_SHAPES.values(), ids=RANK_SHAPES.keys())
def test_kap_lists_on_a_ranks_heads(ops, heads):
    hq, hkv = heads
    p = problem(SEQLENS_Q, SEQLENS_K, hq, hkv, structure="mixed", seed=11)
    assert_identical(ops, p, stride=8)


@pytest.mark.parametrize("vote", ("warpgroup", "tile"))
@pytest.mark.parametrize("heads", RANK_SHAPES.values(), ids=RANK_SHAPES.keys())
def test_osk_on_kap_lists_on_a_ranks_heads(ops, heads, vote):
    hq, hkv = heads
    p = problem(SEQLENS_Q, SEQLENS_K, hq, hkv, structure="mixed", seed=12)
    order, counts = run_kap(p)
    got = osk(ops, p, order, counts, 100.0, vote)
    assert_matches_reference(p, got, order, counts, 100.0, vote=vote)


@pytest.mark.parametrize("heads", RANK_SHAPES.values(), ids=RANK_SHAPES.keys())
def test_prefill_at_full_budget_on_a_ranks_heads(ops, heads):
    hq, hkv = heads
    p = problem(SEQLENS_Q, SEQLENS_K, hq, hkv, seed=13)
    poison = torch.full((64 << 20,), float("nan"), device="cuda")  # so that an unwritten row cannot pass
    del poison
    out = ops.prefill(p["q"], p["k_cache"], p["v_cache"], p["page_table"], p["cu_seqlens_q"], p["seqused_k"],
                      p["max_seqlen_q"], p["max_seqlen_k"], 8, 1.0, None, 0.0)[0]
    torch.cuda.synchronize()
    expect = run_dense(p)[0]
    assert_rows_close(out.float(), expect.float().to(out.device), atol=2e-2)
