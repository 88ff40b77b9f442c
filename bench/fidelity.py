#!/usr/bin/env python3
"""Proxy fidelity: how well KAP and the peers' proxies find the blocks that matter, and what the
in-kernel skip gains from KAP's order (the paper's Figure 2 and Figure 6).

Inputs: the structured-attention generator of ``proxies.structured_problem`` (sinks, a local
band, needles, vertical stripes, slash lines; documented there) at each ``--n``, and, with
``--model``, the post-RoPE Q/K/V that a real model computes on a long text, captured from chosen
layers through transformers' attention-function registry.

Sections (rows of the JSON and the table):
  mask   per method (oracle, kap, xattention, flexprefill, meanpool):
           selection "budget":  the same number of blocks per row for every method (matched
                                budgets, proxies.budget_mask), ranked by the method's scores;
           selection "natural": the method's own rule (KAP's top-p lists, XAttention's threshold,
                                FlexPrefill's gamma, mean pooling's top-p, the oracle's top-p).
         recall  = share of the oracle's top-p blocks kept; iou = IoU with the oracle's mask at the
         same budget ("budget") or with its top-p mask ("natural"); mass = share of the exact
         attention mass kept; rel_err = ||OSK(mask, no skip) - dense|| / ||dense||.
  skip   KAP's lists at --top-p run through OSK with each --deltas value, visited in KAP's order
         and in ascending block order (the same blocks): skip_ratio = skipped / visited blocks,
         realised budget and output error against dense. KAP's order should skip more at the
         same error.

    python bench/fidelity.py [--n 8192 32768] [--heads 32 8] [--head-dim 128] [--budgets ...]
                             [--deltas ...] [--model DIR|FILE.gguf --model-n 8192 --model-layers 0,9,18,27]
                             [--text-dir DIR] [--device auto|cuda|cpu] [--plot] [--out bench/results]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import (add_run_arguments, argument_parser, format_table, progress, relative_error,  # noqa: E402
                    resolve_device, save_figure, start_run, write_json)

import cosa  # noqa: E402
import proxies  # noqa: E402
from cosa import reference  # noqa: E402
from cosa.layout import kap_layout_args, paged_from_contiguous  # noqa: E402

METHODS = ("oracle", "kap", "xattention", "flexprefill", "meanpool")
MASK_COLUMNS = ("source", "n", "layer", "method", "selection", "budget", "recall", "iou", "mass", "rel_err")
SKIP_COLUMNS = ("source", "n", "layer", "order", "delta", "stage1", "realised", "skip_ratio", "rel_err")


# ---------------------------------------------------------------------------------------------
# One attention problem: q [L, Hq, d], k, v [L, Hkv, d] (one sequence, causal)
# ---------------------------------------------------------------------------------------------


def run_osk(layout: dict, order, counts, delta: float):
    """OSK on one sequence: the CUDA kernel when the inputs are on a GPU and it is built, else the
    reference (the ops' CPU path)."""
    args = (layout["q"], layout["k_cache"], layout["v_cache"], layout["page_table"], layout["cu_seqlens_q"],
            layout["seqused_k"], order, counts, layout["max_seqlen_q"])
    if layout["q"].is_cuda and cosa.cuda_kernels_available():
        return cosa.osk(*args, delta=delta)
    return reference.osk(*args, delta=delta)


def method_scores(name: str, q, k, mass, args):
    """(ranking scores, natural mask) of one method."""
    if name == "oracle":
        return mass, proxies.cumulative_mask(mass, args.oracle_p)
    if name == "kap":
        s, h = proxies.kap_scores(q, k, args.stride)
        return proxies.kap_rank(s, h), proxies.kap_mask(q, k, args.stride, args.top_p)
    return proxies.peer_selection(name, q, k, stride=args.stride, xattn_threshold=args.xattn_threshold,
                                  flex_gamma=args.flex_gamma, flex_tau=args.flex_tau,
                                  meanpool_top_p=args.meanpool_top_p)


def evaluate(q, k, v, source: str, layer, args) -> list[dict]:
    """Mask rows and skip rows of one attention problem."""
    n = q.shape[0]
    base = {"source": source, "n": n, "layer": layer}
    layout = paged_from_contiguous(q, k, v)
    dense_out = None
    if not args.no_error:
        dense_out, _ = reference.dense_attention(layout["q"], layout["k_cache"], layout["v_cache"],
                                                 layout["page_table"], layout["cu_seqlens_q"], layout["seqused_k"])
    mass = proxies.oracle_mass(q, k)
    truth = proxies.cumulative_mask(mass, args.oracle_p)
    prefix = 0
    oracle_at = {b: proxies.budget_mask(mass, b, prefix) for b in args.budgets}
    rows = []

    def error(mask):
        if dense_out is None:
            return None
        out, _, _ = run_osk(layout, *proxies.mask_to_lists(mask), 0.0)
        return relative_error(out, dense_out)

    for name in METHODS:
        if name not in args.methods:
            continue
        scores, natural = method_scores(name, q, k, mass, args)
        for b in args.budgets:
            mask = proxies.budget_mask(scores, b, prefix)
            m = proxies.mask_metrics(mask, truth, mass)
            m["iou"] = proxies.mask_metrics(mask, oracle_at[b])["iou"]
            rows.append({**base, "section": "mask", "method": name, "selection": "budget", "target_budget": b,
                         **m, "rel_err": error(mask)})
        m = proxies.mask_metrics(natural, truth, mass)
        rows.append({**base, "section": "mask", "method": name, "selection": "natural", **m,
                     "rel_err": error(natural)})
        progress(f"  {source} n={n} layer={layer} {name}: natural budget {m['budget']:.3f}, "
                 f"recall {m['recall']:.3f}, mass {m['mass']:.3f}")
        del scores, natural

    if dense_out is not None and args.deltas:
        rows += skip_rows(q, k, layout, dense_out, base, args)
    return rows


def skip_rows(q, k, layout, dense_out, base: dict, args) -> list[dict]:
    """KAP's lists at --top-p through OSK at each delta, in KAP's order and ascending."""
    order, counts = reference.kap(*kap_layout_args(layout), stride=args.stride, top_p=args.top_p)
    ascending, _ = proxies.mask_to_lists(proxies.lists_to_mask(order, counts))
    n = q.shape[0]
    nq = reference.cdiv(n, reference.BLOCK)
    causal = q.shape[1] * nq * (nq + 1) // 2
    visited = int(counts.sum())
    rows = []
    for delta in [0.0] + list(args.deltas):
        for label, lists in (("kap", order), ("ascending", ascending)):
            out, _, skipped = run_osk(layout, lists, counts, delta)
            skipped = int(skipped.sum())
            rows.append({**base, "section": "skip", "order": label, "delta": delta, "top_p": args.top_p,
                         "stage1": visited / causal, "realised": (visited - skipped) / causal,
                         "skip_ratio": skipped / visited, "rel_err": relative_error(out, dense_out),
                         "skip_active": 0 < delta < n})
        kap_row, asc_row = rows[-2], rows[-1]
        progress(f"  {base['source']} n={n} layer={base['layer']} delta={delta:g}: skip ratio "
                 f"kap {kap_row['skip_ratio']:.3f} (err {kap_row['rel_err']:.2e}) vs ascending "
                 f"{asc_row['skip_ratio']:.3f} (err {asc_row['rel_err']:.2e})")
    return rows


# ---------------------------------------------------------------------------------------------
# Q/K/V captured from a real model
# ---------------------------------------------------------------------------------------------


def capture_qkv(model, input_ids, layers) -> dict:
    """Post-RoPE (q, k, v) ``[L, H, d]`` of batch row 0 at each layer in ``layers``, from one
    forward pass whose attention runs through SDPA."""
    from cosa.integrations.transformers import AttentionOverride, sdpa_attention

    dense = sdpa_attention()
    captured = {}

    def attention(module, query, key, value, attention_mask, **kwargs):
        layer = getattr(module, "layer_idx", None)
        if layer in layers:
            captured[layer] = tuple(t[0].transpose(0, 1).contiguous() for t in (query, key, value))
        return dense(module, query, key, value, attention_mask, **kwargs)

    with torch.no_grad(), AttentionOverride(model, attention):
        model(input_ids, use_cache=False, logits_to_keep=1)
    return captured


def model_rows(args) -> list[dict]:
    from accuracy_tasks import haystack_token_ids
    from models import load_model

    progress(f"loading {args.model}")
    model, tokenizer, name = load_model(args.model, args.device, torch.bfloat16)
    ids = haystack_token_ids(tokenizer, args.text_dir, args.model_n, seed=args.seed)
    ids = torch.tensor([ids], device=args.device)
    num_layers = model.config.num_hidden_layers
    layers = args.model_layers if args.model_layers else sorted({0, num_layers // 3, 2 * num_layers // 3,
                                                                 num_layers - 1})
    progress(f"{name}: capturing layers {layers} at {ids.shape[1]} tokens")
    captured = capture_qkv(model, ids, set(layers))
    del model
    rows = []
    for layer in layers:
        q, k, v = captured.pop(layer)
        if q.shape[-1] not in (64, 128):
            raise ValueError(f"head dim {q.shape[-1]} is not supported by cosa (64 or 128)")
        rows += evaluate(q, k, v, f"model:{name}", layer, args)
    return rows


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def _mean_by(rows, key, value):
    """Sorted ``(key, mean of value)`` pairs over ``rows``."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(r[key], []).append(r[value])
    return sorted((k, sum(v) / len(v)) for k, v in groups.items())


def plot(rows, path: Path) -> bool:
    """One row of panels per source (and n): IoU with the oracle at matched budgets per method; the
    skip ratio against delta per visiting order; and the Figure 6 view, output error against skip
    ratio per order. Each point is the mean over the source's layers."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sources = list(dict.fromkeys((r["source"], r["n"]) for r in rows))
    fig, axes = plt.subplots(len(sources), 3, figsize=(16, 4.5 * len(sources)), squeeze=False)
    for (source, n), (ax_iou, ax_skip, ax_err) in zip(sources, axes, strict=True):
        here = [r for r in rows if (r["source"], r["n"]) == (source, n)]
        layers = sorted({r["layer"] for r in here}, key=lambda x: -1 if x is None else x)
        where = f"{source.removeprefix('model:')}, n={n}" + (
            "" if layers == [None] else f", mean of layers {','.join(map(str, layers))}")
        for method in METHODS:
            pts = _mean_by([r for r in here if r["section"] == "mask" and r["selection"] == "budget"
                            and r["method"] == method], "target_budget", "iou")
            if pts:
                ax_iou.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax_iou.set_title(f"{where}\nIoU with the oracle at matched budgets", fontsize=9)
        ax_iou.set_xlabel("budget (fraction of causal blocks)")
        ax_iou.set_ylabel("IoU")
        skip = [r for r in here if r["section"] == "skip" and r["delta"] > 0]
        for label in ("kap", "ascending"):
            mine = [r for r in skip if r["order"] == label]
            ratio, err = _mean_by(mine, "delta", "skip_ratio"), _mean_by(mine, "delta", "rel_err")
            if ratio:
                ax_skip.plot([p[0] for p in ratio], [p[1] for p in ratio], marker="o", label=f"{label} order")
                ax_err.plot([p[1] for p in ratio], [p[1] for p in err], marker="o", label=f"{label} order")
        ax_skip.set_title("in-kernel skip ratio against delta", fontsize=9)
        ax_skip.set_xscale("log")
        ax_skip.set_xlabel("delta (a block is skipped when max_r(m_loc - m) < ln(delta / N))")
        ax_skip.set_ylabel("skipped / listed blocks")
        ax_err.set_title("output error against skip ratio (one point per delta)", fontsize=9)
        ax_err.set_xlabel("skipped / listed blocks")
        ax_err.set_ylabel("||out - dense|| / ||dense||")
        for ax in (ax_iou, ax_skip, ax_err):
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def parse_args(argv=None):
    p = argument_parser(__doc__)
    p.add_argument("--n", type=int, nargs="*", default=None,
                   help="lengths of the synthetic problems (default 8192 32768 on a GPU, 2048 on the CPU; none: skip)")
    p.add_argument("--heads", type=int, nargs=2, default=None, metavar=("HQ", "HKV"),
                   help="query and KV heads of the synthetic problems (default 32 8 on a GPU, 8 2 on the CPU)")
    p.add_argument("--head-dim", type=int, default=None, help="64 or 128 (default 128 on a GPU, 64 on the CPU)")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.3, 0.5])
    p.add_argument("--deltas", type=float, nargs="*", default=[50, 200, 500, 1000, 2000, 5000],
                   help="OSK skip scales of the skip section (the skip is off for delta >= N)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {','.join(METHODS)}")
    p.add_argument("--stride", type=int, default=8, help="antidiagonal stride of KAP and XAttention")
    p.add_argument("--top-p", type=float, default=0.95, help="KAP's top-p")
    p.add_argument("--oracle-p", type=float, default=0.95, help="attention mass the oracle's mask covers")
    p.add_argument("--xattn-threshold", type=float, default=0.9, help="XAttention's block threshold")
    p.add_argument("--flex-gamma", type=float, default=0.9, help="FlexPrefill's coverage gamma")
    p.add_argument("--flex-tau", type=float, default=0.1, help="FlexPrefill's pattern threshold (JS distance)")
    p.add_argument("--meanpool-top-p", type=float, default=0.95)
    p.add_argument("--no-error", action="store_true", help="skip the output errors (and the skip section)")
    p.add_argument("--model", default=None, help="a model directory or a .gguf file (Q/K/V captured from it)")
    p.add_argument("--model-n", type=int, default=8192, help="tokens of text fed to --model")
    p.add_argument("--model-layers", type=lambda s: [int(x) for x in s.split(",") if x], default=None,
                   help="comma-separated layers to capture (default four spread over the depth)")
    p.add_argument("--text-dir", default=None,
                   help="folder of .txt files for the model's text (default: synthetic filler)")
    add_run_arguments(p)
    args = p.parse_args(argv)
    resolve_device(args)
    gpu = args.device == "cuda"
    if args.n is None:
        args.n = [8192, 32768] if gpu else [2048]
    if args.heads is None:
        args.heads = [32, 8] if gpu else [8, 2]
    if args.head_dim is None:
        args.head_dim = 128 if gpu else 64
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        p.error(f"--methods: unknown {', '.join(unknown)}")
    if any(not 0 < b <= 1 for b in args.budgets):
        p.error("--budgets must be in (0, 1]")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    meta, json_path = start_run(args.out, "fidelity")
    config = {k: getattr(args, k) for k in ("heads", "head_dim", "budgets", "deltas", "stride", "top_p", "oracle_p",
                                            "xattn_threshold", "flex_gamma", "flex_tau", "meanpool_top_p", "seed")}
    rows: list[dict] = []

    def save():
        write_json(json_path, {**meta, "config": config, "rows": rows})

    hq, hkv = args.heads
    for n in args.n:
        progress(f"synthetic n={n}: Hq {hq}, Hkv {hkv}, d {args.head_dim}")
        problem = proxies.structured_problem(n, hq, hkv, args.head_dim, torch.bfloat16, args.device, seed=args.seed)
        rows += evaluate(*proxies.contiguous(problem), "synthetic", None, args)
        save()
    if args.model:
        rows += model_rows(args)
        save()
    if args.plot and rows:
        png = json_path.with_suffix(".png")
        progress(f"plot -> {png}" if plot(rows, png) else "no plot: matplotlib is not installed")
    print(format_table([r for r in rows if r["section"] == "mask"], MASK_COLUMNS))
    print()
    print(format_table([r for r in rows if r["section"] == "skip"], SKIP_COLUMNS))
    print(f"\nresults: {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
