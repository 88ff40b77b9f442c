#!/usr/bin/env python3
"""vLLM end to end: the same model served by vLLM with its FlashAttention backend and with CoSA's
backend (``attention_backend="CUSTOM"``, registered by cosa's vLLM plugin), on the same prompts.

Each engine runs in a subprocess of its own (in-process engine core, so that the backend's routing
counts can be read), one after the other, with greedy decoding, prefix caching off and vLLM's
default chunked prefill:

- ``short``: chat prompts of a few dozen tokens, 48 new tokens each; the generations must be
  identical (CoSA does not run there: it is the fallback path, decode CUDA graphs included);
- ``needle``: single-needle haystack questions (bench/accuracy.py's ``niah_single``) at
  ``--needle-lengths``; each answer is scored and compared with FlashAttention's;
- ``ttft``: time to first token of one request (``max_tokens=1``) at ``--lengths``, the median of
  ``--reps`` prompts after one warm-up prompt;
- ``batch``: ``--batch`` needle prompts of mixed lengths submitted at once, which makes the
  scheduler cut chunks at arbitrary token counts: the routing counts say how many long chunks
  CoSA could not take because their prefix is not a multiple of 128.
With ``--long-lengths`` a second pair of engines measures time to first token past the model's
32K positions with YaRN rope scaling (``--yarn-factor``), as Qwen2.5 documents it. With
``--tensor-parallel-size N`` each engine shards the model over N GPUs (vLLM's workers, one process
per rank, each running the backend on its rank's heads); the routing counts are read from every rank
and must agree, since every rank routes the same batch.

Rows: ``{"kind": "vllm", "impl": "cosa" | "flash_attn", "n", "ttft_ms", "answers_match"}`` and, for
the other phases, ``kind`` ``vllm-short``, ``vllm-needle`` and ``vllm-batch``; the CoSA worker's
routing counts are under ``routing``.

    python bench/vllm_e2e.py --model DIR [--lengths 8192 16384 32000] [--needle-lengths 16384 30000]
                             [--long-lengths 65536 130000] [--haystack DIR] [--plot] [--out bench/results]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (REPO_ROOT, argument_parser, finish_report, format_table, progress, results_path,  # noqa: E402
                    save_figure, start_run, write_json)
import ttft_account  # noqa: E402

IMPLS = {"flash_attn": "FLASH_ATTN", "cosa": "CUSTOM"}
SHORT_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences what a hash table is.",
    "What is the capital of France?",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
    "Write a SQL query that counts the rows of a table named users.",
    "What does the 'yield' keyword do in Python?",
    "Give one reason to use a paged KV cache when serving language models.",
)
SHORT_NEW_TOKENS = 48
NEEDLE_NEW_TOKENS = 32
NEEDLE_SAMPLES = 4
ACCOUNT_SPAN = "cosa_bench_ttft"  # the profiled request's host-side span in the trace


def rank_routing_counts(_worker) -> dict:
    """This rank's routing counts (run on each of vLLM's workers by ``collective_rpc``)."""
    from cosa.integrations import vllm_plugin
    return vllm_plugin.routing_counts()


def reset_rank_routing(_worker) -> None:
    """Zeroes this rank's routing counts (run on each of vLLM's workers by ``collective_rpc``)."""
    from cosa.integrations import vllm_plugin
    vllm_plugin.ROUTING.reset()


def worker(args) -> int:
    """One engine: every phase on it, the results as JSON in --result-file."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import accuracy_tasks
    import models

    settings = {"min_prefill_tokens": args.min_prefill_tokens}
    kwargs = dict(model=args.model, dtype="bfloat16", seed=0, enable_prefix_caching=False,
                  gpu_memory_utilization=args.gpu_memory_utilization, attention_backend=IMPLS[args.worker],
                  tensor_parallel_size=args.tensor_parallel_size)
    if args.worker == "cosa":
        kwargs["additional_config"] = {"cosa": settings}
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.block_size:
        kwargs["block_size"] = args.block_size
    long_phase = args.phase == "long"
    if long_phase:
        kwargs.update(models.yarn_engine_arguments(args.model, args.yarn_factor))
    started = time.perf_counter()
    llm = LLM(**kwargs)
    result = {"impl": args.worker, "phase": args.phase, "startup_s": time.perf_counter() - started,
              "tensor_parallel_size": args.tensor_parallel_size,
              "cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode),
              "max_num_batched_tokens": llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
              "block_size": llm.llm_engine.vllm_config.cache_config.block_size}
    tokenizer = llm.get_tokenizer()
    sentences = accuracy_tasks.haystack_sentences(args.haystack)
    greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n)  # noqa: E731
    routing = args.worker == "cosa"
    result["routing_disagreements"] = []

    def counts():
        """Rank 0's routing counts; a rank whose counts differ is recorded."""
        if not routing:
            return None
        ranks = llm.collective_rpc(rank_routing_counts)
        if any(r != ranks[0] for r in ranks[1:]):
            result["routing_disagreements"].append(ranks)
        return ranks[0]

    def generate(prompts, new_tokens):
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], greedy(new_tokens),
                            use_tqdm=False)
        return [o.outputs[0].text for o in outs]

    def ttft(n: int, seed: int) -> float:
        ids = accuracy_tasks.haystack_token_ids(tokenizer, args.haystack, n, seed)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        generate([ids], 1)
        return (time.perf_counter() - t0) * 1e3

    lengths = args.long_lengths if long_phase else args.lengths
    if not long_phase:
        progress(f"{args.worker}: short prompts")
        chats = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True) for p in SHORT_PROMPTS]
        result["short"] = generate([tokenizer.encode(c, add_special_tokens=False) for c in chats], SHORT_NEW_TOKENS)
        result["needle"] = []
        for n in args.needle_lengths:
            progress(f"{args.worker}: needles at {n}")
            prompts = [accuracy_tasks.build_prompt(tokenizer, "niah_single", n, seed, sentences)[:2]
                       for seed in range(NEEDLE_SAMPLES)]
            texts = generate([ids for ids, _ in prompts], NEEDLE_NEW_TOKENS)
            result["needle"] += [{"n": n, "seed": seed, "tokens": len(ids), "text": text,
                                  "score": accuracy_tasks.score_answer(text, answers)}
                                 for seed, ((ids, answers), text) in enumerate(zip(prompts, texts))]
    result["ttft"] = []
    for n in lengths:
        progress(f"{args.worker}: time to first token at {n}")
        ttft(n, seed=100)  # warm-up at this length
        before = counts()
        times = [ttft(n, seed=101 + rep) for rep in range(args.reps)]
        result["ttft"].append({"n": n, "ttft_ms": statistics.median(times), "all_ms": times,
                               "routing_before": before, "routing_after": counts()})
        if args.account:
            progress(f"{args.worker}: time to first token at {n} under torch.profiler (the account)")
            result["ttft"][-1]["account"] = profiled_account(lambda: ttft(n, seed=101), num_layers(args.model))
    if not long_phase and args.batch:
        progress(f"{args.worker}: a batch of {args.batch} mixed-length prompts")
        if routing:
            llm.collective_rpc(reset_rank_routing)
        n_max = max(args.lengths)
        sizes = [int(n_max * (0.25 + 0.75 * i / max(1, args.batch - 1))) for i in range(args.batch)]
        prompts = [accuracy_tasks.build_prompt(tokenizer, "niah_single", n, 1000 + i, sentences)[:2]
                   for i, n in enumerate(sizes)]
        texts = generate([ids for ids, _ in prompts], NEEDLE_NEW_TOKENS)
        result["batch"] = {"sizes": [len(ids) for ids, _ in prompts], "texts": texts,
                           "scores": [accuracy_tasks.score_answer(t, a) for t, (_, a) in zip(texts, prompts)],
                           "routing": counts()}
    result["routing_total"] = counts()
    Path(args.result_file).write_text(json.dumps(result))
    return 0


