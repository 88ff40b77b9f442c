"""The PyTorch reference of CoSA: docs/spec.md in code.

Small and readable on purpose: every test compares the CUDA kernels with these functions, and the
ops' CPU implementation is this module. Arithmetic is float32 (float64 when the inputs are
float64); the functions run on any device.

Layout (spec section 1): packed varlen queries ``q [total_q, Hq, d]`` with ``cu_seqlens_q``; a paged
KV cache ``[num_pages, page_size, Hkv, d]`` with ``page_table [B, max_pages]`` and ``seqused_k``;
the queries of sequence ``b`` are its last ``Lq_b`` positions (prefix ``P_b = Lk_b - Lq_b``).
"""

from __future__ import annotations

import math

import torch

from . import defaults, tuning
from .tuning import FLOAT32_MIN_NORMAL, Tuning

BLOCK = tuning.BLOCK  # logical query/key block size (fixed by the method)
HALF = BLOCK // 2  # rows of one consumer warpgroup of OSK: the unit of the per-warpgroup vote
VOTE_SCOPES = tuning.names("vote")  # spec section 3
PROXY_PRECISIONS = tuning.names("proxy_precision")  # spec section 2

# Tiles processed together by the OSK reference; bounds its memory to a few hundred MB.
_OSK_TILES_PER_CHUNK = 256
# Stride rows scored together by the KAP reference, likewise.
_KAP_ROWS_PER_CHUNK = 1024


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _float32(x: float) -> float:
    """x rounded to float32, where the kernels hold the scalar arguments (spec: "all of it in fp32")."""
    return float(torch.tensor(x, dtype=torch.float32))


def num_q_blocks_bound(total_q: int, batch: int, max_seqlen_q: int) -> int:
    """Rows of ``order``/``counts``/``skipped``: an upper bound of ``sum_b ceil(Lq_b / 128)`` that
    needs no look at ``cu_seqlens_q`` (spec section 2, row-count decision). Exact for one sequence."""
    return min(batch * cdiv(max_seqlen_q, BLOCK), (total_q + (BLOCK - 1) * batch) // BLOCK)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _sequences(cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor):
    """Yield (b, first query token, Lq, Lk, first query block) for every sequence."""
    cu = cu_seqlens_q.tolist()
    lk = seqused_k.tolist()
    first_block = 0
    for b in range(len(lk)):
        lq = cu[b + 1] - cu[b]
        yield b, cu[b], lq, lk[b], first_block
        first_block += cdiv(lq, BLOCK)


def diagonal_blocks(prefix: int, lq: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, last)``, int64 ``[ceil(lq / 128)]``: for each query block ``i`` of a sequence with
    ``prefix`` cached keys and ``lq`` queries (block ``i`` holds queries ``128 i ..``, at positions
    ``prefix + 128 i + r``), the key blocks that hold the positions of its first and of its last
    query, its diagonal blocks (spec section 1). Both are ``prefix / 128 + i`` when the prefix is a
    multiple of 128; otherwise ``last`` is ``first + 1`` where the block's queries cross a key block's
    start. Key blocks after ``last`` are beyond every query of the block."""
    starts = torch.arange(0, lq, BLOCK, device=device, dtype=torch.int64)
    ends = torch.clamp(starts + BLOCK, max=lq) - 1
    return (prefix + starts) // BLOCK, (prefix + ends) // BLOCK


def gather_kv(cache: torch.Tensor, page_table: torch.Tensor, b: int, length: int) -> torch.Tensor:
    """The first ``length`` tokens of sequence ``b`` from a paged cache, as ``[length, H, d]``."""
    page_size = cache.shape[1]
    pages = page_table[b, : cdiv(length, page_size)].long()
    return cache[pages].reshape(-1, *cache.shape[2:])[:length]


def _default_scale(head_dim: int, softmax_scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero-pad dim 0 of ``x`` to ``rows``."""
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, rows - x.shape[0]))


# ----------------------------------------------------------------------------------------------
# Section 2: KAP
# ----------------------------------------------------------------------------------------------


