#!/usr/bin/env python3
"""vLLM soak: a bounded, seeded stream of requests against an engine with FlashAttention
(``FLASH_ATTN``) and one with CoSA's backend (``CUSTOM``), the same requests for both, every finished
one scored.

One plan of requests is built on the host before any engine starts, so that the two engines' answers
pair by request id. Each engine runs in a subprocess of its own (in-process engine core, so that its
scheduler and the backend's routing counts can be read); the requests go through
``LLMEngine.add_request`` with at most ``--in-flight`` unfinished at a time, stepped with
``LLMEngine.step``, each timed on the host (submitted, first token, finished). Phases:

- ``mixed``: ``--requests`` prompts of log-uniform lengths from 100 tokens to ``--max-length``, prefix
  caching on, a KV cache of ``--kv-blocks`` blocks (small enough that the scheduler preempts and
  recomputes). 40% are cut from a few shared documents (planted magic numbers, each request cut at its
  own length and asking about a number inside its cut), so that cached prefixes end at every offset
  modulo 128 that vLLM's 16-token blocks allow; the rest are niah_single, niah_multikey and vt prompts
  (bench/accuracy_tasks.py). 5% (from the longest half) are aborted after their first engine step,
  before their first token; 10% sample 2 answers at temperature 0.7 (scored as their mean); the rest
  are greedy.
- ``long``: ``--long-requests`` prompts of 92-100% of ``--long-length`` tokens with YaRN rope scaling
  (``--yarn-factor``), vLLM's default cache size.

Before the CoSA engines, engines are started with bad ``additional_config["cosa"]`` settings: each
must fail at start with a message that names the setting. Every request asks for the log-probability
of its tokens (``logprobs=1``); a non-finite one counts as a non-finite logit. At the end of a phase
each engine reads its KV blocks still in use (0 once every request has finished or been aborted), its
GPU memory against the level after the warm-up requests, its preemptions (vLLM's
``vllm:num_preemptions``) and, with CoSA, the routing counts.

    python bench/vllm_soak.py --model DIR [--requests 500] [--long-requests 20] [--kv-blocks 3072]
                              [--haystack DIR] [--plot] [--out bench/results]
"""

from __future__ import annotations

import collections
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (REPO_ROOT, argument_parser, finish_report, format_table, progress, save_figure,  # noqa: E402
                    start_run, write_json)
import accuracy_tasks  # noqa: E402
import models  # noqa: E402
import stats  # noqa: E402
from vllm_e2e import (IMPLS, NEEDLE_NEW_TOKENS, argparse_hidden, rank_routing_counts, reset_rank_routing,  # noqa: E402
                      run_engine, require_vllm_and_model)

PHASES = ("mixed", "long")
SINGLE_TASKS = ("niah_single", "niah_multikey", "vt")
MIN_LENGTH = 100
SHARED_SHARE = 0.4  # of the mixed requests, cut from a shared document
ABORT_SHARE = 0.05  # aborted after their first step, drawn from the longest half
SAMPLED_SHARE = 0.1  # sampled with n = SAMPLES
SAMPLES = 2
TEMPERATURE = 0.7
DOCUMENTS = 4
NEEDLES_PER_DOCUMENT = 12
LONG_SPAN = 0.92  # the long prompts' lengths: [LONG_SPAN * --long-length, --long-length]
VLLM_BLOCK = 16  # vLLM's default KV block: prefix caching hits whole blocks of it
COSA_BLOCK = 128  # CoSA's query blocks start on multiples of 128 keys (docs/vllm.md, the alignment piece)
# What the allocator may hold more at the end than after the warm-up without counting as a leak: vLLM
# allocates some buffers at the first batch of a size (sampler, logprobs), which no warm-up covers for
# every size.
MEMORY_SLACK_BYTES = 64 << 20
TARGETS = {"mixed": 500, "long": 20}  # the requests each phase must have run
SCORE_DIFF_FLOOR = -0.05  # the 95% interval of CoSA's score minus FLASH_ATTN's must lie above it
# Settings each CoSA engine start must refuse, with the name its message must hold.
BAD_SETTINGS = (({"min_prefill_token": 4096}, "min_prefill_token"), ({"min_prefill_tokens": -1}, "min_prefill_tokens"),
                ({"top_p": 1.5}, "top_p"), ({"vote": "row"}, "vote"))
