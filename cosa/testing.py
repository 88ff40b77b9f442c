"""Inputs for tests, benchmarks and the demo: paged KV caches and attention with known structure.

``random_problem(structure=...)`` plants the patterns that long-context attention shows (and that a
block-sparse method must not lose) on top of random queries and keys:

- ``"sinks"``: the first tokens of each sequence attract every query (attention sinks);
- ``"band"``: logits fall with distance (a local band along the diagonal), made with slowly rotating
  position features shared by queries and keys, as rotary embeddings do;
- ``"needles"``: a few short spans of keys (16 tokens) anywhere in the context that every later query
  of one KV head's query heads matches strongly;
- ``"mixed"``: all three.
The planted logits are far above the random ones (several units of scaled logit), so the blocks
that hold them have clear margins for the tests.
"""

from __future__ import annotations

import math

import torch

from .reference import cdiv

STRUCTURES = (None, "sinks", "band", "needles", "mixed")
NEEDLE_TOKENS = 16


def paged_kv(k, v, seqlens_k, page_size, shuffle=True, generator=None):
    """Scatter packed ``k, v [total_k, Hkv, d]`` into a paged cache.

    Returns ``(k_cache, v_cache, page_table)``: caches ``[num_pages, page_size, Hkv, d]`` and an int32
    ``page_table [B, max_pages]`` whose unused entries are -1 (a kernel must never read them). With
    ``shuffle`` the pages are laid out in a random permutation."""
    seqlens_k = [int(x) for x in seqlens_k]
    pages_per_seq = [cdiv(n, page_size) for n in seqlens_k]
    num_pages = sum(pages_per_seq)
    hkv, d = k.shape[1], k.shape[2]
    if shuffle:
        physical = torch.randperm(num_pages, generator=generator)
    else:
        physical = torch.arange(num_pages)
    k_cache = torch.zeros((num_pages, page_size, hkv, d), dtype=k.dtype, device=k.device)
    v_cache = torch.zeros_like(k_cache)
    page_table = torch.full((len(seqlens_k), max(pages_per_seq + [1])), -1, dtype=torch.int32)
    token0, page0 = 0, 0
    for b, (n, npages) in enumerate(zip(seqlens_k, pages_per_seq)):
        ids = physical[page0:page0 + npages]
        page_table[b, :npages] = ids.to(torch.int32)
        padded = npages * page_size
        for cache, src in ((k_cache, k), (v_cache, v)):
            block = torch.zeros((padded, hkv, d), dtype=k.dtype, device=k.device)
            block[:n] = src[token0:token0 + n]
            cache[ids.to(k.device)] = block.reshape(npages, page_size, hkv, d)
        token0 += n
        page0 += npages
    return k_cache, v_cache, page_table.to(k.device)


def plant_structure(q, k, q_pos, k_pos, structure, generator, scale_logit):
    """Add the planted patterns to float32 q [Lq, Hq, d] and k [Lk, Hkv, d] of one sequence, in
    place, on their device (``q_pos``, ``k_pos``: the positions, float32 on that device; the random
    choices come from the CPU ``generator``); returns the needles planted, as (first key token, last
    key token, KV head)."""
    d = q.shape[-1]
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    # A planted pair (a in q, b in k along one unit direction) adds a*b/sqrt(d) to the logit.
    amp = math.sqrt(scale_logit * math.sqrt(d))
    kinds = ("sinks", "band", "needles") if structure == "mixed" else (structure,)
    dirs = torch.linalg.qr(torch.randn(d, d, generator=generator))[0].T.to(q.device)  # orthonormal directions
    next_dir = 0
    if "sinks" in kinds:
        u = dirs[next_dir]
        next_dir += 1
        k[:4] += amp * u
        q += amp * u
    if "band" in kinds:
        # Position features cos/sin(w t) in a 2-D plane per frequency: q_t.k_s ~ sum cos(w (t - s)).
        # Several periods (as rotary embeddings have) so that the sum peaks at distance 0 only.
        periods = (256, 1024, 4096, 16384)
        for period in periods:
            w = 2 * math.pi / period
            a, c = dirs[next_dir], dirs[next_dir + 1]
            next_dir += 2
            f = amp / math.sqrt(len(periods))
            q += f * (torch.cos(w * q_pos)[:, None, None] * a + torch.sin(w * q_pos)[:, None, None] * c)
            k += f * (torch.cos(w * k_pos)[:, None, None] * a + torch.sin(w * k_pos)[:, None, None] * c)
    needles = []
    if "needles" in kinds:
        # A needle is a short span (a sentence of a few tokens), as in needle-in-a-haystack prompts.
        for pos in torch.randint(0, max(1, k.shape[0] - NEEDLE_TOKENS), (3,), generator=generator).tolist():
            u = dirs[next_dir]
            next_dir += 1
            head = int(torch.randint(0, hkv, (1,), generator=generator))
            k[pos:pos + NEEDLE_TOKENS, head] += amp * u
            later = q_pos >= pos + NEEDLE_TOKENS
            q[later, head * group:(head + 1) * group] += amp * u
            needles.append((pos, min(pos + NEEDLE_TOKENS, k.shape[0]) - 1, head))
    return needles


def random_problem(seqlens_q, seqlens_k, num_heads_q, num_heads_kv, head_dim, page_size=128,
                   dtype=torch.bfloat16, device="cpu", structure=None, seed=0, shuffle_pages=True,
                   scale_logit=10.0, return_needles=False):
    """A packed, paged attention problem (spec section 1) with random or structured content.

    Returns a dict with q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q,
    max_seqlen_k (the keyword arguments of ``cosa.prefill``); with ``return_needles=True``, also
    the planted needles as a list of (sequence, first key token, last key token, KV head), key
    tokens counted from the sequence's first key (prefix included)."""
    if structure not in STRUCTURES:
        raise ValueError(f"structure must be one of {STRUCTURES}, got {structure!r}")
    if len(seqlens_q) != len(seqlens_k):
        raise ValueError("seqlens_q and seqlens_k must have the same length")
    gen = torch.Generator().manual_seed(seed)
    qs, ks, vs, needles = [], [], [], []
    for b, (lq, lk) in enumerate(zip(seqlens_q, seqlens_k)):
        q = torch.randn((lq, num_heads_q, head_dim), generator=gen)
        k = torch.randn((lk, num_heads_kv, head_dim), generator=gen)
        v = torch.randn((lk, num_heads_kv, head_dim), generator=gen)
        if structure is not None:
            q_pos = torch.arange(lk - lq, lk, dtype=torch.float32)
            k_pos = torch.arange(lk, dtype=torch.float32)
            needles += [(b, *needle) for needle in plant_structure(q, k, q_pos, k_pos, structure, gen, scale_logit)]
        qs.append(q)
        ks.append(k)
        vs.append(v)
    q = torch.cat(qs).to(dtype=dtype, device=device)
    k = torch.cat(ks).to(dtype=dtype, device=device)
    v = torch.cat(vs).to(dtype=dtype, device=device)
    k_cache, v_cache, page_table = paged_kv(k, v, seqlens_k, page_size, shuffle=shuffle_pages, generator=gen)
    cu = torch.tensor([0] + list(seqlens_q), dtype=torch.int64).cumsum(0).to(torch.int32)
    problem = dict(
        q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table.to(device),
        cu_seqlens_q=cu.to(device), seqused_k=torch.tensor(list(seqlens_k), dtype=torch.int32, device=device),
        max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k),
    )
    return (problem, needles) if return_needles else problem
