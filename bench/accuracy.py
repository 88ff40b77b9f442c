#!/usr/bin/env python3
"""Model accuracy with sparse prefill: RULER-style tasks and long-text perplexity, dense attention
against CoSA and the peers' proxies, on any causal LM directory or GGUF file that transformers loads.

Tasks are generated here with the model's own tokenizer, each prompt filled to the target length
(RULER's recipe, our own wording and code):
  niah_single     one "special magic number" for a key hidden in a haystack; name the number
  niah_multikey   four keys with their numbers; name the number of one of them
  niah_multivalue four numbers for one key; name all of them
  vt              variable tracking: VAR A = 12345, VAR B = VAR A, ... (a chain of 4); name them all
  cwe             common-word extraction: a long numbered list of words, 10 of them frequent; name those
  essay_qa        a question over the haystack text itself: a sentence of it is quoted (one that occurs
                  once in the prompt, at a random depth) and the answer is the sentence that follows it;
                  the expected strings are that sentence's longest words that the quoted one lacks
The haystack is the text of ``--haystack-dir`` (every *.txt file, in name order, cut into sentences)
or, without it, synthetic filler sentences. Answers are greedy (``--max-new-tokens``); a sample scores
the share of its expected strings found in the answer (RULER's string match).

Perplexity: ``--ppl-samples`` windows of N tokens of the haystack text; the score is the perplexity of
the second half of each window given everything before it (the tokens that read a long context).

Methods (prefill only; decoding is always dense):
  dense          the model's SDPA attention
  cosa           KAP's lists run by OSK with the in-kernel skip (--top-p, --stride, --proxy-precision,
                 --delta, --vote): the two ops that cosa.prefill chains, called one after the other so
                 that the lists are seen
  cosa-fp8       the same with KAP's fp8 (e4m3) proxy, whatever --proxy-precision says: the two
                 proxies side by side on the same prompts
  kap            the same lists as cosa, without the skip (delta 0)
  kap-ascending  KAP's lists sorted ascending, run by OSK with the skip at the same delta and vote: KAP's
                 visiting order against ascending order (the realised budgets give the skip ratios)
  kap-ascending-matched
                 the same ascending lists with the skip's delta chosen per prompt so that the skip leaves
                 out the share of the stage-1 blocks that CoSA's left out on that prompt (a search over
                 log delta from the previous prompt's, each probe one prefill): the two orders at an
                 equal skip ratio, so at an equal realised budget; the rows record the delta found and
                 the share aimed at
  xattention, flexprefill, meanpool
                 the peers' masks (bench/proxies.py) turned into ascending lists and run by OSK, no skip
The peers' budgets (``--match``, comma-separated; each entry runs every peer once, its rows tagged
``match``):
  stage1    (the default when cosa runs) each (layer, head, query block) row of a peer keeps as many
            blocks as CoSA's stage-1 list of that row on the same prompt: the blocks on which CoSA
            computes QK^T, so that the peer does the same work before any skip
  realised  per layer, CoSA's realised budget (after the skip) on the same prompt, the same count in
            every row of the layer (proxies.budget_mask)
  none      each peer's own adaptive rule: XAttention's threshold per row (--xattn-threshold),
            FlexPrefill's pattern per head and coverage (--flex-gamma, --flex-tau), mean pooling's
            top-p per row (--meanpool-top-p)
  0.2       a fixed budget, the same count in every row

Statistics: every score (per method, task and length, and the mean over the tasks) comes with a 95%
percentile bootstrap interval over its prompts (``--bootstrap`` resamples, seeded); every sparse
method's score with its paired difference from dense on the same prompts and that difference's own
bootstrap interval (``diff``; ``*`` in the table where the interval excludes 0: the two are told
apart). Perplexity: an interval over the windows, and the paired ratio to dense's.

Tasks that dense attention itself fails at a length (mean score below ``--min-dense-score``) cannot
tell the sparse methods apart: with ``--drop-failed-tasks`` (the default) dense runs every task of a
length first, and the failed tasks are reported and not run by the other methods at that length.

A long evaluation can be split over several runs: ``--time-limit S`` stops it between two prompts
once S seconds have passed since the program started (the model's loading counts), saving what it
has (``complete: false`` in the JSON; its ``scores`` and ``summary``, and the table it prints,
cover the arms that already have every answer and window, dense among them), and ``--resume FILE``
continues that file with the same configuration, keeping every answer it holds (each run is listed
under ``runs``). A resumed run may add methods, ``--match`` entries and tasks to those of the file,
finished or not: only the new arms and tasks run, so dense answers each prompt once however many runs the
comparison takes (the peers matched to CoSA get CoSA's lists of each prompt from one more CoSA
prefill).

    python bench/accuracy.py --model DIR|FILE.gguf [--lengths 8192 16384 32768] [--samples 50]
        [--tasks ...] [--methods dense,cosa,cosa-fp8,kap,kap-ascending,kap-ascending-matched,
                    xattention,flexprefill,meanpool]
        [--match stage1,none] [--haystack-dir DIR] [--ppl-samples 8] [--time-limit S] [--resume FILE]
        [--plot] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import (add_run_arguments, argument_parser, format_table, progress, resolve_device,  # noqa: E402
                    run_metadata, save_figure, start_run, write_json)
from stats import bootstrap_interval, interval_text, paired_difference  # noqa: E402
from stats import score_statistics as scores_with_intervals  # noqa: E402

import cosa  # noqa: E402
import proxies  # noqa: E402
from accuracy_tasks import TASKS, build_prompt, haystack_sentences, haystack_token_ids, score_answer  # noqa: E402
from models import load_model  # noqa: E402
from cosa import defaults, reference  # noqa: E402
from cosa.layout import kap_layout_args, paged_from_contiguous  # noqa: E402

METHODS = ("dense", "cosa", "cosa-fp8", "kap", "kap-ascending", "kap-ascending-matched", *proxies.PEERS)
# kap-ascending-matched: the search over log(delta) stops within this share of CoSA's skipped share, or after
# EQUAL_SKIP_PROBES prefills, keeping the closest delta probed.
EQUAL_SKIP_TOLERANCE = 0.01
EQUAL_SKIP_PROBES = 8
MATCH_RULES = ("stage1", "realised", "none")
SCORE_COLUMNS = ("method", "match", "n", "task", "score [95% CI]", "diff vs dense [95% CI]", "samples", "stage1",
                 "realised")
SUMMARY_COLUMNS = ("method", "match", "n", "score [95% CI]", "diff vs dense [95% CI]", "ppl [95% CI]",
                   "ppl / dense [95% CI]", "stage1", "realised", "skipped")
DENSE_BUDGETS = {"stage1": 1.0, "realised": 1.0}

# ---------------------------------------------------------------------------------------------
# Methods
# ---------------------------------------------------------------------------------------------


def kap_lists(q: torch.Tensor, k: torch.Tensor, args, softmax_scale: float | None, proxy_precision: str | None = None):
    """KAP's ordered lists ``(order, counts)`` of one sequence (``cosa.kap``: the CUDA kernel on the GPU),
    with --proxy-precision unless ``proxy_precision`` is given."""
    return cosa.kap(*kap_layout_args(paged_from_contiguous(q, k)), stride=args.stride, top_p=args.top_p, softmax_scale=softmax_scale,
                    proxy_precision=proxy_precision or args.proxy_precision)


def ascending_lists(order: torch.Tensor, counts: torch.Tensor):
    """The same blocks in ascending order in each list."""
    return proxies.mask_to_lists(proxies.lists_to_mask(order, counts))


def arms_of(args) -> list[tuple[str, str | None]]:
    """The runs on every prompt, ``(method, match)``, in the order they run: dense, then cosa (whose
    lists and budgets the peers are matched to), then the rest; each peer once per --match entry."""
    return [(method, match) for method in METHODS if method in args.methods
            for match in (args.match if method in proxies.PEERS else [None])]


class Runner:
    """Runs one method's prefill on a model and reports the budgets it used. It keeps CoSA's lists and
    per-layer realised budgets of the current prompt (:meth:`new_prompt` forgets them) for the peers
    matched to them."""

    def __init__(self, model, args):
        self.model = model
        self.args = args
        self.lists: dict = {}  # (layer, Sq, Sk) -> list lengths [Hq, nq] of each sparse call of the last run
        self.cosa_lists: dict | None = None
        self.cosa_realised: dict | None = None
        self.cosa_skipped: dict | None = None  # {"share": the share of stage-1 blocks CoSA's skip left out}
        self.matched_ratio: float | None = None  # kap-ascending-matched's last delta over its prompt's length

    def new_prompt(self) -> None:
        self.cosa_lists = self.cosa_realised = self.cosa_skipped = None

    def selector(self, method: str, match: str | None):
        """The block selector of a sparse method: ``(module, q, k) -> (order, counts)``, recording the
        list lengths of every call in :attr:`lists`."""
        a = self.args

        def select(module, q, k):
            scale = getattr(module, "scaling", None)
            call = (getattr(module, "layer_idx", None), q.shape[0], k.shape[0])
            if method in ("cosa", "kap"):
                order, counts = kap_lists(q, k, a, scale)
            elif method == "cosa-fp8":
                order, counts = kap_lists(q, k, a, scale, "fp8")
            elif method in ("kap-ascending", "kap-ascending-matched"):
                order, counts = ascending_lists(*kap_lists(q, k, a, scale))
            else:
                order, counts = proxies.mask_to_lists(self.peer_mask(method, match, call, q, k, scale))
            self.lists[call] = counts
            return order, counts

        return select

    def peer_mask(self, method: str, match: str, call: tuple, q, k, scale):
        a = self.args
        scores, own = proxies.peer_selection(
            method, q, k, stride=a.stride, xattn_threshold=a.xattn_threshold, flex_gamma=a.flex_gamma,
            flex_tau=a.flex_tau, meanpool_top_p=a.meanpool_top_p, softmax_scale=scale)
        prefix = k.shape[0] - q.shape[0]
        if match == "none":
            return own
        if match == "stage1":
            return proxies.counts_mask(scores, self.cosa_record(self.cosa_lists, call, "lists"), prefix)
        if match == "realised":
            return proxies.budget_mask(scores, self.cosa_record(self.cosa_realised, call[0], "budget"), prefix)
        return proxies.budget_mask(scores, float(match), prefix)

    @staticmethod
    def cosa_record(records: dict | None, key, what: str):
        # A peer matched to CoSA runs only after CoSA on the same prompt; a missing record is a bug in the
        # order of the runs, and a peer run on its own rule instead would be mislabelled.
        if records is None or key not in records:
            raise RuntimeError(f"no CoSA {what} for {key} on this prompt: cosa must run before the matched peers")
        return records[key]

    def run(self, method: str, match: str | None, fn, ids: list[int]):
        """``(fn(), budgets)`` with ``method``'s prefill (the peers per ``match``) over the prompt ``ids``:
        the stage-1 and realised budgets over the sparse calls (1.0 when every call stayed dense);
        kap-ascending-matched adds the delta it found and the skip share it aimed at."""
        a = self.args
        if method == "dense":
            self.lists = {}
            with torch.no_grad():
                return fn(), dict(DENSE_BUDGETS)
        if method == "kap-ascending-matched":
            delta, target = self.equal_skip_delta(ids)
            result, budgets = self.sparse_run(method, match, fn, delta)
            return result, {**budgets, "delta": delta, "skip_target": target}
        delta = a.delta if method in ("cosa", "cosa-fp8", "kap-ascending") else 0.0
        result, budgets = self.sparse_run(method, match, fn, delta)
        if method == "cosa":
            self.cosa_skipped = {"share": skipped_share(budgets)}
        return result, budgets

    def sparse_run(self, method: str, match: str | None, fn, delta: float):
        from cosa.integrations import transformers as cosa_hf

        a = self.args
        self.lists = {}
        handle = cosa_hf.enable(self.model, stride=a.stride, delta=delta, vote=a.vote,
                                min_prefill_tokens=a.min_prefill_tokens, collect_stats=True,
                                block_selector=self.selector(method, match))
        with handle, torch.no_grad():
            result = fn()
        summary = handle.summary()
        if method == "cosa":
            self.cosa_lists = self.lists
            self.cosa_realised = {layer: v["realised_budget"] for layer, v in summary.get("per_layer", {}).items()}
        if not handle.sparse_calls:
            return result, dict(DENSE_BUDGETS)
        return result, {"stage1": summary["stage1_budget"], "realised": summary["realised_budget"]}

    def equal_skip_delta(self, ids: list[int]) -> tuple[float, float]:
        """``(delta, target)``: the delta at which the skip over KAP's lists in ascending order leaves
        out ``target``, the share of the stage-1 blocks that CoSA's skip left out on this prompt, to
        within :data:`EQUAL_SKIP_TOLERANCE` or the closest of :data:`EQUAL_SKIP_PROBES` prefills.

        Within a layer the share grows with delta (a larger delta only adds skips over the same lists
        and running maxima); through the layers it does roughly so (the skipped blocks change what the
        next layers see), which is enough for a search over log(delta): the first probe is the
        previous prompt's answer (as a share of the prompt's length: the skip compares logits with
        log(delta / keys)), --delta on the first prompt of a run; the next ones step by 4x towards the
        target until it is bracketed, then bisect, within [--delta / 1000, 0.99 x the prompt's length]
        (delta >= the key count turns the skip off). A prompt on which CoSA skipped nothing keeps
        --delta."""
        a = self.args
        target = self.cosa_record(self.cosa_skipped, "share", "skip share")
        if target == 0.0:
            return a.delta, target
        lowest, highest = a.delta / 1000, 0.99 * len(ids)
        probes: list[tuple[float, float]] = []

        def probe(delta: float) -> bool:
            """Runs one prefill at ``delta``; whether its share is the target's, within the tolerance."""
            _, budgets = self.sparse_run("kap-ascending-matched", None, lambda: prefill(self.model, ids), delta)
            probes.append((delta, skipped_share(budgets)))
            return abs(probes[-1][1] - target) <= EQUAL_SKIP_TOLERANCE

        first = a.delta if self.matched_ratio is None else self.matched_ratio * len(ids)
        low = high = None  # the largest delta probed below the target's share, the smallest above it
        delta = min(max(first, lowest), highest)
        while not probe(delta) and len(probes) < EQUAL_SKIP_PROBES:
            if probes[-1][1] < target:
                low = delta
            else:
                high = delta
            if high is None:
                if delta >= highest:
                    break  # out of reach: the most the skip leaves out below the key count
                delta = min(delta * 4, highest)
            elif low is None:
                if delta <= lowest:
                    break
                delta = max(delta / 4, lowest)
            else:
                delta = math.sqrt(low * high)  # the midpoint in log(delta)
        best = min(probes, key=lambda p: abs(p[1] - target))[0]
        self.matched_ratio = best / len(ids)
        return best, target


def skipped_share(budgets: dict) -> float:
    """The share of the stage-1 blocks that the skip left out, from a run's budgets."""
    return 1 - budgets["realised"] / budgets["stage1"]


def generate(model, tokenizer, ids: list[int], max_new_tokens: int) -> str:
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], device=device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=pad)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def prefill(model, ids: list[int]) -> None:
    """One forward pass of the model's backbone over ``ids`` (no LM head, no cache): the attention
    calls of a prompt's prefill, for the block lists they select."""
    device = next(model.parameters()).device
    getattr(model, model.base_model_prefix)(input_ids=torch.tensor([ids], device=device), use_cache=False)


