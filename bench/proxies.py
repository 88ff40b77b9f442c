"""Block-selection proxies of the peers, the oracle, and the metrics that compare block masks: the
research code of bench/fidelity.py and bench/accuracy.py (the package needs none of it).

Everything here works on ONE sequence in the contiguous layout ``q [Lq, Hq, d]``, ``k, v [Lk, Hkv, d]``
(the queries are the last ``Lq`` positions, prefix ``P = Lk - Lq`` a multiple of 128, as in
docs/spec.md) and returns float32 block scores or boolean block masks ``[Hq, nq, nk]`` over the
128 x 128 blocks (``nq = ceil(Lq/128)``, ``nk = ceil(Lk/128)``). Scores are ``-inf`` outside the
causal candidates ``j <= P/128 + i``; every mask holds only causal candidates and always the sink
block 0 and the diagonal block (as KAP does), so that masks of different methods are comparable.
Reference quality: plain PyTorch in float32, any device, chunked so that it fits at 32K tokens.

The peers are re-implemented from their papers (our own code, not theirs):

- **XAttention** (Xu et al. 2025): antidiagonal strided scoring (the same downsampling as KAP's
  step 2.1), a row softmax over the causal downsampled logits, SUM pooling of the probabilities
  into blocks, and per query block the shortest set of blocks whose normalised score reaches a
  threshold. Differs from KAP in the softmax + sum pooling (KAP: max pooling + MaxNorm + HRM flags).
- **FlexPrefill** (Lai et al. 2025): per head, the last block of queries decides between two
  patterns by the Jensen-Shannon distance of a pooled estimate (mean query . mean key blocks) from
  the true pooled attention of those queries: *query-aware* heads take the pooled block estimate of
  every query block and keep the globally highest blocks up to cumulative coverage ``gamma``;
  *vertical-slash* heads take the exact attention of the last queries, sum it per key column
  (vertical) and per query-key offset (slash), keep the columns and offsets up to coverage
  ``gamma``, and select every block that a kept column or offset crosses.
- **Mean pooling**: block-mean queries and keys, a softmax over the causal key blocks, top-p per row.
- **Oracle**: the exact share of each query block's attention mass in each key block (from dense
  attention); its top-p mask (shortest set per row whose mass reaches ``p``) is the ground truth.

Matched budgets: :func:`budget_mask` keeps, per (head, query block) row, the same number of blocks
``max(min(2, n), round(budget * n))`` (``n`` causal candidates, sink and diagonal first) for every
method, ranked by the method's scores; KAP ranks HRM blocks first, then by score (its order).
:func:`counts_mask` keeps a given number of blocks in each row instead (another method's list
lengths, e.g. KAP's stage-1 counts), ranked the same way.

:func:`structured_problem` is the fidelity generator: ``cosa.testing.random_problem(structure="mixed")``
(attention sinks, a local band, planted needles) plus **vertical stripes** (single key tokens that
every later query of one KV head's query heads attends to, several per head, as strong as the
needles, their directions projected out of the rest of that head) and **slash lines** (a peak of
attention at fixed query-key offsets, made with position features ``cos/sin(w (t - o))`` on the
queries and ``cos/sin(w s)`` on the keys over several frequencies ``w``, whose dot product peaks
where ``t - s = o``).
"""

from __future__ import annotations

import math

import torch

from cosa import reference, testing
from cosa.layout import kap_layout_args, paged_from_contiguous
from cosa.reference import BLOCK, cdiv

# Memory bound of the chunked passes: elements of one float32 logits chunk (~1 GiB).
_CHUNK_ELEMENTS = 1 << 28


def _scale(d: int, softmax_scale: float | None) -> float:
    return 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)


def _geometry(q: torch.Tensor, k: torch.Tensor):
    lq, hq, d = q.shape
    lk, hkv = k.shape[0], k.shape[1]
    if lk < lq:
        raise ValueError(f"need Lk >= Lq, got Lq={lq}, Lk={lk}")
    if (lk - lq) % BLOCK:
        raise ValueError(f"the prefix Lk - Lq = {lk - lq} must be a multiple of {BLOCK}")
    if hq % hkv:
        raise ValueError(f"Hq ({hq}) must be a multiple of Hkv ({hkv})")
    return lq, lk, hq, hkv, d, lk - lq


