#!/usr/bin/env python3
"""Long contexts: KAP's lists against the reference past 1024 key blocks, and CoSA prefill at
512K-1M tokens with its time and peak memory.

Synthetic inputs (``cosa.testing.plant_structure(structure="mixed")`` on random queries and keys:
attention sinks, a local band and needles), generated on the GPU.

- ``lists`` rows (``--check-n``, default 160K and 256K tokens, a few heads; ``--check-proxies``,
  default both): ``cosa.kap`` against ``cosa.reference.kap`` on the same input, with each proxy
  precision. Past 1024 key blocks KAP's select kernel takes its one-CTA-per-list path; the rows give
  the share of lists identical to the reference's, the IoU of the kept sets and the largest
  difference in list length. The native proxy must match the reference list for list (at most one
  block apart). The e4m3 proxy cannot: the tensor cores add e4m3 products in an accumulator
  narrower than float32, so blocks whose scores lie within about 1% of one another trade places
  at the top-p cut (at 160K tokens a list's swapped blocks differ by under 1% in the reference's
  score, and every list covers at least top-p of the reference's total). Its lists are checked as
  kept sets under the reference's e4m3 scores, each score comparison within a relative slack of
  1e-2: they hold the forced blocks, reach top-p of the candidates' total, drop no block that
  outscores a kept one that was not forced, and without their smallest such block they would
  fall short of top-p. At least 97% of the lists must pass, with a mean IoU of at least 0.97;
  ``kept_mass_min`` is the smallest share of the reference's total that a list covers.
- ``prefill`` rows (``--n``, default 512K and 1M tokens; Hq 32, Hkv 8, d 128, bf16, page 128):
  ``cosa.prefill`` with the defaults (device checks on), the KAP part alone, the stage-1 and
  realised budgets, and the memory one call allocates beyond its inputs (``out`` and ``order`` are
  8 GiB each at 1M tokens; ``order`` grows with the square of the length). The output rows of a
  sample of query blocks of the first and the last query head are checked against
  ``cosa.reference.osk`` on the kernel's own lists, with the skip off (``cosa.osk`` once more, delta
  0: the check must not hinge on votes at the threshold) and, for information, with it on (the last
  head's lists sit past 2^31 elements of ``order`` at 1M tokens).
- ``dense`` rows: cuDNN SDPA up to ``--dense-max`` tokens, for scale.

    python bench/long_context.py [--n 524288 1048576] [--check-n 163840 262144]
                                 [--check-proxies native fp8] [--dense-max 524288] [--plot] [--out bench/results]
"""

from __future__ import annotations

import gc
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (REPO_ROOT, argument_parser, cuda_event_median_ms, finish_report, format_table, progress,  # noqa: E402
                    require_cuda, save_figure,
                    start_run, write_json)

BLOCK = 128
PREFILL_SHAPE = {"hq": 32, "hkv": 8, "d": 128, "dtype": "bfloat16", "page_size": 128}
CHECK_SHAPE = {"hq": 4, "hkv": 1, "d": 128, "dtype": "bfloat16", "page_size": 128}
SCALE_LOGIT = 10.0  # the planted logits' size, as cosa.testing.random_problem plants them
SAMPLED_BLOCKS = 16  # query blocks of each checked head compared with float32 attention
TOLERANCE = 2e-2  # largest absolute error of a checked output row against the reference (bf16 output)
FP8_SCORE_SLACK = 1e-2  # relative slack on the e4m3 proxy's score comparisons at long lengths
FP8_MIN_VALID = 0.97  # share of e4m3 lists that must be valid kept sets under the reference's scores
FP8_MIN_IOU = 0.97  # mean IoU of the e4m3 kept sets with the reference's


def structured_input(n: int, hq: int, hkv: int, d: int, seed: int, device: str = "cuda"):
    """One sequence of n tokens, built on ``device``: q, k_cache, v_cache, page_table (pages in order)."""
    import cosa.testing as testing

    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn((n, hq, d), generator=gen, device=device)
    k = torch.randn((n, hkv, d), generator=gen, device=device)
    pos = torch.arange(n, dtype=torch.float32, device=device)
    testing.plant_structure(q, k, pos, pos, "mixed", torch.Generator().manual_seed(seed), SCALE_LOGIT)
    q = q.to(torch.bfloat16)
    k = k.to(torch.bfloat16)
    v = torch.randn((n, hkv, d), generator=gen, device=device, dtype=torch.bfloat16)
    pages = math.ceil(n / BLOCK)
    pad = pages * BLOCK - n
    k_cache = F.pad(k, (0, 0, 0, 0, 0, pad)).view(pages, BLOCK, hkv, d)
    v_cache = F.pad(v, (0, 0, 0, 0, 0, pad)).view(pages, BLOCK, hkv, d)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache,
                page_table=torch.arange(pages, dtype=torch.int32, device=device)[None],
                cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
                seqused_k=torch.tensor([n], dtype=torch.int32, device=device), max_seqlen_q=n, max_seqlen_k=n)