def tail_nll(model, ids: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of the second half of ``ids`` and the token count; the LM head
    runs in chunks so that no [N, vocab] logits tensor is formed."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], device=device)
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=input_ids, use_cache=False).last_hidden_state[0]
    head = model.get_output_embeddings()
    first = len(ids) // 2
    total = 0.0
    for t0 in range(first, len(ids), 1024):
        t1 = min(len(ids), t0 + 1024)
        logits = head(hidden[t0 - 1:t1 - 1]).float()
        total += float(torch.nn.functional.cross_entropy(logits, input_ids[0, t0:t1], reduction="sum"))
    return total, len(ids) - first


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


class OutOfTime(Exception):
    """--time-limit was reached between two prompts."""


# Options in which a resumed run may go beyond the run it continues: more methods, more match entries,
# more tasks. The answers already there stay, and only the new arms and tasks run (dense, typically the
# longest arm, once per prompt).
EXTENDABLE_OPTIONS = ("methods", "match", "tasks")


def missing_arms(rows: list[dict], arms: list, **where) -> list:
    """The arms ``(method, match)`` of ``arms`` with no row among ``rows`` whose fields equal ``where``."""
    done = {(r["method"], r["match"]) for r in rows if all(r[key] == value for key, value in where.items())}
    return [arm for arm in arms if arm not in done]