def _kap_sequence_scores(qb, kb, prefix, stride, scale):
    """Scores ``S`` and HRM flags ``H`` ``[Hq, nq, nk]`` of one sequence (spec 2.1-2.4).

    qb: [Lq, Hq, d] and kb: [Lk, Hkv, d] in the compute dtype. Entries that are not causal
    candidates (j past the block's last diagonal block, diagonal_blocks) get S = -inf and H = False.
    Non-finite inputs (spec section 6): a NaN proxy logit drops out of the maxima; a stride row left
    with no maximum makes the scores of its query block NaN."""
    lq, hq, d = qb.shape
    lk, hkv = kb.shape[0], kb.shape[1]
    s = stride
    nq, nk = cdiv(lq, BLOCK), cdiv(lk, BLOCK)
    rows_per_block = BLOCK // s
    nr, nc = cdiv(lq, s), cdiv(lk, s)

    # 2.1 antidiagonal downsampling: Qs[r] = Q[r*s + s-1], ..., Q[r*s]; Ks[c] = K[c*s], ..., K[c*s + s-1].
    qs = _pad_rows(qb, nr * s).reshape(nr, s, hq, d).flip(1).permute(2, 0, 1, 3).reshape(hq, nr, s * d)
    ks = _pad_rows(kb, nc * s).reshape(nc, s, hkv, d).permute(2, 0, 1, 3).reshape(hkv, nc, s * d)
    ks = ks.repeat_interleave(hq // hkv, dim=0)  # query head h reads kv head h // (Hq / Hkv)

    cols = torch.arange(nk * rows_per_block, device=qb.device)
    bm = torch.full((hq, nq * rows_per_block, nk), -math.inf, dtype=qb.dtype, device=qb.device)
    for r0 in range(0, nr, _KAP_ROWS_PER_CHUNK):
        r1 = min(nr, r0 + _KAP_ROWS_PER_CHUNK)
        # 2.2 proxy logits on the scale of the real logits, causal in the downsampled grid.
        z = (scale / s) * torch.matmul(qs[:, r0:r1], ks.transpose(1, 2))
        z = torch.nn.functional.pad(z, (0, nk * rows_per_block - nc), value=-math.inf)
        rows = torch.arange(r0, r1, device=qb.device)
        # A cell is causal when its first key is at or before its stride row's first query:
        # c * s <= P + r * s, i.e. c <= r + floor(P / s) for any prefix.
        allowed = cols[None, :] <= rows[:, None] + prefix // s
        # NaN cells (non-finite inputs) drop out of the maxima, as the kernel's fmaxf drops them.
        z = z.masked_fill(~allowed | z.isnan(), -math.inf)
        # 2.3 MaxPool over each key block's cells.
        bm[:, r0:r1] = z.reshape(hq, r1 - r0, nk, rows_per_block).amax(-1)

    live = (torch.arange(nq * rows_per_block, device=qb.device) < nr)[None, :, None]  # stride rows that exist
    rm = bm.amax(-1, keepdim=True)  # row max over blocks; -inf for padding rows
    # A live row whose every allowed cell was NaN or -inf has no maximum: NaN makes its query
    # block's scores NaN, and NaN scores keep every candidate (2.6).
    rm = torch.where(live & (rm == -math.inf), math.nan, rm)
    pbar = torch.where(live, torch.exp(bm - rm), 0.0)
    is_row_max = (bm == rm) & live
    # 2.4 block scores and HRM flags over the stride rows each query block owns.
    scores = pbar.reshape(hq, nq, rows_per_block, nk).sum(2)
    hrm = is_row_max.reshape(hq, nq, rows_per_block, nk).any(2)
    candidate = torch.arange(nk, device=qb.device)[None, :] <= diagonal_blocks(prefix, lq, qb.device)[1][:, None]
    scores = scores.masked_fill(~candidate, -math.inf)
    return scores, hrm & candidate


def _kap_select(scores, hrm, prefix, lq, top_p):
    """Spec 2.5-2.6: ordered lists ``[Hq, nq, nk]`` (-1 padded) and counts ``[Hq, nq]``."""
    hq, nq, nk = scores.shape
    device = scores.device
    candidate = scores != -math.inf  # NaN scores (non-finite inputs) are candidates
    # 2.5 sort by (H desc, S desc, j asc): stable sorts from the least significant key up.
    by_score = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    by_flag = torch.sort(hrm.gather(-1, by_score).to(torch.int8), dim=-1, descending=True, stable=True).indices
    sorted_j = by_score.gather(-1, by_flag)
    sorted_s = torch.where(candidate, scores, 0.0).gather(-1, sorted_j)
    sorted_h = hrm.gather(-1, sorted_j)
    sorted_candidate = candidate.gather(-1, sorted_j)
    # 2.6 shortest prefix whose cumulative score reaches p*T, plus HRM, sink and diagonal blocks.
    # Written as "not reached before": a NaN total (non-finite inputs) is never reached, so the
    # prefix is every candidate.
    total = sorted_s.sum(-1, keepdim=True)
    before = torch.cumsum(sorted_s, -1) - sorted_s
    in_prefix = ~(before >= top_p * total) if _float32(top_p) < 1.0 else torch.ones_like(sorted_h)
    first, last = (d[None, :, None] for d in diagonal_blocks(prefix, lq, device))
    keep = (in_prefix | sorted_h | (sorted_j == 0) | (sorted_j == first) | (sorted_j == last)) & sorted_candidate
    # Compact the kept entries to the front, keeping their sort order.
    front = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices
    counts = keep.sum(-1).to(torch.int32)
    order = sorted_j.gather(-1, front).to(torch.int32)
    order[torch.arange(nk, device=device) >= counts[..., None]] = -1
    return order, counts


E4M3_MAX = 448.0  # the largest finite float8 e4m3 value


def e4m3_block_values(x: torch.Tensor) -> torch.Tensor:
    """The values that KAP's fp8 proxy multiplies in place of ``x`` ``[L, H, d]`` (spec section 2,
    proxy precision), float32: per block of 128 rows (from row 0) and head, ``amax = max |x|`` (NaN
    if any value is NaN), ``scale = amax / 448`` (1 where amax is 0), and
    ``e4m3(x * (448 / amax)) * scale``, rounded to nearest even and saturating. Every step is one
    IEEE float32 operation, as in the quantisation kernel."""
    length, heads, dim = x.shape
    rows = cdiv(length, BLOCK) * BLOCK
    blocks = torch.nn.functional.pad(x.float(), (0, 0, 0, 0, 0, rows - length)).reshape(-1, BLOCK, heads, dim)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)  # propagates NaN; the zero padding never wins
    one = torch.ones_like(amax)
    scale = torch.where(amax == 0, one, amax / E4M3_MAX)
    inverse = torch.where(amax == 0, one, E4M3_MAX / amax)
    values = (blocks * inverse).to(torch.float8_e4m3fn).float() * scale
    return values.reshape(rows, heads, dim)[:length]


