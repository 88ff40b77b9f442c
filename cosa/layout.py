"""One contiguous sequence in the paged layout of the ops (docs/spec.md section 1)."""

from __future__ import annotations

import torch

from .reference import BLOCK, cdiv


# The layout arguments of cosa.kap (and cosa.reference.kap / kap_scores), in their positional order.
KAP_LAYOUT_ARGUMENTS = ("q", "k_cache", "page_table", "cu_seqlens_q", "seqused_k", "max_seqlen_q", "max_seqlen_k")


def kap_layout_args(layout: dict) -> tuple:
    """The positional layout arguments of cosa.kap from a dict of the ops' keyword arguments (what
    :func:`paged_from_contiguous` and ``cosa.testing.random_problem`` return)."""
    return tuple(layout[name] for name in KAP_LAYOUT_ARGUMENTS)


def paged_from_contiguous(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> dict:
    """``q [Lq, Hq, d]``, ``k, v [Lk, Hkv, d]`` (the queries are the last ``Lq`` positions) as the
    keyword arguments of ``cosa.prefill`` and ``cosa.reference``: one page per 128 tokens, pages in
    order, the last one zero-padded. ``v_cache`` is left out when ``v`` is None."""
    lq, lk = q.shape[0], k.shape[0]
    pages = cdiv(lk, BLOCK)
    device = q.device

    def paged(x):  # a view of x when Lk is a multiple of 128
        if lk % BLOCK:
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pages * BLOCK - lk))
        return x.reshape(pages, BLOCK, *x.shape[1:])

    layout = dict(q=q, k_cache=paged(k), page_table=torch.arange(pages, dtype=torch.int32, device=device)[None],
                  cu_seqlens_q=torch.tensor([0, lq], dtype=torch.int32, device=device),
                  seqused_k=torch.tensor([lk], dtype=torch.int32, device=device),
                  max_seqlen_q=lq, max_seqlen_k=lk)
    if v is not None:
        layout["v_cache"] = paged(v)
    return layout