def load_resumed(path: Path, args, name: str) -> dict:
    """The results file of an earlier run of the same configuration, to be continued in place; the
    methods, match entries and tasks may be a superset of that run's."""
    earlier = json.loads(path.read_text())
    mine = {**config_of(args), "model": name}
    theirs = {**earlier.get("config", {}), "model": earlier.get("model")}
    differ = sorted(k for k in set(mine) | set(theirs)
                    if k not in EXTENDABLE_OPTIONS and mine.get(k) != theirs.get(k))
    if differ:
        raise SystemExit(f"--resume {path}: that run's configuration differs in "
                         + ", ".join(f"{k} (that run: {theirs.get(k)}, this one: {mine.get(k)})" for k in differ))
    for option in EXTENDABLE_OPTIONS:
        left_out = [x for x in theirs.get(option) or [] if x not in mine[option]]
        if left_out:
            raise SystemExit(f"--resume {path}: --{option} must include that run's "
                             f"{', '.join(map(str, theirs[option]))} (it leaves out {', '.join(map(str, left_out))})")
    return earlier


def evaluate(args, model, tokenizer, name: str, meta: dict, json_path: Path, resumed: dict | None = None,
             deadline: float = math.inf) -> dict:
    """Runs every arm on every prompt and perplexity window; returns the results payload, with
    ``complete`` False when --time-limit stopped it between two prompts. ``resumed``: an earlier
    payload of the same configuration, whose finished prompts are kept and not run again."""
    from tqdm.auto import tqdm

    runner = Runner(model, args)
    sentences = haystack_sentences(args.haystack_dir, args.seed)
    arms = arms_of(args)
    sparse_arms = [arm for arm in arms if arm[0] != "dense"]
    judge_tasks = args.drop_failed_tasks and ("dense", None) in arms
    if args.drop_failed_tasks and not judge_tasks:
        progress("dense does not run: no task is judged or dropped")
    samples: list[dict] = list(resumed["samples"]) if resumed else []
    ppl_rows: list[dict] = list(resumed["ppl"]) if resumed else []
    dropped: list[dict] = list(resumed["dropped"]) if resumed else []
    # The haystack count of every prompt built so far, by "n:task:seed", kept in the results so that
    # a resumed run renders each prompt once.
    prompt_counts: dict[str, int] = dict(resumed.get("prompt_counts", {})) if resumed else {}
    runs = list(resumed.get("runs", [])) if resumed else []
    runs.append({"commit": meta["commit"], "date": meta["date"]})
    header = {**(resumed or meta), "runs": runs}
    for key in ("scores", "summary", "complete"):
        header.pop(key, None)
    total = len(args.lengths) * (len(args.tasks) * args.samples + args.ppl_samples) * len(arms)
    bar = tqdm(total=total, desc="accuracy", file=sys.stderr, dynamic_ncols=True)
    bar.update(len(samples) + len(ppl_rows))

    def save(final=False, complete=False, stopped=False):
        payload = {**header, "model": name, "config": config_of(args), "samples": samples, "ppl": ppl_rows,
                   "dropped": dropped, "prompt_counts": prompt_counts, "complete": complete}
        if final:
            payload["scores"], payload["summary"] = aggregate(samples, ppl_rows, dropped, args.bootstrap, args.seed)
        elif stopped:  # what is finished already, so that a stopped file still reads as results
            done = finished_arms(samples, ppl_rows, dropped, args)
            if done and (("dense", None) in done or ("dense", None) not in arms):
                payload["scores"], payload["summary"] = aggregate(
                    [r for r in samples if (r["method"], r["match"]) in done],
                    [r for r in ppl_rows if (r["method"], r["match"]) in done], dropped, args.bootstrap, args.seed)
        write_json(json_path, payload)
        return payload

    def next_prompt():
        if time.monotonic() > deadline:
            raise OutOfTime

    def prepare_matching(todo, ids):
        """CoSA's lists of this prompt for the peers matched to them, and its skipped share for
        kap-ascending-matched, when CoSA answered the prompt in an earlier run: one prefill with CoSA
        (both depend on the prompt alone)."""
        if ("cosa", None) not in todo and any((m in proxies.PEERS and match in ("stage1", "realised"))
                                              or m == "kap-ascending-matched" for m, match in todo):
            runner.run("cosa", None, lambda: prefill(model, ids), ids)

    def answer_task(n, task, s, make_prompt, arms_here):
        """The arms of ``arms_here`` that no earlier run answered on this prompt."""
        todo = missing_arms(samples, arms_here, n=n, task=task, sample=s)
        if not todo:
            return
        next_prompt()
        ids, answers = make_prompt()
        runner.new_prompt()
        prepare_matching(todo, ids)
        for method, match in todo:
            bar.set_postfix_str(f"n={n} {task} #{s} {method}" + (f" ({match})" if match else ""))
            text, budgets = runner.run(method, match, lambda: generate(model, tokenizer, ids, args.max_new_tokens),
                                       ids)
            samples.append({"method": method, "match": match, "n": n, "task": task, "sample": s, "tokens": len(ids),
                            "score": score_answer(text, answers), "answer": text.strip()[:200], "expected": answers,
                            **budgets})
            bar.update(1)

    try:
        for n in args.lengths:
            prompts: dict = {}  # one length's prompts, built once for dense and the sparse methods

            def prompt(task, s):
                if (task, s) not in prompts:
                    key = f"{n}:{task}:{args.seed + s}"
                    ids, answers, prompt_counts[key] = build_prompt(tokenizer, task, n, args.seed + s, sentences,
                                                                    prompt_counts.get(key))
                    prompts[task, s] = ids, answers
                return prompts[task, s]

            kept = list(args.tasks)
            if judge_tasks:
                for task in args.tasks:
                    for s in range(args.samples):
                        answer_task(n, task, s, lambda: prompt(task, s), [("dense", None)])
                    save()
                failed = dropped_tasks(samples, n, args.min_dense_score, args.bootstrap, args.seed)
                judged = {(row["n"], row["task"]) for row in dropped}  # by a run this one resumes
                for row in failed:
                    if (n, row["task"]) not in judged:
                        progress(f"n={n}: {row['task']} dropped, dense scores {interval_text(row, 'score')} "
                                 f"< {args.min_dense_score:g}")
                        dropped.append(row)
                kept = [t for t in args.tasks if t not in {row["task"] for row in failed}]
                bar.total -= len(failed) * args.samples * len(sparse_arms)
                bar.refresh()
            for task in kept:
                for s in range(args.samples):
                    answer_task(n, task, s, lambda: prompt(task, s), sparse_arms if judge_tasks else arms)
                save()
            for s in range(args.ppl_samples):
                todo = missing_arms(ppl_rows, arms, n=n, sample=s)
                if not todo:
                    continue
                next_prompt()
                ids = haystack_token_ids(tokenizer, args.ppl_dir or args.haystack_dir, n, seed=args.seed + 1000 + s)
                runner.new_prompt()
                prepare_matching(todo, ids)
                for method, match in todo:
                    bar.set_postfix_str(f"n={n} ppl #{s} {method}" + (f" ({match})" if match else ""))
                    (nll, count), budgets = runner.run(method, match, lambda: tail_nll(model, ids), ids)
                    ppl_rows.append({"method": method, "match": match, "n": n, "sample": s, "nll": nll, "tokens": count,
                                     "ppl": math.exp(nll / count), **budgets})
                    bar.update(1)
                save()
    except OutOfTime:
        bar.close()
        progress(f"--time-limit {args.time_limit:g} s reached: {len(samples)} answers and {len(ppl_rows)} perplexity "
                 f"windows so far")
        return save(stopped=True)
    bar.close()
    return save(final=True, complete=True)


