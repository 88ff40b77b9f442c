"""The Python API: thin wrappers over ``torch.ops.cosa`` with keyword tuning arguments, optional
``max_seqlen_*`` (computed from the lengths when omitted, which reads them on the host), and the
contiguous ``[B, S, H, d]`` convenience entry point."""

from __future__ import annotations

import contextlib
import os

import torch

from . import _C_AVAILABLE, reference
from .reference import BLOCK, cdiv


def _ops():
    if not _C_AVAILABLE:
        raise RuntimeError(
            "cosa's compiled extension (cosa._C) is not available: install the package with "
            "`TORCH_CUDA_ARCH_LIST=9.0 pip install --no-build-isolation .` (cosa.reference works without it)")
    return torch.ops.cosa


DEVICE_CHECKS_ENV = "COSA_DEVICE_CHECKS"


def device_checks_enabled() -> bool:
    """Whether the CUDA ops check the contents of their index tensors (see ``set_device_checks``)."""
    return os.environ.get(DEVICE_CHECKS_ENV) != "0"


@contextlib.contextmanager
def _restore_device_checks(previous: str | None):
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(DEVICE_CHECKS_ENV, None)
        else:
            os.environ[DEVICE_CHECKS_ENV] = previous


def set_device_checks(enabled: bool):
    """Turn the CUDA ops' checks of index-tensor contents on or off (on by default).

    With them on, every eager CUDA call checks ``cu_seqlens_q``, ``seqused_k``, ``page_table`` and
    (for ``osk``) ``order``/``counts`` against the layout contract with two small kernels and one
    host synchronisation, so that bad contents raise a clear error instead of reading out of bounds.
    Turn them off where those tensors are right by construction and the synchronisation matters
    (short prompts: about 20-30 us per call); contents that break the contract are then undefined
    behaviour. They are always off while a CUDA graph is being captured; shape, dtype and device
    checks always run. Sets ``COSA_DEVICE_CHECKS`` (``0`` = off) in this process's environment, which
    the extension reads on every call: the setting is process-wide, so set it at start-up (or in
    the environment) rather than flipping it while other threads run cosa ops. The returned context
    manager restores the previous setting::

        with cosa.set_device_checks(False):
            out, lse, skipped = cosa.prefill(...)
    """
    previous = os.environ.get(DEVICE_CHECKS_ENV)
    if enabled:
        os.environ.pop(DEVICE_CHECKS_ENV, None)
    else:
        os.environ[DEVICE_CHECKS_ENV] = "0"
    return _restore_device_checks(previous)


def _max_lengths(cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k):
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_seqlen_k is None:
        max_seqlen_k = int(seqused_k.max())
    return int(max_seqlen_q), int(max_seqlen_k)


def kap(q, k_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q=None, max_seqlen_k=None, *,
        stride=8, top_p=0.95, softmax_scale=None):
    """KAP (spec section 2): ordered block lists ``(order, counts)``."""
    max_seqlen_q, max_seqlen_k = _max_lengths(cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k)
    return _ops().kap(q, k_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
                      stride, top_p, softmax_scale)


def osk(q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, order, counts, max_seqlen_q=None, *,
        softmax_scale=None, delta=2000.0):
    """OSK (spec section 3): attention over the listed blocks in list order, with the in-kernel skip.
    Returns ``(out, lse, skipped)``."""
    max_seqlen_q, _ = _max_lengths(cu_seqlens_q, seqused_k, max_seqlen_q, 0)
    return _ops().osk(q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, order, counts, max_seqlen_q,
                      softmax_scale, delta)


def prefill(q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q=None, max_seqlen_k=None, *,
            stride=8, top_p=0.95, softmax_scale=None, delta=2000.0, return_stats=False):
    """CoSA sparse prefill over a paged KV cache: KAP then OSK, with no host synchronisation between them.

    Returns ``out [total_q, Hq, d]``, or ``(out, stats)`` with ``return_stats=True``: a dict holding
    ``lse``, ``order``, ``counts``, ``skipped`` and the budgets (which read the lengths on the host)."""
    max_seqlen_q, max_seqlen_k = _max_lengths(cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k)
    out, lse, order, counts, skipped = _ops().prefill(
        q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
        stride, top_p, softmax_scale, delta)
    if not return_stats:
        return out
    stage1, realised = reference.budgets(counts, skipped, cu_seqlens_q, seqused_k)
    return out, dict(lse=lse, order=order, counts=counts, skipped=skipped,
                     stage1_budget=stage1, realised_budget=realised)


def _as_paged(x, page_size):
    """``[B, S, H, d]`` -> cache ``[B * ceil(S/page), page, H, d]`` (a view when S is a multiple)."""
    batch, seqlen = x.shape[:2]
    padded = cdiv(seqlen, page_size) * page_size
    if padded != seqlen:
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, padded - seqlen))
    return x.reshape(batch * (padded // page_size), page_size, *x.shape[2:])


def sparse_attention(q, k, v, *, stride=8, top_p=0.95, softmax_scale=None, delta=2000.0, return_stats=False):
    """CoSA causal attention on contiguous ``q [B, Sq, Hq, d]``, ``k, v [B, Sk, Hkv, d]`` (``Sk >= Sq``,
    ``Sk - Sq`` a multiple of 128: the queries are the last ``Sq`` positions). A thin wrapper that
    views the inputs as one page per 128 tokens and calls :func:`prefill`. Returns ``[B, Sq, Hq, d]``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"cosa.sparse_attention: {name} must be a 4-D tensor [B, S, H, d]")
    if k.shape != v.shape:
        raise ValueError(f"cosa.sparse_attention: k shape {tuple(k.shape)} differs from v shape {tuple(v.shape)}")
    batch, seqlen_q = q.shape[:2]
    seqlen_k = k.shape[1]
    if k.shape[0] != batch:
        raise ValueError(f"cosa.sparse_attention: k has batch {k.shape[0]}, q has {batch}")
    if seqlen_q < 1 or seqlen_k < seqlen_q:
        raise ValueError(f"cosa.sparse_attention: need 1 <= Sq <= Sk, got Sq={seqlen_q}, Sk={seqlen_k}")
    if (seqlen_k - seqlen_q) % BLOCK:
        raise ValueError(f"cosa.sparse_attention: the cached prefix Sk - Sq = {seqlen_k - seqlen_q} must be a "
                         f"multiple of {BLOCK}")
    pages = cdiv(seqlen_k, BLOCK)
    device = q.device
    page_table = torch.arange(batch * pages, dtype=torch.int32, device=device).reshape(batch, pages)
    cu_seqlens_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=device)
    seqused_k = torch.full((batch,), seqlen_k, dtype=torch.int32, device=device)
    result = prefill(q.reshape(batch * seqlen_q, *q.shape[2:]), _as_paged(k, BLOCK), _as_paged(v, BLOCK),
                     page_table, cu_seqlens_q, seqused_k, seqlen_q, seqlen_k, stride=stride, top_p=top_p,
                     softmax_scale=softmax_scale, delta=delta, return_stats=return_stats)
    if return_stats:
        out, stats = result
        return out.reshape(q.shape), stats
    return result.reshape(q.shape)