def channel_midpoints(x: torch.Tensor) -> torch.Tensor:
    """Per head and channel of ``x [L, H, d]``, the midpoint of the finite values over the L rows,
    ``max / 2 + min / 2`` in float32, ``[1, H, d]`` (0 where a channel has no finite value).
    Order-independent, so the kernels reproduce it bit for bit."""
    xf = x.float()
    finite = torch.isfinite(xf)
    high = xf.masked_fill(~finite, -math.inf).amax(0, keepdim=True)
    low = xf.masked_fill(~finite, math.inf).amin(0, keepdim=True)
    centre = high * 0.5 + low * 0.5
    return torch.where(torch.isfinite(centre), centre, torch.zeros_like(centre))


def key_centres(k: torch.Tensor) -> torch.Tensor:
    """What the fp8 proxy subtracts from one sequence's keys ``k [Lk, Hkv, d]`` before quantising
    them (spec section 2, proxy precision): the channel_midpoints of keys 0, KEY_CENTRE_STRIDE,
    2 * KEY_CENTRE_STRIDE, ..., ``[1, Hkv, d]``."""
    return channel_midpoints(k[::defaults.KEY_CENTRE_STRIDE])


def _proxy_operand(x: torch.Tensor, proxy_precision: str, dt: torch.dtype, keys: bool = False) -> torch.Tensor:
    if proxy_precision != "fp8":
        return x.to(dt)
    return e4m3_block_values(x.float() - key_centres(x) if keys else x).to(dt)


def resolved_proxy_precision(proxy_precision: str, max_seqlen_k: int) -> str:
    """The proxy that ``proxy_precision`` selects: ``"auto"`` is ``"fp8"`` where the longest key
    sequence has at least ``defaults.FP8_PROXY_MIN_KEYS`` tokens, ``"native"`` below (spec section 2)."""
    if proxy_precision != "auto":
        return proxy_precision
    return "fp8" if max_seqlen_k >= defaults.FP8_PROXY_MIN_KEYS else "native"


