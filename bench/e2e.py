#!/usr/bin/env python3
"""Time to first token of a Llama-3.1-8B-shaped model, or of a real model: dense SDPA against CoSA
prefill.

The model is built from Llama-3.1-8B's configuration (32 layers, hidden 4096, 32 query heads, 8 KV
heads, head dim 128, intermediate 14336, vocabulary 128256, RoPE theta 500000 with Llama 3 scaling)
with random weights in bf16 (time does not depend on trained weights); ``--layers`` cuts the depth.
TTFT is one forward pass over the prompt through transformers (``use_cache=True``, so the KV cache is
written as in serving; the LM head over the last token only), median of ``--reps`` timed runs after one
warm-up run.

``--model DIR|FILE.gguf`` times a real model instead (any causal LM transformers loads; prompts are
real text: the ``*.txt`` files of ``--text-dir``, or bench/accuracy.py's synthetic filler), so that
the ``cosa`` row runs at the budgets that the model's own attention asks for.

Rows (``impl``):
  dense-cudnn, dense-flash  SDPA with one backend forced (cuDNN gets repeated KV heads, flash native
                            GQA), the fastest of them is the reference (``x_dense``)
  cosa                      the real pipeline: KAP (--top-p, --stride) + OSK with the skip (--delta);
                            with random weights attention has no structure, so its budget is what
                            KAP selects on such input (reported)
  cosa-<B>%                 fixed stage-1 budget B: KAP runs (its time counts) but its lists are
                            replaced by random lists of exactly budget B (every row: block 0, the
                            diagonal block and uniformly drawn others, ascending; bench/kernel.py's
                            random_lists), OSK without skip. This is how a budget is forced on input
                            without structure; a trained model at that budget costs the same.
Every prompt length must be a multiple of 128.

    python bench/e2e.py [--n 8192 32768 65536 131072] [--layers 32] [--budgets 0.1 0.25 0.5]
                        [--impls dense-cudnn,dense-flash,cosa,budgets] [--reps 3] [--plot] [--out bench/results]
    python bench/e2e.py --model DIR|FILE.gguf [--text-dir DIR] [--n 8192 16384 32768] [--impls dense-cudnn,dense-flash,cosa]
    python bench/e2e.py --config tiny --device cpu --n 512   # a CPU smoke run (the reference path)
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import (add_run_arguments, argument_parser, format_table, progress, require_cuda,  # noqa: E402
                    resolve_device, save_figure, start_run, write_json)
from kernel import random_lists  # noqa: E402

BLOCK = 128
CONFIGS = {
    # Llama-3.1-8B (meta-llama/Llama-3.1-8B's config.json, weights not needed).
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # The same architecture at toy size, for CPU smoke runs.
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=8192,
                 rope_theta=500000.0),
}
TABLE_COLUMNS = ("n", "impl", "budget", "realised", "ttft_ms", "x_dense", "note")


def build_model(name: str, layers: int | None, device: str):
    """A LlamaForCausalLM with the named configuration and random bf16 weights, made on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(CONFIGS[name])
    if layers:
        cfg["num_hidden_layers"] = layers
    config = LlamaConfig(**cfg)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


# ---------------------------------------------------------------------------------------------
# Attention implementations
# ---------------------------------------------------------------------------------------------