def finished_arms(samples: list[dict], ppl_rows: list[dict], dropped: list[dict], args) -> set[tuple]:
    """The arms of the run, ``(method, match)``, that hold every answer (each sample of each task not
    dropped at its length) and every perplexity window at every length."""
    dropped_at = {(d["n"], d["task"]) for d in dropped}
    answers = Counter((r["method"], r["match"], r["n"], r["task"]) for r in samples)
    windows = Counter((r["method"], r["match"], r["n"]) for r in ppl_rows)
    return {arm for arm in arms_of(args)
            if all(windows[(*arm, n)] >= args.ppl_samples
                   and all(answers[(*arm, n, task)] >= args.samples
                           for task in args.tasks if (n, task) not in dropped_at)
                   for n in args.lengths)}


def dropped_tasks(samples: list[dict], n: int, min_score: float, resamples: int, seed: int) -> list[dict]:
    """The tasks whose dense mean score at length ``n`` is below ``min_score``, with that score and
    its interval: tasks that dense attention fails cannot tell sparse methods apart."""
    out = []
    for task in dict.fromkeys(r["task"] for r in samples if r["method"] == "dense" and r["n"] == n):
        scores = [r["score"] for r in samples if (r["method"], r["n"], r["task"]) == ("dense", n, task)]
        mean = sum(scores) / len(scores)
        if mean < min_score:
            low, high = bootstrap_interval(scores, resamples, seed)
            out.append({"n": n, "task": task, "score": mean, "ci_low": low, "ci_high": high, "samples": len(scores)})
    return out


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def arm_order(method: str, match: str | None):
    return METHODS.index(method), "" if match is None else match


