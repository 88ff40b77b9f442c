"""cosa.layout: one contiguous sequence as the paged arguments of the ops."""

import pytest
import torch

from cosa import reference as R
from cosa.layout import paged_from_contiguous


@pytest.mark.parametrize("lk", [640, 856])  # whole pages and a zero-padded last page
def test_paged_from_contiguous_holds_the_sequence(lk):
    q, k, v = torch.randn(lk - 256, 4, 64), torch.randn(lk, 2, 64), torch.randn(lk, 2, 64)
    layout = paged_from_contiguous(q, k, v)
    assert layout["k_cache"].shape == layout["v_cache"].shape == (R.cdiv(lk, 128), 128, 2, 64)
    assert torch.equal(R.gather_kv(layout["k_cache"], layout["page_table"], 0, lk), k)
    assert torch.equal(R.gather_kv(layout["v_cache"], layout["page_table"], 0, lk), v)
    assert not layout["k_cache"].reshape(-1, 2, 64)[lk:].any()
    assert layout["q"] is q
    assert layout["cu_seqlens_q"].tolist() == [0, lk - 256] and layout["seqused_k"].tolist() == [lk]
    assert (layout["max_seqlen_q"], layout["max_seqlen_k"]) == (lk - 256, lk)
    assert "v_cache" not in paged_from_contiguous(q, k)


def test_whole_pages_are_views_of_the_inputs():
    k = torch.randn(640, 2, 64)
    assert paged_from_contiguous(torch.randn(384, 4, 64), k)["k_cache"].data_ptr() == k.data_ptr()