def kept_sets(order, key_blocks: int) -> torch.Tensor:
    """Boolean ``[Hq, nq, key_blocks]``: the blocks each list holds."""
    kept = torch.zeros((*order.shape[:2], key_blocks + 1), dtype=torch.bool, device=order.device)
    kept.scatter_(2, torch.where(order < 0, key_blocks, order).long(), True)
    return kept[..., :key_blocks]


def list_agreement(order, counts, ref_order, ref_counts) -> dict:
    """Share of identical lists, mean IoU of the kept sets, and the largest count difference."""
    nk = order.shape[2]
    same = (counts == ref_counts) & (order == ref_order).all(-1)
    kept, kept_ref = kept_sets(order, nk), kept_sets(ref_order, nk)
    iou = (kept & kept_ref).sum(-1) / (kept | kept_ref).sum(-1).clamp(min=1)
    return {"lists_identical": float(same.float().mean()), "iou_mean": float(iou.mean()),
            "iou_min": float(iou.min()), "max_count_diff": int((counts - ref_counts).abs().max())}


def valid_kept_sets(order, scores, hrm, prefix: int, top_p: float,
                    slack: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per list, whether its kept set is a stage-1 set (spec section 2) under ``scores`` / ``hrm``
    with every score comparison allowed a relative ``slack``: it holds every forced candidate (HRM,
    sink, diagonal), reaches top_p of the candidates' total, no dropped candidate outscores a kept
    block that was not forced, and without its smallest such block it would fall short of top_p;
    and the share of the candidates' total that the list keeps."""
    nq, nk = scores.shape[1:]
    candidate = scores != -math.inf
    s = torch.where(candidate, scores, 0.0).double()
    kept = kept_sets(order, nk)
    j = torch.arange(nk, device=scores.device)
    diagonal = prefix // BLOCK + torch.arange(nq, device=scores.device)
    forced = hrm | (j == 0) | (j[None, :] == diagonal[:, None])
    total = s.sum(-1)
    kept_mass = (s * kept).sum(-1)
    free = kept & ~forced & candidate
    smallest_free = torch.where(free, s, math.inf).amin(-1)
    largest_dropped = torch.where(candidate & ~kept, s, -math.inf).amax(-1)
    reaches = kept_mass >= top_p * total * (1 - slack)
    no_better_dropped = largest_dropped <= smallest_free * (1 + slack)
    # The prefix: the HRM blocks, the free ones, and the sink and diagonal blocks that rank above its
    # smallest free block (the others may be appended past it).
    in_prefix = kept & (hrm | ~forced | (s >= smallest_free[..., None]))
    prefix_mass = (s * in_prefix).sum(-1)
    shortest = ~free.any(-1) | (prefix_mass - smallest_free < top_p * total * (1 + slack))
    holds_forced = ~(forced & candidate & ~kept).any(-1)
    return holds_forced & reaches & no_better_dropped & shortest, kept_mass / total


def check_lists(cosa, n: int, seed: int, proxy: str) -> dict:
    from cosa import defaults, reference

    shape = CHECK_SHAPE
    p = structured_input(n, shape["hq"], shape["hkv"], shape["d"], seed)
    args = [p[name] for name in ("q", "k_cache", "page_table", "cu_seqlens_q", "seqused_k")]
    ms = cuda_event_median_ms(lambda: cosa.kap(*args, n, n, proxy_precision=proxy), warmup=1, reps=1)
    order, counts = cosa.kap(*args, n, n, proxy_precision=proxy)
    ref_order, ref_counts = reference.kap(*args, n, n, proxy_precision=proxy)
    row = {"kind": "lists", "impl": f"kap-{proxy}-vs-reference", "proxy": proxy, "n": n,
           "key_blocks": math.ceil(n / BLOCK), "kap_ms": ms, **list_agreement(order, counts, ref_order, ref_counts),
           "stage1_budget": float(counts.float().mean() / ((math.ceil(n / BLOCK) + 1) / 2))}
    if proxy == "native":
        row["ok"] = row["max_count_diff"] <= 1 and row["iou_min"] >= 0.9
    else:
        scores, hrm = reference.kap_scores(*args, n, n, proxy_precision=proxy)
        valid, kept_share = valid_kept_sets(order, scores, hrm, 0, defaults.TOP_P, FP8_SCORE_SLACK)
        row["valid_lists"] = float(valid.float().mean())
        row["kept_mass_min"] = float(kept_share.min())
        row["ok"] = row["valid_lists"] >= FP8_MIN_VALID and row["iou_mean"] >= FP8_MIN_IOU
    return row


def reference_blocks(cosa, p, order, counts, head: int, blocks, delta: float) -> torch.Tensor:
    """``cosa.reference.osk`` (float32) with skip scale ``delta`` on query blocks ``blocks`` of
    ``head``, each a sequence of its own over the same cache and the kernel's lists: ``[rows, d]``."""
    n = p["max_seqlen_q"]
    group = p["q"].shape[1] // p["k_cache"].shape[2]
    spans = [(i * BLOCK, min(n, (i + 1) * BLOCK)) for i in blocks]
    q = torch.cat([p["q"][a:b, head: head + 1] for a, b in spans])
    lens = [b - a for a, b in spans]
    device = p["q"].device
    cu = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
    kv_head = slice(head // group, head // group + 1)
    out, _, _ = cosa.reference.osk(
        q, p["k_cache"][:, :, kv_head], p["v_cache"][:, :, kv_head], p["page_table"].expand(len(blocks), -1),
        cu, torch.tensor([b for _, b in spans], dtype=torch.int32, device=device),
        order[head: head + 1, blocks].contiguous(), counts[head: head + 1, blocks].contiguous(), BLOCK, delta=delta)
    return out[:, 0]


def sampled_error(cosa, p, out, order, counts, blocks, delta: float) -> float:
    """Largest absolute difference between ``out`` and the reference on the sampled query blocks of
    the first and the last query head."""
    n = p["max_seqlen_q"]
    worst = 0.0
    for head in (0, p["q"].shape[1] - 1):
        ref = reference_blocks(cosa, p, order, counts, head, blocks, delta)
        got = torch.cat([out[i * BLOCK: min(n, (i + 1) * BLOCK), head] for i in blocks])
        worst = max(worst, float((got.float() - ref.float()).abs().max()))
    return worst


def prefill_row(cosa, n: int, seed: int, reps: int) -> dict:
    shape = PREFILL_SHAPE
    progress(f"prefill {n}: building the input on the GPU")
    p = structured_input(n, shape["hq"], shape["hkv"], shape["d"], seed)
    args = [p[name] for name in ("q", "k_cache", "v_cache", "page_table", "cu_seqlens_q", "seqused_k")] + [n, n]
    kap_args = [p[name] for name in ("q", "k_cache", "page_table", "cu_seqlens_q", "seqused_k")] + [n, n]
    progress(f"prefill {n}: timing cosa.prefill and cosa.kap ({reps} timed calls each after one warm-up)")
    ms = cuda_event_median_ms(lambda: cosa.prefill(*args), warmup=1, reps=reps)
    kap_ms = cuda_event_median_ms(lambda: cosa.kap(*kap_args), warmup=1, reps=reps)
    # One more call alone, for the memory it allocates beyond its inputs (out, lse, the lists, workspace).
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, stats = cosa.prefill(*args, return_stats=True)
    torch.cuda.synchronize()
    peak_extra = torch.cuda.max_memory_allocated() - base
    nq = math.ceil(n / BLOCK)
    blocks = sorted({0, nq - 1, *torch.linspace(0, nq - 1, SAMPLED_BLOCKS).round().long().tolist()})
    order, counts = stats["order"], stats["counts"]
    # With the skip on, a block whose maximum sits at the threshold may be voted out by one side
    # and kept by the other (float rounding), which moves a row by up to that block's weight; the
    # check that decides therefore runs OSK again on the same lists with the skip off.
    skip_on_err = sampled_error(cosa, p, out, order, counts, blocks, cosa.defaults.DELTA)
    out_dense_lists, _, _ = cosa.osk(*args[:6], order, counts, n, delta=0.0)
    worst = sampled_error(cosa, p, out_dense_lists, order, counts, blocks, 0.0)
    del out_dense_lists
    row = {"kind": "prefill", "impl": "cosa", "n": n, "ms": ms, "kap_ms": kap_ms,
           "kap_share": kap_ms / ms, "stage1_budget": stats["stage1_budget"],
           "realised_budget": stats["realised_budget"], "peak_extra_gib": peak_extra / 2**30,
           "out_gib": out.numel() * out.element_size() / 2**30, "order_gib": stats["order"].numel() * 4 / 2**30,
           "inputs_gib": base / 2**30, "max_abs_err_sampled": worst, "max_abs_err_sampled_skip_on": skip_on_err,
           "ok": worst <= TOLERANCE and bool(torch.isfinite(out).all())}
    del out, stats, order, counts, p
    return row


def dense_row(n: int, seed: int, reps: int) -> dict:
    shape = PREFILL_SHAPE
    p = structured_input(n, shape["hq"], shape["hkv"], shape["d"], seed)
    group = shape["hq"] // shape["hkv"]
    q = p["q"].transpose(0, 1)[None]
    k = p["k_cache"].flatten(0, 1)[:n].transpose(0, 1)[None].repeat_interleave(group, 1)
    v = p["v_cache"].flatten(0, 1)[:n].transpose(0, 1)[None].repeat_interleave(group, 1)
    del p

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    ms = cuda_event_median_ms(run, warmup=1, reps=reps)
    return {"kind": "dense", "impl": "sdpa-cudnn", "n": n, "ms": ms, "ok": True}


def plot(rows, path) -> bool:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    for kind, impl, key in (("prefill", "cosa", "ms"), ("prefill", "cosa", "kap_ms"), ("dense", "sdpa-cudnn", "ms")):
        pts = [(r["n"], r[key]) for r in rows if r["kind"] == kind and r["impl"] == impl and key in r]
        if pts:
            label = "KAP (part of CoSA)" if key == "kap_ms" else impl
            ax_t.plot(*zip(*pts), marker="o", label=label)
    ax_t.set(xscale="log", yscale="log", xlabel="tokens", ylabel="ms", title="prefill time (synthetic input)")
    ax_t.legend()
    pts = [(r["n"], r["peak_extra_gib"], r["order_gib"]) for r in rows if r["kind"] == "prefill"]
    if pts:
        ns, peak, order = zip(*pts)
        ax_m.plot(ns, peak, marker="o", label="allocated by prefill")
        ax_m.plot(ns, order, marker="s", label="of which the order lists")
    ax_m.set(xscale="log", xlabel="tokens", ylabel="GiB", title="memory beyond the inputs")
    ax_m.legend()
    return save_figure(fig, path)


def main(argv=None) -> int:
    ap = argument_parser(__doc__)
    ap.add_argument("--n", type=int, nargs="*", default=[524288, 1048576], help="prefill lengths")
    ap.add_argument("--check-n", type=int, nargs="*", default=[163840, 262144],
                    help="lengths at which KAP's lists are compared with the reference")
    ap.add_argument("--check-proxies", nargs="*", default=["native", "fp8"], choices=["native", "fp8"],
                    help="proxy precisions whose lists are compared with the reference")
    ap.add_argument("--dense-max", type=int, default=524288, help="time cuDNN dense up to this length")
    ap.add_argument("--reps", type=int, default=2, help="timed calls per row (after one warm-up)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--out", default=str(REPO_ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    for name in ("n", "check_n"):
        if any(x < BLOCK for x in getattr(args, name)):
            ap.error(f"--{name.replace('_', '-')} values must be at least {BLOCK}")
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    require_cuda("bench/long_context.py")
    sys.path.insert(0, str(REPO_ROOT))
    import cosa

    if not cosa.cuda_kernels_available():
        print(f"bench/long_context.py needs cosa's CUDA kernels (cosa._C: {cosa._C_IMPORT_ERROR or 'built without them'})",
              file=sys.stderr)
        return 2
    meta, json_path = start_run(args.out, "long-context")
    rows, failures = [], []

    def save():
        write_json(json_path, {**meta, "prefill_shape": PREFILL_SHAPE, "check_shape": CHECK_SHAPE,
                               "input": "synthetic: random q, k, v with planted sinks, band and needles",
                               "rows": rows})

    steps = [(f"lists-{proxy}", n) for n in args.check_n for proxy in args.check_proxies] + [("prefill", n) for n in args.n] + \
            [("dense", n) for n in args.n if n <= args.dense_max]
    for kind, n in steps:
        progress(f"{kind} at {n} tokens")
        try:
            if kind.startswith("lists-"):
                row = check_lists(cosa, n, args.seed, kind.removeprefix("lists-"))
            elif kind == "prefill":
                row = prefill_row(cosa, n, args.seed, args.reps)
            else:
                row = dense_row(n, args.seed, args.reps)
        except torch.cuda.OutOfMemoryError as error:
            row = {"kind": kind.split("-")[0], "n": n, "ok": False, "error": f"out of memory: {str(error).splitlines()[0]}"}
        if not row["ok"]:
            failures.append(f"{kind} at {n}: {row.get('error', 'check failed')}")
        rows.append(row)
        save()
        gc.collect()
        torch.cuda.empty_cache()
    if args.plot:
        plot(rows, json_path.with_suffix(".png"))
    columns = ["kind", "impl", "n", "ms", "kap_ms", "kap_share", "stage1_budget", "realised_budget",
               "peak_extra_gib", "order_gib", "max_abs_err_sampled", "max_abs_err_sampled_skip_on", "lists_identical", "iou_mean", "iou_min",
               "max_count_diff", "valid_lists", "kept_mass_min", "ok"]
    print(format_table(rows, columns))
    return finish_report(json_path, failures)


if __name__ == "__main__":
    sys.exit(main())