def dense_attention(backend):
    """An attention function (transformers' signature) running SDPA with one backend forced."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        causal = attention_mask is None and query.shape[2] > 1
        if attention_mask is None and key.shape[2] > query.shape[2]:
            key, value = key[:, :, :query.shape[2]], value[:, :, :query.shape[2]]
        gqa = query.shape[1] != key.shape[1]
        if gqa and backend != SDPBackend.FLASH_ATTENTION:  # no GQA path in SDPA but flash's
            group = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
            gqa = False
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, is_causal=causal,
                                                 scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None

    return attention


def budget_selector(budget: float, n: int, num_heads: int, stride: int, top_p: float, device: str):
    """A block selector that runs KAP (so that its cost is in the time) and returns fixed random lists
    of stage-1 budget ``budget`` (the same lists for every layer, drawn once)."""
    import cosa
    from cosa.layout import paged_from_contiguous

    nq = -(-n // BLOCK)
    gen = torch.Generator(device=device).manual_seed(int(budget * 1e6) + n)
    order, counts = random_lists(nq, num_heads, budget, gen)

    def select(module, q, k):
        layout = paged_from_contiguous(q, k)
        cosa.kap(layout["q"], layout["k_cache"], layout["page_table"], layout["cu_seqlens_q"], layout["seqused_k"],
                 layout["max_seqlen_q"], layout["max_seqlen_k"], stride=stride, top_p=top_p,
                 softmax_scale=getattr(module, "scaling", None))
        return order, counts

    return select, int(counts.sum()) / (num_heads * nq * (nq + 1) // 2)


def attention_context(model, impl: str, args, n: int):
    """``(context manager, stage-1 budget or None, note)`` for one row."""
    from cosa.integrations import transformers as cosa_hf
    from cosa.integrations.transformers import AttentionOverride
    from torch.nn.attention import SDPBackend

    if impl.startswith("dense-"):
        backend = {"dense-cudnn": SDPBackend.CUDNN_ATTENTION, "dense-flash": SDPBackend.FLASH_ATTENTION,
                   "dense-math": SDPBackend.MATH}[impl]
        return AttentionOverride(model, dense_attention(backend)), 1.0, None
    if impl == "cosa":
        return (cosa_hf.enable(model, top_p=args.top_p, delta=args.delta, stride=args.stride, min_prefill_tokens=1),
                None, f"top_p {args.top_p:g}, delta {args.delta:g}, stride {args.stride}")
    budget = float(impl.split("-")[1].rstrip("%")) / 100
    select, actual = budget_selector(budget, n, model.config.num_attention_heads, args.stride, args.top_p,
                                     args.device)
    return (cosa_hf.enable(model, delta=0.0, stride=args.stride, min_prefill_tokens=1, block_selector=select),
            actual, "KAP run, random lists at the budget, no skip")


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def ttft_ms(model, input_ids, reps: int, device: str) -> float:
    """Median wall time of a prefill forward (after one warm-up run)."""
    times = []
    for i in range(reps + 1):
        synchronize(device)
        start = time.perf_counter()
        with torch.no_grad():
            model(input_ids, use_cache=True, logits_to_keep=1)
        synchronize(device)
        if i:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def realised_budget(model, input_ids, args) -> tuple[float | None, float | None]:
    """Stage-1 and realised budgets of the real pipeline on this prompt (one extra, untimed run)."""
    from cosa.integrations import transformers as cosa_hf

    with cosa_hf.enable(model, top_p=args.top_p, delta=args.delta, stride=args.stride, min_prefill_tokens=1,
                        collect_stats=True) as handle, torch.no_grad():
        model(input_ids, use_cache=True, logits_to_keep=1)
    summary = handle.summary()
    return summary.get("stage1_budget"), summary.get("realised_budget")


def plot(rows, path: Path, title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for impl in dict.fromkeys(r["impl"] for r in rows):
        pts = sorted((r["n"], r["ttft_ms"]) for r in rows if r["impl"] == impl)
        ax.plot([p[0] for p in pts], [p[1] / 1e3 for p in pts], marker="o", label=impl)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"TTFT, {title}, bf16")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def parse_args(argv=None):
    p = argument_parser(__doc__)
    p.add_argument("--n", type=int, nargs="+", default=[8192, 32768, 65536, 131072],
                   help="prompt lengths, multiples of 128")
    p.add_argument("--config", default="llama-3.1-8b", choices=sorted(CONFIGS))
    p.add_argument("--layers", type=int, default=None, help="cut the model to this many layers")
    p.add_argument("--model", default=None, help="time this model directory or .gguf file instead of --config")
    p.add_argument("--text-dir", default=None, help="with --model: .txt files for the prompts (default: filler)")
    p.add_argument("--budgets", type=float, nargs="*", default=[0.1, 0.25, 0.5],
                   help="fixed stage-1 budgets of the cosa-<B>%% rows")
    p.add_argument("--impls", default="dense-cudnn,dense-flash,cosa,budgets",
                   help="comma-separated, of dense-cudnn, dense-flash, dense-math, cosa, budgets")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--delta", type=float, default=2000.0)
    p.add_argument("--stride", type=int, default=8)
    p.add_argument("--reps", type=int, default=3, help="timed runs per row (after one warm-up run)")
    add_run_arguments(p)
    args = p.parse_args(argv)
    resolve_device(args)
    if args.model and args.layers:
        p.error("--layers cuts the --config model; it does not apply to --model")
    if any(n <= 0 or n % BLOCK for n in args.n):
        p.error("--n: every prompt length must be a positive multiple of 128")
    if any(not 0 < b <= 1 for b in args.budgets):
        p.error("--budgets must be in (0, 1]")
    impls = []
    for impl in (s.strip() for s in args.impls.split(",") if s.strip()):
        if impl == "budgets":
            impls += [f"cosa-{b * 100:g}%" for b in args.budgets]
        elif impl in ("dense-cudnn", "dense-flash", "dense-math", "cosa"):
            impls.append(impl)
        else:
            p.error(f"--impls: unknown {impl!r}")
    args.impls = impls
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu" and args.config != "tiny" and not args.model:
        require_cuda(f"bench/e2e.py with the {args.config} configuration (use --config tiny on the CPU)")
    meta, json_path = start_run(args.out, "e2e")
    if args.model:
        from accuracy_tasks import haystack_token_ids
        from models import load_model

        model, tokenizer, name = load_model(args.model, args.device, torch.bfloat16)
        title = f"{name} (trained weights, real text)"
    else:
        model, tokenizer, name = build_model(args.config, args.layers, args.device), None, args.config
        title = f"{name}-shaped model, random weights"
    config = {"model": name, "weights": "trained" if args.model else "random",
              "layers": model.config.num_hidden_layers, "dtype": "bfloat16", "top_p": args.top_p,
              "delta": args.delta, "stride": args.stride, "reps": args.reps, "text_dir": args.text_dir}
    progress(f"model {title}, {config['layers']} layers, on {args.device}")
    rows, failures = [], []
    gen = torch.Generator().manual_seed(args.seed)
    for n in args.n:
        if tokenizer is not None:
            input_ids = torch.tensor([haystack_token_ids(tokenizer, args.text_dir, n, seed=args.seed)])
        else:
            input_ids = torch.randint(0, model.config.vocab_size, (1, n), generator=gen)
        input_ids = input_ids.to(args.device)
        for impl in args.impls:
            try:
                ctx, budget, note = attention_context(model, impl, args, n)
                with ctx if ctx is not None else contextlib.nullcontext():
                    ms = ttft_ms(model, input_ids, args.reps, args.device)
                row = {"n": n, "impl": impl, "budget": budget, "realised": budget if impl != "cosa" else None,
                       "ttft_ms": ms, "note": note}
                if impl == "cosa":
                    row["budget"], row["realised"] = realised_budget(model, input_ids, args)
                rows.append(row)
                progress(f"n={n} {impl}: {ms:.1f} ms")
            except Exception as error:  # noqa: BLE001  (one failing row, e.g. out of memory, must not end the run)
                message = f"n={n} {impl}: {type(error).__name__}: {' '.join(str(error).split())[:300]}"
                failures.append(message)
                progress("FAILED " + message)
            finally:
                if args.device == "cuda":
                    torch.cuda.empty_cache()
        dense = [r["ttft_ms"] for r in rows if r["n"] == n and r["impl"].startswith("dense-")]
        for r in rows:
            if r["n"] == n:
                r["x_dense"] = min(dense) / r["ttft_ms"] if dense else None
        write_json(json_path, {**meta, "config": config, "rows": rows, "failures": failures})
    if args.plot and rows:
        png = json_path.with_suffix(".png")
        progress(f"plot -> {png}" if plot(rows, png, title) else "no plot: matplotlib is not installed")
    print(format_table(rows, TABLE_COLUMNS))
    print(f"\nresults: {json_path}")
    if failures:
        print("failures:\n  " + "\n  ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