def prompt_of(row: dict) -> tuple:
    return row["n"], row["task"], row["sample"]


def score_statistics(rows: list[dict], dense: dict, resamples: int, seed: int) -> dict:
    """Mean score of ``rows`` with its bootstrap interval, and the paired difference from the dense
    scores of the same prompts (``dense[prompt_of(row)]``; no difference for dense itself)."""
    pairs = [(r["score"], dense[prompt_of(r)]) for r in rows if r["method"] != "dense" and prompt_of(r) in dense]
    return scores_with_intervals([r["score"] for r in rows], pairs, resamples, seed)


def perplexity_statistics(rows: list[dict], dense: dict, resamples: int, seed: int) -> dict:
    """Perplexity over the windows of ``rows`` (exp of the mean of each window's mean NLL per token),
    its bootstrap interval over the windows, and the paired ratio to dense's on the same windows."""
    out = {"ppl": None, "ppl_ci_low": None, "ppl_ci_high": None, "windows": len(rows), "ppl_ratio": None,
           "ppl_ratio_ci_low": None, "ppl_ratio_ci_high": None, "ppl_ratio_excludes_one": None}
    if not rows:
        return out
    nll = [r["nll"] / r["tokens"] for r in rows]
    low, high = bootstrap_interval(nll, resamples, seed)
    out.update(ppl=math.exp(sum(nll) / len(nll)), ppl_ci_low=math.exp(low), ppl_ci_high=math.exp(high))
    pairs = [(r["nll"] / r["tokens"], dense[r["sample"]]) for r in rows
             if r["method"] != "dense" and r["sample"] in dense]
    if pairs:
        diff, low, high = paired_difference(*zip(*pairs, strict=True), resamples=resamples, seed=seed)
        out.update(ppl_ratio=math.exp(diff), ppl_ratio_ci_low=math.exp(low), ppl_ratio_ci_high=math.exp(high),
                   ppl_ratio_excludes_one=low > 0 or high < 0)
    return out