def kap_scores(q, k_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
               stride=Tuning.stride, softmax_scale=defaults.SOFTMAX_SCALE,
               proxy_precision=Tuning.proxy_precision):
    """Block scores S and HRM flags H of every (query head, query block): float32 / bool
    ``[Hq, num_q_blocks, ceil(max_seqlen_k / 128)]``; -inf / False outside the causal candidates
    and on padding rows. ``proxy_precision="fp8"``: the proxy multiplies e4m3_block_values of each
    sequence's queries and of its keys less their key_centres; ``"auto"``: resolved_proxy_precision."""
    proxy_precision = resolved_proxy_precision(proxy_precision, max_seqlen_k)
    total_q, hq, d = q.shape
    batch = seqused_k.shape[0]
    nqb = num_q_blocks_bound(total_q, batch, max_seqlen_q)
    max_nk = cdiv(max_seqlen_k, BLOCK)
    scale = _default_scale(d, softmax_scale)
    dt = _compute_dtype(q.dtype)
    scores = torch.full((hq, nqb, max_nk), -math.inf, dtype=dt, device=q.device)
    hrm = torch.zeros((hq, nqb, max_nk), dtype=torch.bool, device=q.device)
    for b, q0, lq, lk, g0 in _sequences(cu_seqlens_q, seqused_k):
        if lq == 0:
            continue
        s_b, h_b = _kap_sequence_scores(
            _proxy_operand(q[q0:q0 + lq], proxy_precision, dt),
            _proxy_operand(gather_kv(k_cache, page_table, b, lk), proxy_precision, dt, keys=True), lk - lq, stride,
            scale)
        scores[:, g0:g0 + s_b.shape[1], : s_b.shape[2]] = s_b
        hrm[:, g0:g0 + s_b.shape[1], : s_b.shape[2]] = h_b
    return scores, hrm


def kap(q, k_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
        stride=Tuning.stride, top_p=Tuning.top_p, softmax_scale=defaults.SOFTMAX_SCALE,
        proxy_precision=Tuning.proxy_precision):
    """Spec section 2: ``order`` int32 ``[Hq, num_q_blocks, ceil(max_seqlen_k/128)]`` (each list in
    visiting order, then -1) and ``counts`` int32 ``[Hq, num_q_blocks]``."""
    total_q, hq, _ = q.shape
    batch = seqused_k.shape[0]
    nqb = num_q_blocks_bound(total_q, batch, max_seqlen_q)
    max_nk = cdiv(max_seqlen_k, BLOCK)
    order = torch.full((hq, nqb, max_nk), -1, dtype=torch.int32, device=q.device)
    counts = torch.zeros((hq, nqb), dtype=torch.int32, device=q.device)
    scores, hrm = kap_scores(q, k_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
                             stride, softmax_scale, proxy_precision)
    for _, _, lq, lk, g0 in _sequences(cu_seqlens_q, seqused_k):
        nq, nk = cdiv(lq, BLOCK), cdiv(lk, BLOCK)
        if nq == 0:
            continue
        rows = slice(g0, g0 + nq)
        o_b, c_b = _kap_select(scores[:, rows, :nk], hrm[:, rows, :nk], lk - lq, lq, top_p)
        order[:, rows, :nk] = o_b
        counts[:, rows] = c_b
    return order, counts


def causal_order(cu_seqlens_q, seqused_k, num_heads_q, max_seqlen_q, max_seqlen_k, total_q):
    """Every causal block of every query block, ascending (OSK's dense mode)."""
    batch = seqused_k.shape[0]
    nqb = num_q_blocks_bound(total_q, batch, max_seqlen_q)
    max_nk = cdiv(max_seqlen_k, BLOCK)
    device = seqused_k.device
    order = torch.full((num_heads_q, nqb, max_nk), -1, dtype=torch.int32, device=device)
    counts = torch.zeros((num_heads_q, nqb), dtype=torch.int32, device=device)
    j = torch.arange(max_nk, device=device, dtype=torch.int32)
    for _, _, lq, lk, g0 in _sequences(cu_seqlens_q, seqused_k):
        nq = cdiv(lq, BLOCK)
        last = diagonal_blocks(lk - lq, lq, device)[1].to(torch.int32)
        order[:, g0:g0 + nq] = torch.where(j[None, :] <= last[:, None], j[None, :], -1)
        counts[:, g0:g0 + nq] = last + 1
    return order, counts


# ----------------------------------------------------------------------------------------------
# Section 3: OSK
# ----------------------------------------------------------------------------------------------


def _tile_logits(q_tiles, k_blocks, q_pos, k_pos, lk, scale):
    """Scaled logits ``[T, 128, 128]`` with causal and key-length masking."""
    s = scale * torch.matmul(q_tiles, k_blocks.transpose(1, 2))
    masked = (k_pos[:, None, :] > q_pos[:, :, None]) | (k_pos[:, None, :] >= lk)
    return s.masked_fill(masked, -math.inf)


