"""Shared helpers of the tests."""

import math

import pytest
import torch

from cosa import reference as R
from cosa.layout import kap_layout_args


def require_transformers():
    """Skips the calling test where transformers (and tokenizers, which it uses) are not installed:
    they are optional, and `pip install --no-build-isolation ".[test]"` or scripts/setup.sh installs them."""
    pytest.importorskip("tokenizers", reason="needs tokenizers (the `test` extra)")
    pytest.importorskip("transformers", reason="needs transformers (the `test` extra)")


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def run_kap(p, **kw):
    return R.kap(*kap_layout_args(p), **kw)


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


def diagonal_blocks(p):
    """(g, first, last) for every real query block of the packed numbering: its diagonal blocks
    (cosa.reference.diagonal_blocks); its causal candidates are blocks 0 .. last."""
    cu, lk = p["cu_seqlens_q"].tolist(), p["seqused_k"].tolist()
    g = 0
    for b in range(len(lk)):
        lq = cu[b + 1] - cu[b]
        for first, last in zip(*(t.tolist() for t in R.diagonal_blocks(lk[b] - lq, lq))):
            yield g, first, last
            g += 1


def permute_lists(order, counts, generator):
    """Randomly permute every list's first counts entries."""
    order = order.clone()
    for h in range(order.shape[0]):
        for g in range(order.shape[1]):
            n = int(counts[h, g])
            order[h, g, :n] = order[h, g, :n][torch.randperm(n, generator=generator)]
    return order


def row_errors(got, expect):
    """The largest absolute error of every row (all dims but the last), ``got`` against ``expect``.
    NaN counts as a value: a row whose NaN entries are where ``expect`` has them scores 0 on those
    entries, a row that has a NaN where ``expect`` has none (or lacks one it has) scores inf."""
    got, expect = got.double(), expect.double()
    nan_got, nan_expect = got.isnan(), expect.isnan()
    diff = (got - expect).abs().masked_fill(nan_got & nan_expect, 0.0).masked_fill(nan_got != nan_expect, math.inf)
    return diff.amax(-1)


def assert_rows_close(got, expect, atol, rtol=0.0, what="output"):
    """Every row of ``got`` within ``atol + rtol * (that row's largest |expect|)`` of ``expect``
    (NaN where and only where ``expect`` has NaN); the message names the worst row."""
    assert got.shape == expect.shape, f"{what}: shape {tuple(got.shape)} != {tuple(expect.shape)}"
    errors = row_errors(got, expect)
    scale = expect.double().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).abs().amax(-1)
    excess = errors - (atol + rtol * scale)
    if bool((excess > 0).any()):
        worst = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
        raise AssertionError(f"{what}: {int((excess > 0).sum())} of {excess.numel()} rows differ; worst row {worst}: "
                             f"error {float(errors[worst]):.3e}, got {got[worst][:4].tolist()}..., "
                             f"expected {expect[worst][:4].tolist()}...")
