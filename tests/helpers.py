"""Shared helpers of the tests."""

import torch

from cosa import reference as R


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def layout_args(p):
    """Positional layout arguments of the KAP op/reference from a random_problem dict."""
    return (p["q"], p["k_cache"], p["page_table"], p["cu_seqlens_q"], p["seqused_k"], p["max_seqlen_q"], p["max_seqlen_k"])


def run_kap(p, **kw):
    return R.kap(*layout_args(p), **kw)


def run_osk(p, order, counts, **kw):
    return R.osk(p["q"], p["k_cache"], p["v_cache"], p["page_table"], p["cu_seqlens_q"], p["seqused_k"],
                 order, counts, p["max_seqlen_q"], **kw)


def run_dense(p, **kw):
    return R.dense_attention(p["q"], p["k_cache"], p["v_cache"], p["page_table"], p["cu_seqlens_q"], p["seqused_k"], **kw)


def dense_order(p):
    return R.causal_order(p["cu_seqlens_q"], p["seqused_k"], p["q"].shape[1], p["max_seqlen_q"],
                          p["max_seqlen_k"], p["q"].shape[0])


def query_blocks(p):
    """(g, prefix, i) for every real query block of the packed numbering."""
    cu, lk = p["cu_seqlens_q"].tolist(), p["seqused_k"].tolist()
    g = 0
    for b in range(len(lk)):
        lq = cu[b + 1] - cu[b]
        for i in range(R.cdiv(lq, R.BLOCK)):
            yield g, lk[b] - lq, i
            g += 1


def permute_lists(order, counts, generator):
    """Randomly permute every list's first counts entries."""
    order = order.clone()
    for h in range(order.shape[0]):
        for g in range(order.shape[1]):
            n = int(counts[h, g])
            order[h, g, :n] = order[h, g, :n][torch.randperm(n, generator=generator)]
    return order