def profiled_account(request, layers: int) -> dict:
    """One request under torch.profiler, its span annotated, split into parts (bench/ttft_account.py).
    The request runs twice: the profiler sets itself up (CUPTI, its buffers) during the first, which
    it does not record, so that its start-up does not land in the recorded request's idle time."""
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 schedule=schedule(wait=0, warmup=1, active=1, repeat=1)) as prof:
        for _ in range(2):
            with record_function(ACCOUNT_SPAN):
                request()
            prof.step()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        return ttft_account.account(json.loads(path.read_text()), ACCOUNT_SPAN, layers)


def num_layers(model: str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"])


def yarn_positions(args) -> int:
    """The positions the model has with YaRN: its own times --yarn-factor."""
    import models

    return models.yarn_engine_arguments(args.model, args.yarn_factor)["max_model_len"]


def run_engine(script: str, worker_args: list[str], label: str, log_dir: str | None, log_name: str) -> dict | str:
    """One engine: ``script`` run with ``worker_args`` in a subprocess with vLLM's engine core in
    process (so that the backend's routing counts and the scheduler can be read), its results as the
    JSON it writes to ``--result-file``, or why it failed (its last output lines). Its log goes to
    ``log_dir/log_name`` when ``log_dir`` is given."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_file = f.name
    cmd = [sys.executable, script, *worker_args, "--result-file", result_file]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    progress(f"engine {label}: starting")
    log = Path(result_file).with_suffix(".log")
    with open(log, "w") as out:
        rc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    text = log.read_text(errors="replace")
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        (Path(log_dir) / log_name).write_text(text)
    if rc != 0:
        return f"exit status {rc}: " + " | ".join(text.strip().splitlines()[-6:])
    return json.loads(Path(result_file).read_text())


def run_worker(args, impl: str, phase: str) -> dict | str:
    """The worker's results, or why it failed (its last output lines)."""
    cmd = ["--worker", impl, "--phase", phase, "--model", args.model, "--lengths", *map(str, args.lengths),
           "--needle-lengths", *map(str, args.needle_lengths),
           "--long-lengths", *map(str, args.long_lengths), "--reps", str(args.reps), "--batch", str(args.batch),
           "--min-prefill-tokens", str(args.min_prefill_tokens), "--yarn-factor", str(args.yarn_factor),
           "--gpu-memory-utilization", str(args.gpu_memory_utilization),
           "--tensor-parallel-size", str(args.tensor_parallel_size)]
    for flag, value in (("--max-num-batched-tokens", args.max_num_batched_tokens), ("--block-size", args.block_size)):
        if value:
            cmd += [flag, str(value)]
    if args.account:
        cmd.append("--account")
    if args.haystack:
        cmd += ["--haystack", args.haystack]
    return run_engine(__file__, cmd, f"{impl} ({phase})", args.log_dir, f"vllm-{impl}-{phase}.log")


def compare(results: dict) -> tuple[list[dict], list[str]]:
    """The rows of both engines' results and the failed checks."""
    rows, failures = [], []
    flash, cosa = results.get(("flash_attn", "main")), results.get(("cosa", "main"))
    if isinstance(flash, dict) and isinstance(cosa, dict):
        same = [a == b for a, b in zip(flash["short"], cosa["short"])]
        rows.append({"kind": "vllm-short", "impl": "cosa", "n": len(same), "answers_match": all(same),
                     "identical": sum(same)})
        if not all(same):
            failures.append(f"short prompts: {len(same) - sum(same)} of {len(same)} generations differ from FLASH_ATTN")
        for n in sorted({s["n"] for s in flash["needle"]}):
            f = [s for s in flash["needle"] if s["n"] == n]
            c = [s for s in cosa["needle"] if s["n"] == n]
            match = [a["score"] == b["score"] for a, b in zip(f, c)]
            rows.append({"kind": "vllm-needle", "impl": "cosa", "n": n, "score": sum(s["score"] for s in c) / len(c),
                         "score_flash": sum(s["score"] for s in f) / len(f), "answers_match": all(match),
                         "same_text": sum(a["text"] == b["text"] for a, b in zip(f, c))})
            if not all(match):
                failures.append(f"needles at {n}: CoSA's answers score differently from FLASH_ATTN's")
        if "batch" in cosa and "batch" in flash:
            rows.append({"kind": "vllm-batch", "impl": "cosa", "n": len(cosa["batch"]["sizes"]),
                         "score": sum(cosa["batch"]["scores"]) / len(cosa["batch"]["scores"]),
                         "score_flash": sum(flash["batch"]["scores"]) / len(flash["batch"]["scores"]),
                         "answers_match": cosa["batch"]["scores"] == flash["batch"]["scores"],
                         "routing": cosa["batch"]["routing"]})
    for phase in ("main", "long"):
        base = results.get(("flash_attn", phase))
        for impl in IMPLS:
            res = results.get((impl, phase))
            if not isinstance(res, dict):
                continue
            if res.get("routing_disagreements"):
                failures.append(f"engine {impl} ({phase}): the ranks' routing counts differ "
                                f"({len(res['routing_disagreements'])} reads)")
            for t in res["ttft"]:
                row = {"kind": "vllm", "impl": impl, "n": t["n"], "ttft_ms": t["ttft_ms"], "phase": phase,
                       "tp": res.get("tensor_parallel_size", 1)}
                if impl == "cosa" and isinstance(base, dict):
                    flash_ms = {b["n"]: b["ttft_ms"] for b in base["ttft"]}.get(t["n"])
                    row["x_flash_attn"] = flash_ms / t["ttft_ms"] if flash_ms else None
                    row["answers_match"] = all(r.get("answers_match", True) for r in rows if r["kind"] != "vllm")
                    before, after = t["routing_before"] or {}, t["routing_after"] or {}
                    row["cosa_tokens"] = (after.get("tokens", {}).get("cosa", 0) -
                                          before.get("tokens", {}).get("cosa", 0))
                elif impl == "flash_attn":
                    row["answers_match"] = True
                rows.append(row)
    return rows, failures


def account_rows(results: dict) -> list[dict]:
    """The ``account`` rows (bench/ttft_account.py) of every engine that profiled a request."""
    rows = []
    for (impl, phase), res in results.items():
        if isinstance(res, dict):
            rows += [{**ttft_account.account_row(impl, t["n"], t["ttft_ms"], t["account"]), "phase": phase}
                     for t in res["ttft"] if "account" in t]
    return rows


def plot(rows, path, model: str) -> bool:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for impl in IMPLS:
        pts = sorted((r["n"], r["ttft_ms"]) for r in rows if r["kind"] == "vllm" and r["impl"] == impl)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"vLLM {IMPLS[impl]}" + (" (CoSA)" if impl == "cosa" else ""))
    long_from = min((r["n"] for r in rows if r["kind"] == "vllm" and r["phase"] == "long"), default=None)
    title = f"vLLM, one request: {model}" + (f"\n(YaRN rope scaling from {long_from} tokens)" if long_from else "")
    ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="time to first token (ms)", title=title)
    ax.legend()
    return save_figure(fig, path)