def aggregate(samples: list[dict], ppl_rows: list[dict], dropped: list[dict], resamples: int, seed: int):
    """Per (method, match, n, task) scores, and per (method, match, n) the score over the tasks not
    dropped at that length, perplexity, budgets and the share of stage-1 blocks the skip left out."""
    dropped_at = {(d["n"], d["task"]) for d in dropped}
    dense_scores = {prompt_of(r): r["score"] for r in samples if r["method"] == "dense"}
    scores, summary = [], []
    arms = sorted({(r["method"], r["match"]) for r in samples + ppl_rows}, key=lambda arm: arm_order(*arm))
    for method, match in arms:
        mine = [r for r in samples if (r["method"], r["match"]) == (method, match)]
        for n, task in sorted({(r["n"], r["task"]) for r in mine}):
            rs = [r for r in mine if (r["n"], r["task"]) == (n, task)]
            scores.append({"method": method, "match": match, "n": n, "task": task, "dropped": (n, task) in dropped_at,
                           **score_statistics(rs, dense_scores, resamples, seed),
                           "stage1": _mean(r["stage1"] for r in rs), "realised": _mean(r["realised"] for r in rs)})
        for n in sorted({r["n"] for r in samples + ppl_rows if (r["method"], r["match"]) == (method, match)}):
            rs = [r for r in mine if r["n"] == n and (n, r["task"]) not in dropped_at]
            ps = [r for r in ppl_rows if (r["method"], r["match"], r["n"]) == (method, match, n)]
            dense_nll = {r["sample"]: r["nll"] / r["tokens"] for r in ppl_rows if (r["method"], r["n"]) == ("dense", n)}
            stage1, realised = _mean(r["stage1"] for r in rs + ps), _mean(r["realised"] for r in rs + ps)
            summary.append({"method": method, "match": match, "n": n,
                            "tasks": len({r["task"] for r in rs}),
                            **score_statistics(rs, dense_scores, resamples, seed),
                            **perplexity_statistics(ps, dense_nll, resamples, seed),
                            "stage1": stage1, "realised": realised,
                            "skipped": 1 - realised / stage1 if stage1 else None})
    return scores, summary


def config_of(args) -> dict:
    return {k: getattr(args, k) for k in ("lengths", "tasks", "methods", "samples", "ppl_samples", "top_p", "delta",
                                          "vote", "stride", "proxy_precision", "min_prefill_tokens", "match",
                                          "xattn_threshold",
                                          "flex_gamma", "flex_tau", "meanpool_top_p", "max_new_tokens",
                                          "drop_failed_tasks", "min_dense_score", "bootstrap", "seed",
                                          "haystack_dir")}


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def table_rows(rows: list[dict]) -> list[dict]:
    """Result rows with their intervals as ``value [low, high]`` cells (:data:`SCORE_COLUMNS`,
    :data:`SUMMARY_COLUMNS`)."""
    return [{**r, "score [95% CI]": interval_text(r, "score"),
             "diff vs dense [95% CI]": interval_text(r, "diff", "diff_ci_low", "diff_ci_high", "diff_excludes_zero"),
             "ppl [95% CI]": interval_text(r, "ppl", "ppl_ci_low", "ppl_ci_high", digits=2),
             "ppl / dense [95% CI]": interval_text(r, "ppl_ratio", "ppl_ratio_ci_low", "ppl_ratio_ci_high",
                                                   "ppl_ratio_excludes_one", digits=4)}
            for r in rows]


def arm_label(row: dict) -> str:
    return row["method"] if row["match"] is None else f"{row['method']} ({row['match']})"