def osk(q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, order, counts, max_seqlen_q,
        softmax_scale=defaults.SOFTMAX_SCALE, delta=Tuning.delta, vote=Tuning.vote, return_skip_trace=False):
    """Spec section 3. Returns ``out`` (like q), ``lse`` float32 ``[Hq, total_q]`` and ``skipped``
    int32 ``[Hq, num_q_blocks]``, the 64-row halves of each tile whose P V work the vote skipped,
    summed over its list (a tile-wide skip counts 2). ``vote`` is who decides together: each 64-row
    half of the tile alone (``"warpgroup"``) or all 128 rows (``"tile"``). With
    ``return_skip_trace`` also a bool tensor ``order.shape + (2,)`` marking, per list entry and
    half, what the vote skipped."""
    total_q, hq, d = q.shape
    hkv = k_cache.shape[2]
    scale = _default_scale(d, softmax_scale)
    dt = _compute_dtype(q.dtype)
    device = q.device
    out = torch.zeros((total_q, hq, d), dtype=q.dtype, device=device)
    lse = torch.full((hq, total_q), -math.inf, dtype=torch.float32, device=device)
    trace = torch.zeros((*order.shape, 2), dtype=torch.bool, device=device)
    rows = torch.arange(BLOCK, device=device)
    voters = HALF if vote == "warpgroup" else BLOCK  # rows that decide together

    for b, q0, lq, lk, g0 in _sequences(cu_seqlens_q, seqused_k):
        nq, nk = cdiv(lq, BLOCK), cdiv(lk, BLOCK)
        if nq == 0:
            continue
        prefix = lk - lq
        # In float32, as the kernels hold them: delta >= N would skip everything after the first block,
        # and delta / N below float32's normal range is 0 (tau = -inf: no live row skips).
        delta32, lk32 = _float32(delta), _float32(lk)
        skip_on = 0 < delta32 < lk32
        ratio = _float32(delta32 / lk32)
        tau = (math.log(ratio) if ratio >= FLOAT32_MIN_NORMAL else -math.inf) if skip_on else 0.0
        # Tiles of this sequence: t = h * nq + i.
        q_b = _pad_rows(q[q0:q0 + lq].to(dt), nq * BLOCK).reshape(nq, BLOCK, hq, d).permute(2, 0, 1, 3)
        q_b = q_b.reshape(hq * nq, BLOCK, d)
        k_b = _pad_rows(gather_kv(k_cache, page_table, b, lk).to(dt), nk * BLOCK)
        v_b = _pad_rows(gather_kv(v_cache, page_table, b, lk).to(dt), nk * BLOCK)
        k_b = k_b.reshape(nk, BLOCK, hkv, d).permute(2, 0, 1, 3)  # [Hkv, nk, 128, d]
        v_b = v_b.reshape(nk, BLOCK, hkv, d).permute(2, 0, 1, 3)
        tile_head = torch.arange(hq, device=device).repeat_interleave(nq)
        tile_block = torch.arange(nq, device=device).repeat(hq)
        tile_order = order[:, g0:g0 + nq].reshape(hq * nq, -1).long()
        tile_count = counts[:, g0:g0 + nq].reshape(hq * nq).long()
        q_pos = prefix + tile_block[:, None] * BLOCK + rows[None, :]  # [T, 128]
        live_row = q_pos < lk  # rows past Lq do not exist

        o_b = torch.zeros((hq * nq, BLOCK, d), dtype=dt, device=device)
        m_b = torch.full((hq * nq, BLOCK), -math.inf, dtype=dt, device=device)
        l_b = torch.zeros((hq * nq, BLOCK), dtype=dt, device=device)
        trace_b = torch.zeros((hq * nq, order.shape[2], 2), dtype=torch.bool, device=device)
        for t0 in range(0, hq * nq, _OSK_TILES_PER_CHUNK):
            ts = slice(t0, min(hq * nq, t0 + _OSK_TILES_PER_CHUNK))
            kvh = tile_head[ts] // (hq // hkv)
            o, m, l = o_b[ts], m_b[ts], l_b[ts]
            for k in range(int(tile_count[ts].max())):
                active = k < tile_count[ts]
                j = tile_order[ts, k].clamp(min=0)
                k_pos = j[:, None] * BLOCK + rows[None, :]
                s = _tile_logits(q_b[ts], k_b[kvh, j], q_pos[ts], k_pos, lk, scale)
                # NaN logits (non-finite inputs) drop out of the max and so of the vote, as the
                # kernel's fmaxf drops them; they reach l and O through P all the same.
                m_loc = s.masked_fill(s.isnan(), -math.inf).amax(-1)
                m_new = torch.maximum(m, m_loc)
                if skip_on and k > 0:
                    votes = (m_loc == -math.inf) | (m_loc - m_new < tau) | ~live_row[ts]
                    groups = votes.reshape(votes.shape[0], -1, voters).all(-1)  # [T, 128 / voters]
                    skip = active[:, None] & groups.repeat_interleave(voters, 1)  # per row
                else:
                    skip = torch.zeros_like(live_row[ts])
                update = active[:, None] & ~skip  # [T, 128]
                trace_b[ts, k] = skip[:, ::HALF]
                # Online softmax; rows whose running max is still -inf contribute nothing. A +inf
                # max (an infinite input) makes P and the rescale NaN, as exp(inf - inf) is.
                m_safe = torch.where(m_new == -math.inf, 0.0, m_new)
                p = torch.exp(s - m_safe[..., None])
                alpha = torch.exp(m - m_safe)
                l = torch.where(update, alpha * l + p.sum(-1), l)
                o = torch.where(update[..., None], alpha[..., None] * o + torch.matmul(p, v_b[kvh, j]), o)
                m = torch.where(update, m_new, m)
            o_b[ts], m_b[ts], l_b[ts] = o, m, l

        # l is positive, NaN (a non-finite logit or rescale reached the row: out and lse NaN), or 0
        # (no key reached the row: a padding row or an empty list; out 0 and lse -inf).
        empty = l_b == 0
        o_b = torch.where(empty[..., None], 0.0, o_b / l_b[..., None])
        lse_b = torch.where(empty, -math.inf, m_b + torch.log(l_b))
        o_b = o_b.reshape(hq, nq * BLOCK, d)[:, :lq].permute(1, 0, 2)
        out[q0:q0 + lq] = o_b.to(q.dtype)
        lse[:, q0:q0 + lq] = lse_b.reshape(hq, nq * BLOCK)[:, :lq].float()
        trace[:, g0:g0 + nq] = trace_b.reshape(hq, nq, -1, 2)
    skipped = trace.sum((-1, -2), dtype=torch.int32)
    if return_skip_trace:
        return out, lse, skipped, trace
    return out, lse, skipped