def parse_args(argv=None):
    ap = argument_parser(__doc__)
    ap.add_argument("--model", required=True, help="a model directory vLLM can load")
    ap.add_argument("--lengths", type=int, nargs="*", default=[8192, 16384, 32000])
    ap.add_argument("--needle-lengths", type=int, nargs="*", default=[16384, 30000])
    ap.add_argument("--long-lengths", type=int, nargs="*", default=[],
                    help="time-to-first-token lengths past the model's positions, run with YaRN rope scaling")
    ap.add_argument("--yarn-factor", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=3, help="timed prompts per length (default 3)")
    ap.add_argument("--batch", type=int, default=8, help="prompts of the mixed-length batch (0: none)")
    ap.add_argument("--min-prefill-tokens", type=int, default=4096, help="CoSA's min_prefill_tokens setting")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="vLLM's token budget per step, which sets the chunk length of a long prefill "
                         "(default: vLLM's); each engine's results record the value used")
    ap.add_argument("--block-size", type=int, default=None, choices=(16, 32, 64, 128, 256),
                    help="vLLM's KV-cache block size, the page size CoSA reads (default: vLLM's, 16)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="GPUs each engine shards the model over (vLLM's tensor parallelism; default 1)")
    ap.add_argument("--haystack", default=None, help="folder of .txt essays for the prompts (default: synthetic filler)")
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    ap.add_argument("--account", action="store_true",
                    help="after the timed prompts of each length, one more under torch.profiler, split into "
                         "measured parts (attention kernels, copies, the model's other kernels, idle GPU time)")
    ap.add_argument("--log-dir", default=None, help="keep each engine's log here")
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--out", default=str(REPO_ROOT / "bench" / "results"))
    ap.add_argument("--worker", choices=list(IMPLS), help=argparse_hidden())
    ap.add_argument("--phase", choices=("main", "long"), default="main", help=argparse_hidden())
    ap.add_argument("--result-file", help=argparse_hidden())
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    if any(n < 1 for n in [*args.lengths, *args.needle_lengths, *args.long_lengths]):
        ap.error("lengths must be positive")
    if not 0 < args.gpu_memory_utilization <= 1:
        ap.error("--gpu-memory-utilization must be in (0, 1]")
    if args.batch < 0:
        ap.error("--batch must be 0 (no batch phase) or more")
    if not args.yarn_factor > 1:
        ap.error("--yarn-factor must be greater than 1")
    if args.min_prefill_tokens < 1:
        ap.error("--min-prefill-tokens must be at least 1")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 128:
        ap.error("--max-num-batched-tokens must be at least 128")
    if args.tensor_parallel_size < 1:
        ap.error("--tensor-parallel-size must be at least 1")
    return args


def argparse_hidden():
    import argparse
    return argparse.SUPPRESS


def require_vllm_and_model(script: str, model: str):
    """``(vllm, config)``: vLLM's module and the model's ``config.json`` as a dict; where either is
    missing, one line on stderr saying which and exit status 2 (as common.require_cuda)."""
    try:
        import vllm
    except ImportError as error:
        print(f"{script} needs vLLM (pip install vllm==0.24.0): {error}", file=sys.stderr)
        sys.exit(2)
    config = Path(model) / "config.json"
    if not config.is_file():
        print(f"--model {model} is not a model directory (no config.json)", file=sys.stderr)
        sys.exit(2)
    return vllm, json.loads(config.read_text())


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    vllm, _ = require_vllm_and_model("bench/vllm_e2e.py", args.model)
    if args.long_lengths and max(args.long_lengths) + 1 > yarn_positions(args):
        print(f"--long-lengths: {max(args.long_lengths)} tokens and one new token exceed the {yarn_positions(args)} "
              f"positions the model has with YaRN factor {args.yarn_factor}", file=sys.stderr)
        return 2
    meta, json_path = start_run(args.out, "vllm")
    meta["vllm"] = vllm.__version__
    results, failures = {}, []
    phases = ["main"] + (["long"] if args.long_lengths else [])
    for phase in phases:
        for impl in args.impls:
            res = run_worker(args, impl, phase)
            if isinstance(res, str):
                failures.append(f"engine {impl} ({phase}): {res}")
            results[(impl, phase)] = res
            rows, check_failures = compare(results)
            write_json(json_path, {**meta, "model": Path(args.model).name, "rows": rows,
                                   "engines": {f"{i}-{p}": r for (i, p), r in results.items()}})
    rows, check_failures = compare(results)
    failures += check_failures
    if args.plot:
        plot(rows, json_path.with_suffix(".png"), Path(args.model).name)
    print(format_table(rows, ["kind", "impl", "phase", "tp", "n", "ttft_ms", "x_flash_attn", "score", "score_flash",
                              "answers_match", "cosa_tokens"]))
    accounts = account_rows(results)
    if accounts:
        account_path = results_path(args.out, "ttft-account", meta)
        write_json(account_path, {**meta, "model": Path(args.model).name, "rows": accounts})
        progress(f"account -> {account_path}")
        print()
        print(format_table(ttft_account.account_table(accounts),
                           ["part", *(f"{r['backend']} {r['n']}" for r in accounts)]))
        failures += [f"account of {r['backend']} at {r['n']}: its parts sum to {r['closure']:.3f}x the measured "
                     "time to first token (more than 5% off)" for r in accounts if abs(r["closure"] - 1) > 0.05]
    return finish_report(json_path, failures)


if __name__ == "__main__":
    sys.exit(main())