# Where an in-process engine keeps its KV block pool (vLLM 0.24 and 0.34: LLM -> LLMEngine ->
# InprocClient -> EngineCore -> Scheduler -> KVCacheManager -> BlockPool).
KV_POOL_PATH = "llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool"
PREEMPTIONS_METRIC = "vllm:num_preemptions"
CHAT_MARK = "\0soak-user-turn\0"


# ---------------------------------------------------------------------------------------------
# The plan (host side, no vLLM)
# ---------------------------------------------------------------------------------------------

def chat_frame(tokenizer) -> tuple[str, str]:
    """The text before and after a user turn in the model's chat template (with the assistant's turn
    opened), or a bare frame for a tokenizer without one, as build_prompt renders it."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_MARK}], tokenize=False,
                                             add_generation_prompt=True)
        head, tail = text.split(CHAT_MARK)
        return head, tail
    return "", "\n"


def shared_document(tokenizer, sentences: list[str], length: int, seed: int) -> dict:
    """``{"ids", "needles"}``: ``length`` tokens of the chat frame's head, the needle intro and
    haystack sentences with NEEDLES_PER_DOCUMENT magic numbers planted at log-spaced depths, the first
    right after the intro; each needle as ``{"key", "value", "end"}`` (the token offset where it ends)."""
    rng = random.Random(f"document:{seed}")
    head, _ = chat_frame(tokenizer)
    ids = tokenizer.encode(f"{head}{accuracy_tasks.NIAH_INTRO}\n\n", add_special_tokens=not head)
    first, last = len(ids), max(len(ids) + 1, int(0.9 * length))
    depths = [int(first * (last / first) ** (i / (NEEDLES_PER_DOCUMENT - 1))) for i in range(NEEDLES_PER_DOCUMENT)]
    pending = accuracy_tasks.planted_needles(rng, NEEDLES_PER_DOCUMENT)
    needles = []
    sentence = rng.randrange(len(sentences))
    while len(ids) < length:
        if pending and len(ids) >= depths[len(needles)]:
            key, value, text = pending.pop(0)
            ids += tokenizer.encode(" " + text, add_special_tokens=False)
            needles.append({"key": key, "value": value, "end": len(ids)})
        else:
            ids += tokenizer.encode(" " + sentences[sentence % len(sentences)], add_special_tokens=False)
            sentence += 1
    return {"ids": ids[:length], "needles": [n for n in needles if n["end"] <= length]}


def question_ids(tokenizer, key: str) -> list[int]:
    """The tokens that close a cut of a shared document: the question about ``key``, the chat frame's
    tail and the answer's first words."""
    question, prefix = accuracy_tasks.magic_number_question(key)
    _, tail = chat_frame(tokenizer)
    return tokenizer.encode(f"\n\n{question}{tail}{prefix}", add_special_tokens=False)


def log_uniform_lengths(rng: random.Random, count: int, low: int, high: int) -> list[int]:
    return [int(round(math.exp(rng.uniform(math.log(low), math.log(high))))) for _ in range(count)]