def plot(summary: list[dict], path: Path) -> bool:
    """Per length: each arm's mean score and perplexity with their intervals, and each sparse arm's
    paired difference from dense (the comparison that tells methods apart), with its interval."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(18, 5))
    arms = list(dict.fromkeys(arm_label(r) for r in sorted(summary, key=lambda r: arm_order(r["method"], r["match"]))))
    # Twelve arms and more outrun the default ten-colour cycle: 20 colours, and a marker per arm beside
    # its colour, so that no two arms look alike.
    colors = plt.get_cmap("tab20")
    markers = "osD^vP*Xph<>"
    panels = ((ax1, "score", "ci_low", "ci_high"), (ax2, "ppl", "ppl_ci_low", "ppl_ci_high"),
              (ax3, "diff", "diff_ci_low", "diff_ci_high"))
    for i, label in enumerate(arms):
        rs = sorted((r for r in summary if arm_label(r) == label), key=lambda r: r["n"])
        # Each arm's points sit a little apart along the length axis, so that overlapping bars stay readable.
        shift = 2 ** (0.04 * (i - (len(arms) - 1) / 2))
        for ax, field, low, high in panels:
            points = [r for r in rs if r[field] is not None]
            if points:
                ax.errorbar([r["n"] * shift for r in points], [r[field] for r in points],
                            yerr=[[r[field] - r[low] for r in points], [r[high] - r[field] for r in points]],
                            marker=markers[i % len(markers)], capsize=3, label=label, color=colors(i % colors.N))
    lengths = [r["n"] for r in summary]
    ax3.axhline(0.0, color="0.5", linewidth=1)
    for ax, title in ((ax1, "RULER-style score, mean over the tasks kept (95% CI)"),
                      (ax2, "perplexity of the second half (95% CI over windows)"),
                      (ax3, "score minus dense on the same prompts (paired 95% CI)")):
        ax.set_xscale("log", base=2)
        # A margin around the lengths, so that a single length is not stretched across the axis.
        ax.set_xlim(min(lengths) / 1.5, max(lengths) * 1.5)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    # One legend for the three panels, beside them, where it hides no bar.
    handles, labels = ax1.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    return save_figure(fig, path)


def parse_match(text: str) -> list[str]:
    """--match: comma-separated entries of stage1, realised, none or a budget in (0, 1] (written as
    ``%g``), repeats dropped."""
    entries = []
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        if entry not in MATCH_RULES:
            try:
                budget = float(entry)
            except ValueError:
                budget = math.nan
            if not 0 < budget <= 1:
                raise ValueError(f"--match: {entry!r} is none of {', '.join(MATCH_RULES)} nor a budget in (0, 1]")
            entry = f"{budget:g}"
        entries.append(entry)
    if not entries:
        raise ValueError("--match: no entry")
    return list(dict.fromkeys(entries))


def parse_args(argv=None):
    p = argument_parser(__doc__)
    p.add_argument("--model", required=True, help="a model directory or a .gguf file")
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768],
                   help="prompt lengths in tokens, one run of every task and perplexity window at each "
                        "(default 8192 16384 32768)")
    p.add_argument("--samples", type=int, default=50,
                   help="prompts per task and length (default 50: a score's 95%% interval is then about "
                        "+-0.14 at worst, for a 0/1 task at 0.5)")
    p.add_argument("--tasks", default=",".join(TASKS),
                   help=f"comma-separated, of {','.join(TASKS)} (default all; empty: none)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated, of {','.join(METHODS)} (default all)")
    p.add_argument("--ppl-samples", type=int, default=8, help="perplexity windows per length (0: none; default 8)")
    p.add_argument("--haystack-dir", default=None, help="folder of .txt files (default: synthetic filler)")
    p.add_argument("--ppl-dir", default=None, help="folder of .txt files for perplexity (default: the haystack)")
    p.add_argument("--top-p", type=float, default=defaults.TOP_P,
                   help=f"KAP's top-p, the share of the proxy mass its lists keep (cosa, cosa-fp8, kap and "
                        f"both kap-ascending arms; default {defaults.TOP_P})")
    p.add_argument("--delta", type=float, default=defaults.DELTA,
                   help=f"OSK's skip threshold for cosa, cosa-fp8 and kap-ascending, and where kap-ascending-matched's "
                        f"search starts (<= 0: no in-kernel skip; kap and the peers always run without it; default "
                        f"{defaults.DELTA:g})")
    p.add_argument("--vote", choices=reference.VOTE_SCOPES, default=defaults.VOTE,
                   help=f"who decides a skip together, each 64-row half of a tile or the tile (cosa, cosa-fp8 "
                        f"and both kap-ascending arms; default {defaults.VOTE})")
    p.add_argument("--proxy-precision", choices=reference.PROXY_PRECISIONS, default=defaults.PROXY_PRECISION,
                   help=f"what KAP's proxy GEMM multiplies for cosa, kap and both kap-ascending arms: q and k as given "
                        f"(native), e4m3 copies (fp8), or fp8 from {defaults.FP8_PROXY_MIN_KEYS} keys on (auto; "
                        f"default {defaults.PROXY_PRECISION})")
    p.add_argument("--stride", type=int, default=defaults.STRIDE,
                   help=f"antidiagonal downsampling stride of KAP and of XAttention, a divisor of 128 "
                        f"(default {defaults.STRIDE})")
    p.add_argument("--min-prefill-tokens", type=int, default=1024,
                   help="prefills shorter than this stay dense (every method; default 1024)")
    p.add_argument("--match", default=None,
                   help="the peers' budgets, comma-separated, each entry a run of every peer: stage1 (per "
                        "row, the length of CoSA's stage-1 list; the default when cosa runs), realised "
                        "(per layer, CoSA's realised budget), none (their own adaptive rules; the default "
                        "otherwise), or a fixed budget in (0, 1]; e.g. stage1,none")
    p.add_argument("--xattn-threshold", type=float, default=0.9,
                   help="XAttention's own rule (with --match none): per query block, the blocks whose "
                        "normalised scores sum to this threshold (default 0.9)")
    p.add_argument("--flex-gamma", type=float, default=0.9,
                   help="FlexPrefill's own rule (with --match none): the attention coverage its blocks "
                        "keep (default 0.9)")
    p.add_argument("--flex-tau", type=float, default=0.1,
                   help="FlexPrefill's pattern choice: a head whose pooled estimate lies within this "
                        "Jensen-Shannon distance of its true attention is query-aware, the others "
                        "vertical-slash (default 0.1)")
    p.add_argument("--meanpool-top-p", type=float, default=0.95,
                   help="mean pooling's own rule (with --match none): the top-p of its block "
                        "probabilities (default 0.95)")
    p.add_argument("--max-new-tokens", type=int, default=48,
                   help="tokens of each greedy answer to a task prompt (default 48)")
    p.add_argument("--drop-failed-tasks", action=argparse.BooleanOptionalAction, default=True,
                   help="run dense first at each length and leave out of the other methods the tasks "
                        "whose dense score is below --min-dense-score (default on; needs dense among "
                        "--methods)")
    p.add_argument("--min-dense-score", type=float, default=0.5,
                   help="the dense mean score a task needs at a length to stay in (default 0.5)")
    p.add_argument("--bootstrap", type=int, default=2000,
                   help="bootstrap resamples of every interval (default 2000)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds after the program's start (the model's loading included) after which the run "
                        "stops between two prompts, saving what it has (continue it with --resume)")
    p.add_argument("--resume", default=None,
                   help="the results JSON of an earlier run of the same configuration (--methods and --match "
                        "may add to its own): its answers are kept, the rest run, and the file is completed "
                        "in place")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"),
                   help="dtype of the model's weights and activations (default bfloat16)")
    add_run_arguments(p)
    args = p.parse_args(argv)
    resolve_device(args)
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for flag, given, known in (("--tasks", args.tasks, TASKS), ("--methods", args.methods, METHODS)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            p.error(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    try:
        args.match = parse_match(args.match or ("stage1" if "cosa" in args.methods else "none"))
    except ValueError as e:
        p.error(str(e))
    if "cosa" not in args.methods and {"stage1", "realised"} & set(args.match):
        p.error("--match stage1 and realised need cosa among --methods")
    if args.samples < 1 or args.bootstrap < 1:
        p.error("--samples and --bootstrap must be at least 1")
    if args.time_limit is not None and not args.time_limit >= 0:  # also rejects nan
        p.error(f"--time-limit must be a number of seconds >= 0, got {args.time_limit}")
    if args.resume is not None and not Path(args.resume).is_file():
        p.error(f"--resume: {args.resume} is not a file (the results JSON of a stopped run)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # Counted from here, so that a run fits a wall-clock budget whatever the model takes to load.
    deadline = math.inf if args.time_limit is None else time.monotonic() + args.time_limit
    meta, json_path = start_run(args.out, "accuracy") if not args.resume else (run_metadata(), Path(args.resume))
    progress(f"loading {args.model}")
    model, tokenizer, name = load_model(args.model, args.device, getattr(torch, args.dtype))
    progress(f"{name}: {model.config.num_hidden_layers} layers, {model.config.num_attention_heads} query heads")
    resumed = load_resumed(json_path, args, name) if args.resume else None
    if resumed:
        progress(f"resuming {json_path}: {len(resumed['samples'])} answers and {len(resumed['ppl'])} perplexity "
                 "windows done")
    results = evaluate(args, model, tokenizer, name, meta, json_path, resumed, deadline)
    if not results["complete"]:
        if results.get("summary"):
            print(format_table(table_rows(results["summary"]), SUMMARY_COLUMNS))
            print("\nthe arms with every answer and perplexity window so far")
        print(f"stopped at --time-limit; continue with --resume {json_path}")
        return 0
    if args.plot and results["summary"]:
        png = json_path.with_suffix(".png")
        progress(f"plot -> {png}" if plot(results["summary"], png) else "no plot: matplotlib is not installed")
    print(format_table(table_rows(results["scores"]), SCORE_COLUMNS))
    print()
    print(format_table(table_rows(results["summary"]), SUMMARY_COLUMNS))
    print("\ndiff vs dense: the mean of method - dense over the same prompts, its paired 95% bootstrap interval; "
          "* where the interval excludes 0.\nppl / dense: the same on the windows' mean NLL, as a ratio; * where "
          "the interval excludes 1.\nsummary score: over the tasks kept at each length; skipped: the share of the "
          "stage-1 blocks that the skip left out.")
    for row in results["dropped"]:
        print(f"dropped at n={row['n']}: {row['task']} (dense {interval_text(row, 'score')} "
              f"< {args.min_dense_score:g})")
    print(f"\nresults: {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