def candidate_mask(nq: int, nk: int, prefix: int, device=None) -> torch.Tensor:
    """bool ``[nq, nk]``: key block ``j`` is a causal candidate of query block ``i`` iff ``j <= P/128 + i``."""
    i = torch.arange(nq, device=device)[:, None]
    j = torch.arange(nk, device=device)[None, :]
    return j <= prefix // BLOCK + i


def forced_mask(nq: int, nk: int, prefix: int, device=None) -> torch.Tensor:
    """bool ``[nq, nk]``: the sink block 0 and each row's diagonal block."""
    i = torch.arange(nq, device=device)[:, None]
    j = torch.arange(nk, device=device)[None, :]
    return (j == 0) | (j == prefix // BLOCK + i)


def _expand_kv(k: torch.Tensor, hq: int) -> torch.Tensor:
    """``[L, Hkv, d]`` -> ``[Hq, L, d]`` float32 (query head h reads KV head h // (Hq/Hkv))."""
    return k.float().permute(1, 0, 2).repeat_interleave(hq // k.shape[1], dim=0)


def _pad_to_blocks(x: torch.Tensor, blocks: int) -> torch.Tensor:
    """Zero-pad dim 1 of ``[H, L, ...]`` to ``blocks * 128``."""
    pad = blocks * BLOCK - x.shape[1]
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) if pad else x


# ----------------------------------------------------------------------------------------------
# The contiguous single-sequence problem (cosa.layout.paged_from_contiguous is the way back)
# ----------------------------------------------------------------------------------------------


def contiguous(problem: dict):
    """``(q, k, v)`` of sequence 0 of a ``random_problem``-style dict, K/V gathered from the pages."""
    lk = int(problem["seqused_k"][0])
    lq = int(problem["cu_seqlens_q"][1])
    return (problem["q"][:lq], reference.gather_kv(problem["k_cache"], problem["page_table"], 0, lk),
            reference.gather_kv(problem["v_cache"], problem["page_table"], 0, lk))


# ----------------------------------------------------------------------------------------------
# Oracle and KAP
# ----------------------------------------------------------------------------------------------


def oracle_mass(q: torch.Tensor, k: torch.Tensor, softmax_scale: float | None = None) -> torch.Tensor:
    """Exact attention mass ``[Hq, nq, nk]``: the mean over the rows of query block ``i`` of the
    softmax probability that falls in key block ``j`` (each row of blocks sums to 1); -inf outside
    the causal candidates."""
    lq, lk, hq, hkv, d, prefix = _geometry(q, k)
    nq, nk = cdiv(lq, BLOCK), cdiv(lk, BLOCK)
    scale = _scale(d, softmax_scale)
    kf = _pad_to_blocks(_expand_kv(k, hq), nk)  # [Hq, nk*128, d]
    qf = q.float().permute(1, 0, 2)  # [Hq, Lq, d]
    mass = torch.zeros((hq, nq, nk), dtype=torch.float32, device=q.device)
    key_pos = torch.arange(nk * BLOCK, device=q.device)
    blocks_per_chunk = max(1, _CHUNK_ELEMENTS // (hq * BLOCK * nk * BLOCK))
    for i0 in range(0, nq, blocks_per_chunk):
        i1 = min(nq, i0 + blocks_per_chunk)
        r0, r1 = i0 * BLOCK, min(lq, i1 * BLOCK)
        s = scale * torch.matmul(qf[:, r0:r1], kf.transpose(1, 2))
        q_pos = prefix + torch.arange(r0, r1, device=q.device)
        s = s.masked_fill((key_pos[None, :] > q_pos[:, None]) | (key_pos[None, :] >= lk), -math.inf)
        p = torch.softmax(s, dim=-1)
        del s
        p = _pad_to_blocks(p, i1 - i0)
        rows = (q_pos < lk).float()
        rows = torch.nn.functional.pad(rows, (0, (i1 - i0) * BLOCK - rows.shape[0]))
        block_sum = p.reshape(hq, i1 - i0, BLOCK, nk, BLOCK).sum((2, 4))
        live = rows.reshape(i1 - i0, BLOCK).sum(-1).clamp(min=1)
        mass[:, i0:i1] = block_sum / live[None, :, None]
        del p
    return mass.masked_fill(~candidate_mask(nq, nk, prefix, q.device), -math.inf)


def kap_scores(q: torch.Tensor, k: torch.Tensor, stride: int = 8, softmax_scale: float | None = None):
    """KAP's block scores ``S`` and HRM flags ``H`` ``[Hq, nq, nk]`` (``cosa.reference.kap_scores``)."""
    args = kap_layout_args(paged_from_contiguous(q, k))
    scores, hrm = reference.kap_scores(*args, stride=stride, softmax_scale=softmax_scale)
    return scores.float(), hrm


def kap_rank(scores: torch.Tensor, hrm: torch.Tensor) -> torch.Tensor:
    """One ranking key that orders blocks as KAP's sort does (HRM first, then score): scores are
    at most 128/stride per block, so adding 1e6 to HRM blocks puts them ahead of every other block."""
    return torch.where(hrm, scores + 1e6, scores)


def kap_mask(q: torch.Tensor, k: torch.Tensor, stride: int = 8, top_p: float = 0.95,
             softmax_scale: float | None = None) -> torch.Tensor:
    """The mask of KAP's own lists (``cosa.reference.kap``, spec section 2.6)."""
    args = kap_layout_args(paged_from_contiguous(q, k))
    order, counts = reference.kap(*args, stride=stride, top_p=top_p, softmax_scale=softmax_scale)
    return lists_to_mask(order, counts)


# ----------------------------------------------------------------------------------------------
# The peers
# ----------------------------------------------------------------------------------------------


def _strided(q: torch.Tensor, k: torch.Tensor, stride: int):
    """Antidiagonal downsampling (spec 2.1): ``Qs [Hq, nr, s*d]``, ``Ks [Hq, nc, s*d]`` float32."""
    lq, hq, d = q.shape
    lk = k.shape[0]
    nr, nc = cdiv(lq, stride), cdiv(lk, stride)
    qf = _pad_to_blocks(q.float().permute(1, 0, 2), cdiv(lq, BLOCK))[:, : nr * stride]
    qs = qf.reshape(hq, nr, stride, d).flip(2).reshape(hq, nr, stride * d)
    kf = _pad_to_blocks(_expand_kv(k, hq), cdiv(lk, BLOCK))[:, : nc * stride]
    ks = kf.reshape(hq, nc, stride, d).reshape(hq, nc, stride * d)
    return qs, ks


def xattention_scores(q: torch.Tensor, k: torch.Tensor, stride: int = 8,
                      softmax_scale: float | None = None) -> torch.Tensor:
    """XAttention's block scores ``[Hq, nq, nk]``: the antidiagonal logits ``(sigma/s) Qs . Ks``
    (causal in the downsampled grid), a softmax per stride row, and the probabilities summed over
    each block's stride rows and columns, divided by the rows of the block (each row of blocks sums
    to 1)."""
    lq, lk, hq, hkv, d, prefix = _geometry(q, k)
    if BLOCK % stride:
        raise ValueError(f"stride must divide {BLOCK}, got {stride}")
    nq, nk = cdiv(lq, BLOCK), cdiv(lk, BLOCK)
    per_block = BLOCK // stride
    qs, ks = _strided(q, k, stride)
    nr, nc = qs.shape[1], ks.shape[1]
    scale = _scale(d, softmax_scale) / stride
    scores = torch.zeros((hq, nq, nk), dtype=torch.float32, device=q.device)
    cols = torch.arange(nk * per_block, device=q.device)
    rows_per_chunk = max(per_block, (_CHUNK_ELEMENTS // (hq * nk * per_block)) // per_block * per_block)
    for r0 in range(0, nr, rows_per_chunk):
        r1 = min(nr, r0 + rows_per_chunk)
        z = scale * torch.matmul(qs[:, r0:r1], ks.transpose(1, 2))
        z = torch.nn.functional.pad(z, (0, nk * per_block - nc), value=-math.inf)
        rows = torch.arange(r0, r1, device=q.device)
        z = z.masked_fill(cols[None, :] > rows[:, None] + prefix // stride, -math.inf)
        p = torch.softmax(z, dim=-1)
        del z
        rows_live = torch.nn.functional.pad(p, (0, 0, 0, cdiv(r1 - r0, per_block) * per_block - (r1 - r0)))
        b0 = r0 // per_block
        nb = rows_live.shape[1] // per_block
        scores[:, b0:b0 + nb] = rows_live.reshape(hq, nb, per_block, nk, per_block).sum((2, 4))
        del p, rows_live
    live_rows = torch.tensor([min(per_block, nr - i * per_block) for i in range(nq)], dtype=torch.float32,
                             device=q.device)
    scores = scores / live_rows[None, :, None]
    return scores.masked_fill(~candidate_mask(nq, nk, prefix, q.device), -math.inf)


def mean_pooling_scores(q: torch.Tensor, k: torch.Tensor, softmax_scale: float | None = None) -> torch.Tensor:
    """Plain mean pooling: ``softmax_j(sigma * mean(Q_i) . mean(K_j))`` over the causal key blocks."""
    lq, lk, hq, hkv, d, prefix = _geometry(q, k)
    nq, nk = cdiv(lq, BLOCK), cdiv(lk, BLOCK)
    qm = _block_means(q.float().permute(1, 0, 2), lq, nq)
    km = _block_means(_expand_kv(k, hq), lk, nk)
    z = _scale(d, softmax_scale) * torch.matmul(qm, km.transpose(1, 2))
    cand = candidate_mask(nq, nk, prefix, q.device)
    return torch.softmax(z.masked_fill(~cand, -math.inf), dim=-1).masked_fill(~cand, -math.inf)


def _block_means(x: torch.Tensor, length: int, blocks: int) -> torch.Tensor:
    """Mean over each 128-token block of ``[H, L, d]`` (partial last block: its real tokens only)."""
    sums = _pad_to_blocks(x, blocks).reshape(x.shape[0], blocks, BLOCK, x.shape[-1]).sum(2)
    sizes = torch.tensor([min(BLOCK, length - b * BLOCK) for b in range(blocks)], dtype=torch.float32,
                         device=x.device)
    return sums / sizes[None, :, None]


def flexprefill(q: torch.Tensor, k: torch.Tensor, gamma: float = 0.9, tau: float = 0.1,
                softmax_scale: float | None = None):
    """FlexPrefill's selection. Returns ``(scores, mask, query_aware)``: ranking scores
    ``[Hq, nq, nk]`` (the pooled estimate on query-aware heads; on vertical-slash heads the
    coverage of the block's columns plus the offsets that cross it), the method's own mask at
    coverage ``gamma`` (sink and diagonal added), and the per-head pattern ``[Hq]`` (True:
    query-aware, chosen when the Jensen-Shannon distance is below ``tau``)."""
    lq, lk, hq, hkv, d, prefix = _geometry(q, k)
    nq, nk = cdiv(lq, BLOCK), cdiv(lk, BLOCK)
    scale = _scale(d, softmax_scale)
    device = q.device
    cand = candidate_mask(nq, nk, prefix, device)
    kf = _expand_kv(k, hq)  # [Hq, Lk, d]

    # The last block of queries: exact attention and its pooled estimate.
    last = lq - ((lq - 1) % BLOCK + 1)  # first row of the last query block
    q_last = q[last:].float().permute(1, 0, 2)  # [Hq, m, d]
    q_pos = prefix + torch.arange(last, lq, device=device)
    key_pos = torch.arange(lk, device=device)
    s = scale * torch.matmul(q_last, kf.transpose(1, 2))
    p_last = torch.softmax(s.masked_fill(key_pos[None, :] > q_pos[:, None], -math.inf), dim=-1)
    del s
    true_blocks = _pad_to_blocks(p_last.mean(1).unsqueeze(-1), nk).reshape(hq, nk, BLOCK).sum(-1)
    pooled = mean_pooling_scores(q, k, softmax_scale)  # [Hq, nq, nk], -inf off the candidates
    estimate = pooled[:, -1].clamp(min=0)
    distance = _js_distance(estimate, true_blocks)
    query_aware = distance < tau

    # Query-aware heads: the globally highest pooled blocks up to coverage gamma (each row sums to 1).
    qa_mask = _global_coverage_mask(pooled, gamma)

    # Vertical-slash heads: columns and offsets of the last queries' attention.
    vertical = p_last.sum(1)  # [Hq, Lk]
    offsets = (q_pos[:, None] - key_pos[None, :]).clamp(min=0)  # [m, Lk]
    slash = torch.zeros((hq, lk), dtype=torch.float32, device=device)
    slash.scatter_add_(1, offsets.reshape(1, -1).expand(hq, -1), p_last.reshape(hq, -1))
    del p_last
    vertical = vertical / vertical.sum(-1, keepdim=True)
    slash = slash / slash.sum(-1, keepdim=True)
    keep_v = _coverage_keep(vertical, gamma)
    keep_s = _coverage_keep(slash, gamma)
    col_blocks = _pad_to_blocks(keep_v.unsqueeze(-1).float(), nk).reshape(hq, nk, BLOCK).amax(-1) > 0
    col_cover = _pad_to_blocks(vertical.unsqueeze(-1), nk).reshape(hq, nk, BLOCK).sum(-1)
    # Offset o crosses block (i, j) iff o lies in [128 dist - 127, 128 dist + 127], dist = P/128 + i - j.
    dist = (prefix // BLOCK + torch.arange(nq, device=device)[:, None] - torch.arange(nk, device=device)[None, :])
    dist = dist.clamp(min=0)
    window_hit, window_cover = _offset_windows(keep_s, slash, nk)  # [Hq, nk] per block distance
    vs_mask = col_blocks[:, None, :] | window_hit.gather(1, dist.reshape(1, -1).expand(hq, -1)).reshape(hq, nq, nk)
    vs_scores = col_cover[:, None, :] + window_cover.gather(1, dist.reshape(1, -1).expand(hq, -1)).reshape(hq, nq, nk)

    scores = torch.where(query_aware[:, None, None], pooled, vs_scores.masked_fill(~cand, -math.inf))
    mask = torch.where(query_aware[:, None, None], qa_mask, vs_mask)
    mask = (mask | forced_mask(nq, nk, prefix, device)) & cand
    return scores, mask, query_aware


def _js_distance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sqrt of the Jensen-Shannon divergence (natural log) of two distributions per row."""
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-30)
    q = q / q.sum(-1, keepdim=True).clamp(min=1e-30)
    m = 0.5 * (p + q)

    def kl(a, b):
        return torch.where(a > 0, a * (torch.log(a.clamp(min=1e-30)) - torch.log(b.clamp(min=1e-30))), 0.0).sum(-1)

    return torch.sqrt((0.5 * kl(p, m) + 0.5 * kl(q, m)).clamp(min=0))


def _coverage_keep(weights: torch.Tensor, coverage: float) -> torch.Tensor:
    """bool like ``weights [..., n]`` (non-negative, rows summing to 1): the shortest set of the
    largest entries whose sum reaches ``coverage``."""
    values, idx = torch.sort(weights, dim=-1, descending=True)
    before = torch.cumsum(values, -1) - values
    keep_sorted = before < coverage
    return torch.zeros_like(keep_sorted).scatter(-1, idx, keep_sorted)


def _offset_windows(keep_offsets: torch.Tensor, slash: torch.Tensor, nk: int):
    """Per block distance ``dist`` (0 .. nk-1): whether a kept offset lies in the offsets that cross
    a block at that distance, ``[128 dist - 127, 128 dist + 127]``, and the slash weight there."""
    hq, lk = slash.shape
    padded = nk * BLOCK + BLOCK
    hit = torch.zeros((hq, padded), dtype=torch.float32, device=slash.device)
    weight = torch.zeros((hq, padded), dtype=torch.float32, device=slash.device)
    hit[:, BLOCK - 1:BLOCK - 1 + lk] = keep_offsets.float()
    weight[:, BLOCK - 1:BLOCK - 1 + lk] = slash
    # Shifted by 127: window of distance dist covers positions [128 dist, 128 dist + 254] of the padded rows.
    hit_c = torch.nn.functional.pad(torch.cumsum(hit, -1), (1, 0))
    weight_c = torch.nn.functional.pad(torch.cumsum(weight, -1), (1, 0))
    starts = torch.arange(nk, device=slash.device) * BLOCK
    ends = (starts + 2 * BLOCK - 1).clamp(max=padded)
    return (hit_c[:, ends] - hit_c[:, starts]) > 0, weight_c[:, ends] - weight_c[:, starts]


def _global_coverage_mask(scores: torch.Tensor, coverage: float) -> torch.Tensor:
    """Per head, the highest blocks over the whole head's map until their sum reaches ``coverage``
    of the head's total (FlexPrefill's query-aware selection)."""
    hq, nq, nk = scores.shape
    flat = torch.where(torch.isfinite(scores), scores, 0.0).reshape(hq, -1)
    flat = flat / flat.sum(-1, keepdim=True).clamp(min=1e-30)
    return _coverage_keep(flat, coverage).reshape(hq, nq, nk) & torch.isfinite(scores)


PEERS = ("xattention", "flexprefill", "meanpool")


def peer_selection(name: str, q: torch.Tensor, k: torch.Tensor, *, stride: int = 8, xattn_threshold: float = 0.9,
                   flex_gamma: float = 0.9, flex_tau: float = 0.1, meanpool_top_p: float = 0.95,
                   softmax_scale: float | None = None):
    """``(ranking scores, the method's own mask)`` of one peer proxy (:data:`PEERS`)."""
    if name == "xattention":
        scores = xattention_scores(q, k, stride, softmax_scale)
        return scores, cumulative_mask(scores, xattn_threshold, k.shape[0] - q.shape[0])
    if name == "flexprefill":
        scores, mask, _ = flexprefill(q, k, gamma=flex_gamma, tau=flex_tau, softmax_scale=softmax_scale)
        return scores, mask
    if name == "meanpool":
        scores = mean_pooling_scores(q, k, softmax_scale)
        return scores, cumulative_mask(scores, meanpool_top_p, k.shape[0] - q.shape[0])
    raise ValueError(f"unknown peer proxy {name!r}; choose from {PEERS}")


# ----------------------------------------------------------------------------------------------
# Masks from scores, lists from masks, metrics
# ----------------------------------------------------------------------------------------------


def _with_forced(scores: torch.Tensor, prefix: int) -> torch.Tensor:
    """Ranking key with the sink and diagonal blocks first and the non-candidates last."""
    hq, nq, nk = scores.shape
    cand = candidate_mask(nq, nk, prefix, scores.device)
    key = torch.where(torch.isfinite(scores), scores, 0.0)
    key = torch.where(forced_mask(nq, nk, prefix, scores.device), math.inf, key)
    return key.masked_fill(~cand, -math.inf), cand


def _prefix_of(scores: torch.Tensor) -> int:
    """The prefix implied by a score map: the diagonal of row 0 is its last finite entry."""
    finite = torch.isfinite(scores[0, 0])
    return int(finite.nonzero().max()) * BLOCK


def cumulative_mask(scores: torch.Tensor, p: float, prefix: int | None = None) -> torch.Tensor:
    """Per (head, query block) row: the shortest set of the highest-scoring candidates whose sum
    reaches ``p`` of the row's total, plus the sink and diagonal blocks (KAP's rule 2.6 without
    HRM; XAttention's threshold; the oracle's top-p; mean pooling's top-p)."""
    prefix = _prefix_of(scores) if prefix is None else prefix
    hq, nq, nk = scores.shape
    cand = candidate_mask(nq, nk, prefix, scores.device)
    weights = torch.where(torch.isfinite(scores), scores, 0.0).clamp(min=0)
    weights = weights / weights.sum(-1, keepdim=True).clamp(min=1e-30)
    keep = _coverage_keep(weights, p) if p < 1.0 else cand.expand(hq, nq, nk).clone()
    return (keep | forced_mask(nq, nk, prefix, scores.device)) & cand


def budget_counts(nq: int, nk: int, prefix: int, budget: float, device=None) -> torch.Tensor:
    """Blocks per row at a matched budget: ``max(min(2, n), round(budget * n))``, ``n = P/128 + i + 1``."""
    n = (prefix // BLOCK + torch.arange(nq, device=device) + 1).float()
    return torch.maximum(torch.round(budget * n), n.clamp(max=2)).clamp(max=n).long()


def counts_mask(scores: torch.Tensor, counts: torch.Tensor, prefix: int | None = None) -> torch.Tensor:
    """``counts`` blocks in each (head, query block) row (``counts`` broadcasts to ``[Hq, nq]``), the
    sink and diagonal first, then the highest scores (ties: the lower block index); a count above a
    row's candidates keeps all of them."""
    prefix = _prefix_of(scores) if prefix is None else prefix
    hq, nq, nk = scores.shape
    key, cand = _with_forced(scores, prefix)
    idx = torch.sort(key, dim=-1, descending=True, stable=True).indices
    want = counts.to(scores.device).expand(hq, nq)
    keep_sorted = torch.arange(nk, device=scores.device)[None, None, :] < want[..., None]
    return torch.zeros_like(keep_sorted).scatter(-1, idx, keep_sorted) & cand


def budget_mask(scores: torch.Tensor, budget: float, prefix: int | None = None) -> torch.Tensor:
    """The same number of blocks per row for every method (:func:`budget_counts`), ranked as in
    :func:`counts_mask`."""
    prefix = _prefix_of(scores) if prefix is None else prefix
    hq, nq, nk = scores.shape
    return counts_mask(scores, budget_counts(nq, nk, prefix, budget, scores.device)[None, :], prefix)


def mask_to_lists(mask: torch.Tensor):
    """Block mask ``[Hq, nq, nk]`` -> OSK lists ``(order int32 [Hq, nq, nk], counts int32 [Hq, nq])``,
    ascending, -1 padded (one sequence: the row count is exactly ``nq``)."""
    nk = mask.shape[-1]
    j = torch.arange(nk, device=mask.device, dtype=torch.int32)
    key = torch.where(mask, j, nk)
    order = torch.sort(key, dim=-1).values
    order = torch.where(order == nk, -1, order).to(torch.int32)
    return order.contiguous(), mask.sum(-1, dtype=torch.int32)


def lists_to_mask(order: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """OSK lists -> block mask ``[Hq, rows, nk]``."""
    hq, rows, nk = order.shape
    listed = torch.arange(nk, device=order.device)[None, None, :] < counts[..., None]
    mask = torch.zeros((hq, rows, nk + 1), dtype=torch.bool, device=order.device)
    mask.scatter_(-1, torch.where(listed, order.long(), nk), listed)
    return mask[..., :nk]


def mask_metrics(mask: torch.Tensor, truth: torch.Tensor, mass: torch.Tensor | None = None) -> dict:
    """Fidelity of ``mask`` against a ground-truth mask (means over heads and query blocks):
    ``recall`` (share of the truth's blocks kept), ``iou``, ``budget`` (kept blocks over causal
    candidates) and, given the oracle mass, ``mass`` (share of the true attention mass kept)."""
    inter = (mask & truth).sum(-1).float()
    union = (mask | truth).sum(-1).float()
    true_n = truth.sum(-1).float()
    out = {"recall": float((inter / true_n.clamp(min=1)).mean()),
           "iou": float((inter / union.clamp(min=1)).mean())}
    if mass is not None:
        cand = torch.isfinite(mass)
        out["budget"] = float(mask.sum() / cand.expand_as(mask).sum().clamp(min=1))
        out["mass"] = float(torch.where(mask & cand, mass, 0.0).sum(-1).mean())
    else:
        out["budget"] = None
    return out


# ----------------------------------------------------------------------------------------------
# The structured-attention generator of bench/fidelity.py
# ----------------------------------------------------------------------------------------------

STRIPES_PER_HEAD = 4
SLASH_OFFSETS = (0, 64, 1000)
_SLASH_PERIODS = (64, 160, 400, 1000, 2500, 6000, 15000, 40000)


def structured_problem(seqlen: int, num_heads_q: int = 8, num_heads_kv: int = 2, head_dim: int = 128,
                       dtype=torch.bfloat16, device="cpu", seed: int = 0, scale_logit: float = 10.0,
                       stripes: bool = True, slashes: bool = True) -> dict:
    """One sequence of ``seqlen`` tokens with sinks, a local band and needles
    (``cosa.testing.random_problem(structure="mixed")``), plus vertical stripes and slash lines
    (module docstring). Returns ``random_problem``'s dict (pages in order, 128 tokens each) with
    ``stripes`` (key positions per KV head) and ``slash_offsets`` added."""
    base = testing.random_problem([seqlen], [seqlen], num_heads_q, num_heads_kv, head_dim, page_size=BLOCK,
                                  dtype=torch.float32, device="cpu", structure="mixed", seed=seed,
                                  shuffle_pages=False, scale_logit=scale_logit)
    q, k, v = (t.clone() for t in contiguous(base))
    gen = torch.Generator().manual_seed(seed + 104729)
    dirs = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen))[0].T
    group = num_heads_q // num_heads_kv
    pos = torch.arange(seqlen, dtype=torch.float32)
    stripe_positions: list[list[int]] = []
    next_dir = 0
    if slashes:
        # q_t . k_s gets f^2 * sum_w cos(w (t - o - s)): a ridge along t - s = o for each offset o,
        # of half the needles' logit.
        per_freq = len(_SLASH_PERIODS)
        f = math.sqrt(0.5 * scale_logit * math.sqrt(head_dim) / per_freq)
        for w in (2 * math.pi / period for period in _SLASH_PERIODS):
            a, c = dirs[next_dir % head_dim], dirs[(next_dir + 1) % head_dim]
            next_dir += 2
            k += f * (torch.cos(w * pos)[:, None, None] * a + torch.sin(w * pos)[:, None, None] * c)
            for o in SLASH_OFFSETS:
                q += f * (torch.cos(w * (pos - o))[:, None, None] * a + torch.sin(w * (pos - o))[:, None, None] * c)
    if stripes:
        # Single key tokens that the later queries of one KV head's query heads attend to, with the
        # needles' logit. Each stripe's direction is first projected out of that head's keys and
        # queries, so that the stripe adds its logit at its own key and nowhere else.
        amp = math.sqrt(scale_logit * math.sqrt(head_dim))
        for g in range(num_heads_kv):
            where = torch.randint(BLOCK, max(BLOCK + 1, seqlen - 1), (STRIPES_PER_HEAD,), generator=gen).tolist()
            stripe_positions.append(sorted(where))
            heads = slice(g * group, (g + 1) * group)
            for t in where:
                u = dirs[next_dir % head_dim]
                next_dir += 1
                k[:, g] -= (k[:, g] @ u)[:, None] * u
                q[:, heads] -= (q[:, heads] @ u)[..., None] * u
                k[t, g] += amp * u
                q[t + 1:, heads] += amp * u
    layout = paged_from_contiguous(q.to(dtype=dtype, device=device), k.to(dtype=dtype, device=device),
                                   v.to(dtype=dtype, device=device))
    layout["stripes"] = stripe_positions
    layout["slash_offsets"] = list(SLASH_OFFSETS) if slashes else []
    return layout


__all__ = [
    "budget_counts", "budget_mask", "candidate_mask", "contiguous", "counts_mask", "cumulative_mask", "flexprefill",
    "forced_mask", "kap_mask", "kap_rank", "kap_scores", "lists_to_mask", "mask_metrics", "mask_to_lists",
    "mean_pooling_scores", "oracle_mass", "peer_selection", "PEERS", "structured_problem",
    "xattention_scores",
]