def plan_mixed(tokenizer, sentences: list[str], count: int, max_length: int, seed: int) -> list[dict]:
    """The mixed phase's requests in submission order: ``{"id", "kind", "ids", "answers", "n", "seed",
    "abort_after_steps", "document", "cut"}`` (``kind`` a task of SINGLE_TASKS or ``shared``;
    ``document`` and ``cut`` for the shared ones). Prompts are at most ``max_length`` minus the new
    tokens long."""
    rng = random.Random(f"soak:mixed:{seed}")
    longest = max_length - NEEDLE_NEW_TOKENS
    lengths = log_uniform_lengths(rng, count, MIN_LENGTH, longest)
    documents = [shared_document(tokenizer, sentences, longest, seed * DOCUMENTS + d) for d in range(DOCUMENTS)]
    by_length = sorted(range(count), key=lambda i: lengths[i])
    aborted = set(rng.sample(by_length[count // 2:], max(1, round(ABORT_SHARE * count))))
    sampled = set(rng.sample([i for i in range(count) if i not in aborted], round(SAMPLED_SHARE * count)))
    requests = []
    for i, length in enumerate(lengths):
        request = {"id": f"mixed-{i:04d}", "n": SAMPLES if i in sampled else 1,
                   "seed": seed * 100_000 + i if i in sampled else None,
                   "abort_after_steps": 1 if i in aborted else None, "document": None, "cut": None}
        if rng.random() < SHARED_SHARE:
            d = rng.randrange(DOCUMENTS)
            needles = documents[d]["needles"]
            # A needle the cut holds with its question within the length (the first one when none fits).
            needle = rng.choice([n for n in needles if n["end"] + len(question_ids(tokenizer, n["key"])) <= length]
                                or needles[:1])
            question = question_ids(tokenizer, needle["key"])
            cut = max(length - len(question), needle["end"])
            request.update(kind="shared", document=d, cut=cut, answers=[needle["value"]],
                           ids=documents[d]["ids"][:cut] + question)
        else:
            task = rng.choice(SINGLE_TASKS)
            ids, answers, _ = accuracy_tasks.build_prompt(tokenizer, task, length, seed * 100_000 + i, sentences)
            request.update(kind=task, ids=ids, answers=answers)
        requests.append(request)
    return requests


def plan_long(tokenizer, sentences: list[str], count: int, long_length: int, seed: int) -> list[dict]:
    """The long phase's requests: SINGLE_TASKS in turn at lengths drawn from
    ``[LONG_SPAN * long_length, long_length]`` minus the new tokens, greedy, none aborted."""
    rng = random.Random(f"soak:long:{seed}")
    top = long_length - NEEDLE_NEW_TOKENS
    requests = []
    for i in range(count):
        task = SINGLE_TASKS[i % len(SINGLE_TASKS)]
        ids, answers, _ = accuracy_tasks.build_prompt(tokenizer, task, rng.randint(int(LONG_SPAN * top), top),
                                                      seed * 100_000 + i, sentences)
        requests.append({"id": f"long-{i:04d}", "kind": task, "ids": ids, "answers": answers, "n": 1, "seed": None,
                         "abort_after_steps": None, "document": None, "cut": None})
    return requests


def planned_cached_prefixes(requests: list[dict]) -> list[int]:
    """Each shared request's cached prefix in tokens, if nothing were evicted: the longest earlier
    cut of its document it shares, in whole vLLM blocks (vLLM caches full blocks only)."""
    longest_cut = collections.defaultdict(int)
    cached = []
    for r in requests:
        if r["document"] is None:
            continue
        cached.append(min(r["cut"], longest_cut[r["document"]]) // VLLM_BLOCK * VLLM_BLOCK)
        longest_cut[r["document"]] = max(longest_cut[r["document"]], r["cut"])
    return cached


def alignment_histogram(cached: list[int]) -> dict[int, int]:
    """``{offset: requests}`` of the cached prefixes' offsets modulo CoSA's 128-token blocks (prefixes
    of 0 tokens left out: nothing cached)."""
    return dict(sorted(collections.Counter(c % COSA_BLOCK for c in cached if c).items()))


# ---------------------------------------------------------------------------------------------
# The engine loop (duck-typed over vLLM's LLMEngine)
# ---------------------------------------------------------------------------------------------

def nonfinite_logprobs(logprobs) -> int:
    """Non-finite log-probabilities in one output's ``logprobs`` (a list, or vLLM's FlatLogprobs, of
    ``{token id: Logprob}`` per position; None when not asked for)."""
    return sum(not math.isfinite(lp.logprob) for position in (logprobs or []) for lp in (position or {}).values())


def drive(engine, requests: list[dict], sampling_params, in_flight: int, clock=time.perf_counter) -> dict:
    """Run ``requests`` through ``engine`` (``add_request``, ``step``, ``abort_request``,
    ``has_unfinished_requests``), at most ``in_flight`` unfinished at a time, outputs streamed as
    deltas. A request with ``abort_after_steps`` is aborted after that many engine steps since its
    submission, whatever it has produced. Returns ``{request id: record}`` with host times in seconds
    since the first submission and each sample's text, tokens and non-finite log-probabilities."""
    pending = collections.deque(requests)
    active: dict[str, dict] = {}
    records: dict[str, dict] = {}
    start = clock()
    while pending or engine.has_unfinished_requests():
        while pending and len(active) < in_flight:
            request = pending.popleft()
            engine.add_request(request["id"], {"prompt_token_ids": request["ids"]}, sampling_params(request))
            records[request["id"]] = {"submitted_s": clock() - start, "first_token_s": None, "finished_s": None,
                                      "steps": 0, "aborted": False, "samples": {}}
            active[request["id"]] = request
        outputs = engine.step()
        now = clock() - start
        for out in outputs:
            record = records[out.request_id]
            for completion in out.outputs:
                sample = record["samples"].setdefault(completion.index, {"text": "", "tokens": 0, "nonfinite": 0})
                sample["text"] += completion.text
                sample["tokens"] += len(completion.token_ids)
                sample["nonfinite"] += nonfinite_logprobs(completion.logprobs)
                if completion.token_ids and record["first_token_s"] is None:
                    record["first_token_s"] = now
            if out.finished:
                record["finished_s"] = now
                active.pop(out.request_id, None)
        for request_id, request in list(active.items()):
            record = records[request_id]
            record["steps"] += 1
            if request["abort_after_steps"] is not None and record["steps"] >= request["abort_after_steps"]:
                engine.abort_request([request_id])
                record.update(aborted=True, aborted_before_first_token=record["first_token_s"] is None)
                del active[request_id]
    for record in records.values():
        record["samples"] = [record["samples"][i] for i in sorted(record["samples"])]
    return records


def score_records(records: dict, requests: list[dict]) -> None:
    """Each finished request's score: the mean over its samples of accuracy_tasks.score_answer."""
    for request in requests:
        record = records[request["id"]]
        if record["finished_s"] is not None and record["samples"]:
            record["score"] = sum(accuracy_tasks.score_answer(s["text"], request["answers"])
                                  for s in record["samples"]) / len(record["samples"])


def kv_blocks_in_use(llm) -> int | None:
    """KV blocks held by requests (cached blocks no request holds are free); None where the pool is not
    at KV_POOL_PATH."""
    pool = llm
    for name in KV_POOL_PATH.split("."):
        pool = getattr(pool, name, None)
        if pool is None:
            return None
    return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # the pool's null block is never free


def preemptions(metrics) -> int | None:
    """vLLM's preemption counter in ``LLM.get_metrics()``'s snapshot; None where it has none."""
    found = [m.value for m in metrics if m.name in (PREEMPTIONS_METRIC, PREEMPTIONS_METRIC + "_total")]
    return sum(found) if found else None


def error_text(error: BaseException) -> str:
    """An exception's type and message with those of its causes, which a wrapper's message may not repeat."""
    parts = []
    while error is not None and len(parts) < 8:
        parts.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    return " <- ".join(parts)


# ---------------------------------------------------------------------------------------------
# Worker: one engine, one phase (or one start with bad settings)
# ---------------------------------------------------------------------------------------------

def engine_arguments(args, impl: str, phase: str) -> dict:
    kwargs = dict(model=args.model, dtype="bfloat16", seed=0, enable_prefix_caching=True, disable_log_stats=False,
                  gpu_memory_utilization=args.gpu_memory_utilization, attention_backend=IMPLS[impl])
    if phase == "mixed":
        kwargs.update(max_model_len=args.max_length, num_gpu_blocks_override=args.kv_blocks)
    else:
        kwargs.update(models.yarn_engine_arguments(args.model, args.yarn_factor))
    return kwargs


def bad_settings_worker(args) -> int:
    """One CoSA engine start with ``--settings``: whether it started, and the error it raised."""
    from vllm import LLM

    kwargs = engine_arguments(args, "cosa", "mixed")
    kwargs["additional_config"] = {"cosa": json.loads(args.settings)}
    result = {"settings": kwargs["additional_config"]["cosa"], "started": False, "error": None}
    try:
        LLM(**kwargs)
        result["started"] = True
    except Exception as error:  # noqa: BLE001 - any refusal is recorded, its message checked by the caller
        result["error"] = error_text(error)
    Path(args.result_file).write_text(json.dumps(result))
    return 0


def worker(args) -> int:
    """One engine through one phase of the plan; the results as JSON in --result-file."""
    if args.phase == "bad-settings":
        return bad_settings_worker(args)
    import torch
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    requests = json.loads(Path(args.plan_file).read_text())["requests"]
    started = time.perf_counter()
    llm = LLM(**engine_arguments(args, args.worker, args.phase))
    config = llm.llm_engine.vllm_config
    result = {"impl": args.worker, "phase": args.phase, "startup_s": time.perf_counter() - started,
              "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
              "block_size": config.cache_config.block_size, "num_gpu_blocks": config.cache_config.num_gpu_blocks,
              "kv_pool_path": KV_POOL_PATH}
    engine = llm.llm_engine

    def sampling_params(request):
        sampled = request["n"] > 1
        return SamplingParams(n=request["n"], temperature=TEMPERATURE if sampled else 0.0, seed=request["seed"],
                              logprobs=1, max_tokens=NEEDLE_NEW_TOKENS, output_kind=RequestOutputKind.DELTA)

    # Warm-up: the longest prompt of the plan, sampled and greedy, so that the buffers vLLM allocates
    # on first use exist before the memory level is taken.
    longest = max(requests, key=lambda r: len(r["ids"]))
    warmup = [{**longest, "id": f"warmup-{n}", "n": n, "seed": 0 if n > 1 else None, "abort_after_steps": None}
              for n in (1, SAMPLES)]
    progress(f"{args.worker} ({args.phase}): warm-up")
    drive(engine, warmup, sampling_params, args.in_flight)
    llm.reset_prefix_cache()
    if args.worker == "cosa":
        llm.collective_rpc(reset_rank_routing)
    torch.cuda.synchronize()
    result["memory_after_warmup"] = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    preempted_before = preemptions(llm.get_metrics())

    progress(f"{args.worker} ({args.phase}): {len(requests)} requests, at most {args.in_flight} in flight")
    t0 = time.perf_counter()
    records = drive(engine, requests, sampling_params, args.in_flight)
    torch.cuda.synchronize()
    result["wall_s"] = time.perf_counter() - t0
    score_records(records, requests)
    preempted_after = preemptions(llm.get_metrics())
    result.update(records=records, kv_blocks_in_use=kv_blocks_in_use(llm),
                  memory_at_end=torch.cuda.memory_allocated(), peak_memory=torch.cuda.max_memory_allocated(),
                  preemptions=None if preempted_after is None else preempted_after - (preempted_before or 0),
                  routing=llm.collective_rpc(rank_routing_counts)[0] if args.worker == "cosa" else None)
    Path(args.result_file).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------------------------
# Figures and checks (host side)
# ---------------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) of ``values``, linearly interpolated; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(result: dict, requests: list[dict]) -> dict:
    """One engine's row for a phase."""
    records = result["records"]
    finished = [r for r in requests if records.get(r["id"], {}).get("finished_s") is not None]
    ttft = [(records[r["id"]]["first_token_s"] - records[r["id"]]["submitted_s"]) * 1e3 for r in finished]
    generated = sum(s["tokens"] for record in records.values() for s in record["samples"])
    tokens = sum(len(r["ids"]) for r in finished) + generated
    routing = result.get("routing") or {}
    return {"phase": result["phase"], "impl": result["impl"], "requests": len(records), "finished": len(finished),
            "aborted": sum(record["aborted"] for record in records.values()),
            "lost": len(requests) - len(finished) - sum(records.get(r["id"], {}).get("aborted", False)
                                                        for r in requests),
            "tokens": tokens, "tokens_per_s": tokens / result["wall_s"] if result["wall_s"] else None,
            "preemptions": result["preemptions"], "ttft_median_ms": percentile(ttft, 0.5),
            "ttft_p99_ms": percentile(ttft, 0.99), "peak_memory_gib": result["peak_memory"] / 2**30,
            "memory_delta_mib": (result["memory_at_end"] - result["memory_after_warmup"]) / 2**20,
            "nonfinite": sum(s["nonfinite"] for record in records.values() for s in record["samples"]),
            "leaked_blocks": result["kv_blocks_in_use"],
            "score": (sum(records[r["id"]]["score"] for r in finished) / len(finished)) if finished else None,
            "routing": ", ".join(f"{k} {v}" for k, v in sorted(routing.get("requests", {}).items())) or None,
            "routing_tokens": routing.get("tokens")}


def score_difference(cosa: dict, flash: dict) -> dict | None:
    """CoSA's score minus FLASH_ATTN's on the requests both finished, paired by request id: ``{"pairs",
    "diff", "low", "high"}`` with the 95% bootstrap interval (bench/stats.py); None without pairs."""
    ids = sorted(i for i, r in cosa["records"].items() if "score" in r and "score" in flash["records"].get(i, {}))
    if not ids:
        return None
    diff, low, high = stats.paired_difference([cosa["records"][i]["score"] for i in ids],
                                              [flash["records"][i]["score"] for i in ids])
    return {"pairs": len(ids), "diff": diff, "low": low, "high": high}


def check_phase(phase: str, rows: dict, difference: dict | None) -> list[str]:
    """The phase's failed targets: ``rows`` are the engines' summaries by impl (FLASH_ATTN's and
    CoSA's when both ran), ``difference`` the paired score difference."""
    failures = []
    for impl, row in rows.items():
        where = f"{phase}, {IMPLS[impl]}"
        if row["requests"] < TARGETS[phase]:
            failures.append(f"{where}: {row['requests']} requests, the target is at least {TARGETS[phase]}")
        if row["lost"]:
            failures.append(f"{where}: {row['lost']} requests neither finished nor were aborted")
        if phase == "mixed" and not row["preemptions"]:
            failures.append(f"{where}: no preemption counted ({row['preemptions']}); the KV cache did not "
                            "run short (fewer --kv-blocks)")
        if phase == "mixed" and not row["aborted"]:
            failures.append(f"{where}: no request aborted")
        if row["leaked_blocks"] is None:
            failures.append(f"{where}: the KV blocks in use could not be read (no block pool at {KV_POOL_PATH})")
        elif row["leaked_blocks"]:
            failures.append(f"{where}: {row['leaked_blocks']} KV blocks still in use after every request ended")
        if row["memory_delta_mib"] * 2**20 > MEMORY_SLACK_BYTES:
            failures.append(f"{where}: GPU memory {row['memory_delta_mib']:.1f} MiB above its level after the warm-up")
        if row["nonfinite"]:
            failures.append(f"{where}: {row['nonfinite']} non-finite log-probabilities")
    if "cosa" in rows and "flash_attn" in rows:
        if difference is None:
            failures.append(f"{phase}: no request finished with both engines, no score difference")
        elif difference["low"] <= SCORE_DIFF_FLOOR:
            failures.append(f"{phase}: CoSA's score minus FLASH_ATTN's is {difference['diff']:+.3f} "
                            f"[{difference['low']:+.3f}, {difference['high']:+.3f}], the interval must lie above "
                            f"{SCORE_DIFF_FLOOR}")
        cosa_p99, flash_p99 = rows["cosa"]["ttft_p99_ms"], rows["flash_attn"]["ttft_p99_ms"]
        if cosa_p99 is not None and flash_p99 is not None and cosa_p99 > flash_p99:
            failures.append(f"{phase}: p99 time to first token {cosa_p99:.1f} ms with CoSA, "
                            f"{flash_p99:.1f} ms with FLASH_ATTN")
    return failures


def check_bad_settings(starts: list) -> list[str]:
    """Each bad setting's engine start must fail with a message naming the setting."""
    failures = []
    for (settings, name), start in zip(BAD_SETTINGS, starts, strict=True):
        if isinstance(start, str):
            failures.append(f"bad setting {settings}: the start attempt itself failed: {start}")
        elif start["started"]:
            failures.append(f"bad setting {settings}: the engine started")
        elif name not in start["error"]:
            failures.append(f"bad setting {settings}: refused without naming {name!r}: {start['error'][:300]}")
    return failures


def compare(results: dict, plans: dict) -> tuple[list[dict], dict, list[str]]:
    """The rows of every engine that ran, the score differences by phase and the failed checks;
    ``results`` maps ``(impl, phase)`` to an engine's results or why it failed."""
    rows, differences, failures = [], {}, []
    for phase, requests in plans.items():
        summaries = {}
        for impl in IMPLS:
            res = results.get((impl, phase))
            if isinstance(res, str):
                failures.append(f"{phase}, {IMPLS[impl]}: the engine crashed: {res}")
            elif res is not None:
                summaries[impl] = summarize(res, requests)
                rows.append(summaries[impl])
        both = all(isinstance(results.get((impl, phase)), dict) for impl in IMPLS)
        differences[phase] = (score_difference(results[("cosa", phase)], results[("flash_attn", phase)])
                              if both else None)
        failures += check_phase(phase, summaries, differences[phase])
    return rows, differences, failures


def plot(results: dict, path, model: str) -> bool:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = sorted({phase for _, phase in results}, key=PHASES.index)
    fig, axes = plt.subplots(1, len(phases), figsize=(6 * len(phases), 4), squeeze=False)
    for ax, phase in zip(axes[0], phases):
        for impl in IMPLS:
            res = results.get((impl, phase))
            if not isinstance(res, dict):
                continue
            ttft = sorted((r["first_token_s"] - r["submitted_s"]) * 1e3 for r in res["records"].values()
                          if r["finished_s"] is not None)
            ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=IMPLS[impl])
        ax.set(xscale="log", xlabel="time to first token (ms)", ylabel="share of finished requests",
               title=f"vLLM soak, {phase}: {model}")
        ax.legend()
    return save_figure(fig, path)


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argument_parser(__doc__)
    ap.add_argument("--model", required=True, help="a model directory vLLM can load")
    ap.add_argument("--requests", type=int, default=500, help="requests of the mixed phase (default 500)")
    ap.add_argument("--long-requests", type=int, default=20, help="requests of the long phase (0: none; default 20)")
    ap.add_argument("--max-length", type=int, default=32768,
                    help="the mixed phase's longest prompt plus its new tokens, and its engines' max_model_len")
    ap.add_argument("--long-length", type=int, default=130000,
                    help="the long phase's longest prompt plus its new tokens (default 130000)")
    ap.add_argument("--kv-blocks", type=int, default=3072,
                    help="KV-cache blocks of the mixed phase's engines (num_gpu_blocks_override; default 3072)")
    ap.add_argument("--in-flight", type=int, default=16, help="unfinished requests at most (default 16)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the plan (default 0)")
    ap.add_argument("--yarn-factor", type=float, default=4.0)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--haystack", default=None,
                    help="folder of .txt essays for the prompts (default: synthetic filler)")
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    ap.add_argument("--skip-bad-settings", action="store_true", help="no engine starts with bad CoSA settings")
    ap.add_argument("--log-dir", default=None, help="keep each engine's log here")
    ap.add_argument("--plot", action="store_true", help="also save the time-to-first-token distributions as a PNG")
    ap.add_argument("--out", default=str(REPO_ROOT / "bench" / "results"))
    ap.add_argument("--worker", choices=list(IMPLS), help=argparse_hidden())
    ap.add_argument("--phase", choices=(*PHASES, "bad-settings"), default="mixed", help=argparse_hidden())
    ap.add_argument("--plan-file", help=argparse_hidden())
    ap.add_argument("--settings", help=argparse_hidden())
    ap.add_argument("--result-file", help=argparse_hidden())
    args = ap.parse_args(argv)
    if args.requests < 1:
        ap.error("--requests must be at least 1")
    if args.long_requests < 0:
        ap.error("--long-requests must be 0 (no long phase) or more")
    if args.max_length < MIN_LENGTH + NEEDLE_NEW_TOKENS:
        ap.error(f"--max-length must be at least {MIN_LENGTH + NEEDLE_NEW_TOKENS} (the shortest prompt and "
                 f"{NEEDLE_NEW_TOKENS} new tokens)")
    if args.long_length <= args.max_length:
        ap.error("--long-length must be greater than --max-length")
    if args.kv_blocks - 1 < -(-args.max_length // VLLM_BLOCK):
        ap.error(f"--kv-blocks: {args.kv_blocks} blocks of {VLLM_BLOCK} tokens (one is vLLM's null block) do not "
                 f"hold one request of --max-length {args.max_length} tokens")
    if args.in_flight < 1:
        ap.error("--in-flight must be at least 1")
    if not 0 < args.gpu_memory_utilization <= 1:
        ap.error("--gpu-memory-utilization must be in (0, 1]")
    if not args.yarn_factor > 1:
        ap.error("--yarn-factor must be greater than 1")
    if args.haystack and not Path(args.haystack).is_dir():
        ap.error(f"--haystack {args.haystack} is not a folder")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    vllm, config = require_vllm_and_model("bench/vllm_soak.py", args.model)
    positions = config.get("max_position_embeddings", 32768)
    if args.max_length > positions:
        print(f"--max-length {args.max_length} exceeds the model's {positions} positions", file=sys.stderr)
        return 2
    yarn_positions = models.yarn_engine_arguments(args.model, args.yarn_factor)["max_model_len"]
    if args.long_requests and args.long_length > yarn_positions:
        print(f"--long-length {args.long_length} exceeds the {yarn_positions} positions the model "
              f"has with YaRN factor {args.yarn_factor}", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    meta, json_path = start_run(args.out, "vllm-soak")
    meta.update(vllm=vllm.__version__, model=Path(args.model).name, seed=args.seed, kv_blocks=args.kv_blocks,
                in_flight=args.in_flight, yarn_factor=args.yarn_factor)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    sentences = accuracy_tasks.haystack_sentences(args.haystack)
    progress(f"plan: {args.requests} mixed requests up to {args.max_length} tokens")
    plans = {"mixed": plan_mixed(tokenizer, sentences, args.requests, args.max_length, args.seed)}
    if args.long_requests:
        progress(f"plan: {args.long_requests} long requests up to {args.long_length} tokens")
        plans["long"] = plan_long(tokenizer, sentences, args.long_requests, args.long_length, args.seed)
    planned = {"alignment_histogram": alignment_histogram(planned_cached_prefixes(plans["mixed"])),
               **{f"{phase}_lengths": [len(r["ids"]) for r in requests] for phase, requests in plans.items()}}

    failures, bad_starts = [], None
    with tempfile.TemporaryDirectory() as folder:
        common_args = ["--model", args.model, "--max-length", str(args.max_length), "--long-length",
                       str(args.long_length), "--kv-blocks", str(args.kv_blocks), "--in-flight", str(args.in_flight),
                       "--yarn-factor", str(args.yarn_factor), "--gpu-memory-utilization",
                       str(args.gpu_memory_utilization)]
        if "cosa" in args.impls and not args.skip_bad_settings:
            bad_starts = [run_engine(__file__, [*common_args, "--worker", "cosa", "--phase", "bad-settings",
                                                "--settings", json.dumps(settings)],
                                     f"cosa with bad setting {name}", args.log_dir, f"vllm-soak-bad-{name}.log")
                          for settings, name in BAD_SETTINGS]
            failures += check_bad_settings(bad_starts)
        results = {}
        for phase, requests in plans.items():
            plan_file = Path(folder) / f"plan-{phase}.json"
            plan_file.write_text(json.dumps({"requests": requests}))
            for impl in args.impls:
                results[(impl, phase)] = run_engine(
                    __file__, [*common_args, "--worker", impl, "--phase", phase, "--plan-file", str(plan_file)],
                    f"{impl} ({phase})", args.log_dir, f"vllm-soak-{impl}-{phase}.log")
                rows, differences, _ = compare(results, {p: plans[p] for p in plans if p in {ph for _, ph in results}})
                write_json(json_path, {**meta, "planned": planned, "bad_settings": bad_starts, "rows": rows,
                                       "score_difference": differences,
                                       "engines": {f"{i}-{p}": r for (i, p), r in results.items()}})
    rows, differences, check_failures = compare(results, plans)
    failures += check_failures
    if args.plot:
        plot(results, json_path.with_suffix(".png"), Path(args.model).name)
    print(format_table(rows, ["phase", "impl", "requests", "finished", "aborted", "tokens", "preemptions",
                              "tokens_per_s", "ttft_median_ms", "ttft_p99_ms", "peak_memory_gib", "nonfinite",
                              "leaked_blocks", "score", "routing"]))
    for phase, difference in differences.items():
        if difference:
            print(f"{phase}: CoSA - FLASH_ATTN score {difference['diff']:+.3f} [{difference['low']:+.3f}, "
                  f"{difference['high']:+.3f}] over {difference['pairs']} requests")
    print(f"planned cached prefixes modulo {COSA_BLOCK}: {planned['alignment_histogram']}")
    return finish_report(json_path, failures)


if __name__ == "__main__":
    sys.exit(main())