def dense_attention(q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, softmax_scale=None):
    """Exact causal attention (bottom-right aligned) over the same layout: ``(out, lse)``."""
    total_q, hq, d = q.shape
    hkv = k_cache.shape[2]
    scale = _default_scale(d, softmax_scale)
    dt = _compute_dtype(q.dtype)
    out = torch.zeros_like(q)
    lse = torch.full((hq, total_q), -math.inf, dtype=torch.float32, device=q.device)
    for b, q0, lq, lk, _ in _sequences(cu_seqlens_q, seqused_k):
        if lq == 0:
            continue
        k_b = gather_kv(k_cache, page_table, b, lk).to(dt).repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        v_b = gather_kv(v_cache, page_table, b, lk).to(dt).repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        for r0 in range(0, lq, 4 * BLOCK):
            r1 = min(lq, r0 + 4 * BLOCK)
            q_c = q[q0 + r0:q0 + r1].to(dt).transpose(0, 1)  # [Hq, rows, d]
            s = scale * torch.matmul(q_c, k_b.transpose(1, 2))
            q_pos = lk - lq + torch.arange(r0, r1, device=q.device)
            s = s.masked_fill(torch.arange(lk, device=q.device)[None, :] > q_pos[:, None], -math.inf)
            lse_c = torch.logsumexp(s, -1)
            out[q0 + r0:q0 + r1] = torch.matmul(torch.exp(s - lse_c[..., None]), v_b).transpose(0, 1).to(q.dtype)
            lse[:, q0 + r0:q0 + r1] = lse_c.float()
    return out, lse


def budgets(counts, skipped, cu_seqlens_q, seqused_k):
    """Stage-1 and realised budgets (spec section 3) as Python floats. ``skipped`` counts 64-row
    halves of tiles, so a block skipped by the whole tile counts one block."""
    causal = 0
    for _, _, lq, lk, _ in _sequences(cu_seqlens_q, seqused_k):
        causal += int((diagonal_blocks(lk - lq, lq)[1] + 1).sum())
    causal *= counts.shape[0]
    visited = int(counts.sum())
    return visited / causal, (visited - int(skipped.sum()) / 2) / causal
