"""Argument checks of the ops' Python (CPU) path; the CUDA path runs the same checks in C++
(csrc/torch_binding.cpp) with the same messages. Each error names the op and the argument:
TypeError for a wrong dtype, ValueError for everything else."""

from __future__ import annotations

import math

import torch

from .reference import BLOCK, cdiv, num_q_blocks_bound

INPUT_DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128)


def _fail(op, msg, exc=ValueError):
    raise exc(f"cosa.{op}: {msg}")


def _is_capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_layout(op, q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k):
    """Dtypes, devices and shapes of the paged layout (spec section 1); no device data is read."""
    tensors = dict(q=q, k_cache=k_cache, page_table=page_table, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k)
    if v_cache is not None:
        tensors["v_cache"] = v_cache
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            _fail(op, f"{name} must be a tensor, got {type(t).__name__}", TypeError)
        if t.device != q.device:
            _fail(op, f"{name} must be on {q.device} like q, got {t.device}")
    if q.dtype not in INPUT_DTYPES:
        _fail(op, f"q must be bfloat16 or float16, got {q.dtype}", TypeError)
    if q.dim() != 3:
        _fail(op, f"q must be 3-D [total_q, num_heads_q, head_dim], got shape {tuple(q.shape)}")
    total_q, hq, d = q.shape
    if d not in HEAD_DIMS:
        _fail(op, f"head dim must be 64 or 128, got {d} (q.shape[-1])")
    for name in ("k_cache", "v_cache"):
        cache = tensors.get(name)
        if cache is None:
            continue
        if cache.dtype != q.dtype:
            _fail(op, f"{name} must have q's dtype {q.dtype}, got {cache.dtype}", TypeError)
        if cache.dim() != 4:
            _fail(op, f"{name} must be 4-D [num_pages, page_size, num_heads_kv, head_dim], got shape {tuple(cache.shape)}")
        if cache.shape[3] != d:
            _fail(op, f"{name} head dim {cache.shape[3]} differs from q's {d}")
    if v_cache is not None and v_cache.shape != k_cache.shape:
        _fail(op, f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape {tuple(k_cache.shape)}")
    num_pages, page_size, hkv, _ = k_cache.shape
    if page_size < 16 or page_size > 256 or page_size & (page_size - 1):
        _fail(op, f"page size (k_cache.shape[1]) must be a power of two in [16, 256], got {page_size}")
    if hkv == 0 or hq % hkv:
        _fail(op, f"num_heads_q ({hq}) must be a multiple of num_heads_kv ({hkv})")
    for name, t, dims in (("page_table", page_table, 2), ("cu_seqlens_q", cu_seqlens_q, 1), ("seqused_k", seqused_k, 1)):
        if t.dtype != torch.int32:
            _fail(op, f"{name} must be int32, got {t.dtype}", TypeError)
        if t.dim() != dims:
            _fail(op, f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    batch = seqused_k.shape[0]
    if batch < 1:
        _fail(op, "seqused_k must hold at least one sequence")
    if cu_seqlens_q.shape[0] != batch + 1:
        _fail(op, f"cu_seqlens_q must have batch + 1 = {batch + 1} entries, got {cu_seqlens_q.shape[0]}")
    if page_table.shape[0] != batch:
        _fail(op, f"page_table must have batch = {batch} rows, got {page_table.shape[0]}")
    if not isinstance(max_seqlen_q, int) or max_seqlen_q < 1:
        _fail(op, f"max_seqlen_q must be a positive int, got {max_seqlen_q!r}")
    if max_seqlen_k is not None and (not isinstance(max_seqlen_k, int) or max_seqlen_k < max_seqlen_q):
        _fail(op, f"max_seqlen_k must be an int >= max_seqlen_q ({max_seqlen_q}), got {max_seqlen_k!r}")


def check_lengths(op, q, k_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k):
    """Checks that read the length and page tensors (one host synchronisation; skipped while a CUDA
    graph is being captured, where reading device data is not allowed)."""
    if _is_capturing(q.device):
        return
    cu = cu_seqlens_q.tolist()
    lk = seqused_k.tolist()
    if cu[0] != 0 or cu[-1] != q.shape[0]:
        _fail(op, f"cu_seqlens_q must start at 0 and end at total_q = {q.shape[0]}, got {cu[0]} .. {cu[-1]}")
    for b in range(len(cu) - 1):
        if cu[b + 1] < cu[b]:
            _fail(op, f"cu_seqlens_q must be non-decreasing, got {cu[b]} then {cu[b + 1]} at index {b}")
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    for b in range(len(lk)):
        lq = cu[b + 1] - cu[b]
        if lq > max_seqlen_q:
            _fail(op, f"sequence {b} has {lq} queries, more than max_seqlen_q = {max_seqlen_q}")
        if lk[b] < lq:
            _fail(op, f"seqused_k[{b}] = {lk[b]} is shorter than the sequence's {lq} queries")
        if max_seqlen_k is not None and lk[b] > max_seqlen_k:
            _fail(op, f"seqused_k[{b}] = {lk[b]} exceeds max_seqlen_k = {max_seqlen_k}")
        if (lk[b] - lq) % BLOCK:
            _fail(op, f"the cached prefix of sequence {b} (seqused_k - query length = {lk[b] - lq}) must be a multiple of {BLOCK}")
        if lk[b] > page_table.shape[1] * page_size:
            _fail(op, f"seqused_k[{b}] = {lk[b]} exceeds page_table's capacity of {page_table.shape[1] * page_size} tokens")
    used = torch.arange(page_table.shape[1], device=page_table.device)[None, :] < (
        (seqused_k.long() + page_size - 1) // page_size)[:, None]
    bad = used & ((page_table < 0) | (page_table >= num_pages))
    if bool(bad.any()):
        b, p = bad.nonzero()[0].tolist()
        _fail(op, f"page_table[{b}, {p}] = {int(page_table[b, p])} is outside the cache's {num_pages} pages")


def check_kap_args(op, stride, top_p, softmax_scale):
    if not isinstance(stride, int) or stride < 1 or BLOCK % stride:
        _fail(op, f"stride must be a positive divisor of {BLOCK}, got {stride!r}")
    if not (isinstance(top_p, (int, float)) and math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        _fail(op, f"top_p must be in (0, 1], got {top_p!r}")
    check_scale(op, softmax_scale)


def check_scale(op, softmax_scale):
    if softmax_scale is not None and not (math.isfinite(softmax_scale) and softmax_scale > 0):
        _fail(op, f"softmax_scale must be a finite positive number, got {softmax_scale!r}")


def check_delta(op, delta):
    if not (isinstance(delta, (int, float)) and math.isfinite(delta)):
        _fail(op, f"delta must be a finite number (<= 0 disables the in-kernel skip), got {delta!r}")


def check_order(op, q, order, counts, cu_seqlens_q, seqused_k, max_seqlen_q):
    """Shapes of the block lists, and (outside graph capture) that every listed block is a causal
    candidate of its query block and every count fits."""
    for name, t, dims in (("order", order, 3), ("counts", counts, 2)):
        if t.dtype != torch.int32:
            _fail(op, f"{name} must be int32, got {t.dtype}", TypeError)
        if t.device != q.device:
            _fail(op, f"{name} must be on {q.device} like q, got {t.device}")
        if t.dim() != dims:
            _fail(op, f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    hq = q.shape[1]
    nqb = num_q_blocks_bound(q.shape[0], seqused_k.shape[0], max_seqlen_q)
    if tuple(counts.shape) != (hq, nqb):
        _fail(op, f"counts must have shape [num_heads_q, num_q_blocks] = {(hq, nqb)}, got {tuple(counts.shape)}")
    if order.shape[:2] != counts.shape or order.shape[2] < 1:
        _fail(op, f"order must have shape [{hq}, {nqb}, max_k_blocks], got {tuple(order.shape)}")
    if _is_capturing(q.device):
        return
    # Diagonal block of each real query block; -1 marks padding rows (count must be 0 there).
    diagonal = torch.full((nqb,), -1, dtype=torch.int64)
    cu, lk = cu_seqlens_q.tolist(), seqused_k.tolist()
    g = 0
    for b in range(len(lk)):
        nq = cdiv(cu[b + 1] - cu[b], BLOCK)
        diagonal[g:g + nq] = (lk[b] - (cu[b + 1] - cu[b])) // BLOCK + torch.arange(nq)
        g += nq
    diagonal = diagonal.to(q.device)
    if bool(((counts < 0) | (counts > diagonal + 1)).any()):
        h, g = ((counts < 0) | (counts > diagonal + 1)).nonzero()[0].tolist()
        _fail(op, f"counts[{h}, {g}] = {int(counts[h, g])} is outside [0, {int(diagonal[g]) + 1}]")
    if bool((counts > order.shape[2]).any()):
        h, g = (counts > order.shape[2]).nonzero()[0].tolist()
        _fail(op, f"counts[{h}, {g}] = {int(counts[h, g])} exceeds order's row length {order.shape[2]}")
    listed = torch.arange(order.shape[2], device=q.device)[None, None, :] < counts[..., None]
    bad = listed & ((order < 0) | (order > diagonal[None, :, None]))
    if bool(bad.any()):
        h, g, k = bad.nonzero()[0].tolist()
        _fail(op, f"order[{h}, {g}, {k}] = {int(order[h, g, k])} is not a causal block of its query block (0..{int(diagonal[g])})")
