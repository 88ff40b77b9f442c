"""The CPU pieces of bench/vllm_soak.py: the seeded plan (lengths, shared prefixes at every alignment,
aborts, sampled requests), the engine loop over a stand-in engine, the figures, the targets' checks,
the bad settings, the arguments and the exits without vLLM or a model."""

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import accuracy_tasks  # noqa: E402
import vllm_soak  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def mixed_plan(tokenizer):
    return vllm_soak.plan_mixed(tokenizer, accuracy_tasks.haystack_sentences(None), 160, 32768, seed=0)


def test_the_mixed_plan_is_seeded_and_covers_the_soak(tokenizer, mixed_plan):
    sentences = accuracy_tasks.haystack_sentences(None)
    assert vllm_soak.plan_mixed(tokenizer, sentences, 160, 32768, seed=0) == mixed_plan
    assert vllm_soak.plan_mixed(tokenizer, sentences, 160, 32768, seed=1) != mixed_plan
    lengths = [len(r["ids"]) for r in mixed_plan]
    assert min(lengths) < 200 and 16384 < max(lengths) <= 32768 - vllm_soak.NEEDLE_NEW_TOKENS
    assert sum(n < 1000 for n in lengths) > 20 and sum(n > 8000 for n in lengths) > 20  # log-uniform
    kinds = {r["kind"] for r in mixed_plan}
    assert kinds == {"shared", *vllm_soak.SINGLE_TASKS}
    assert 0.25 < sum(r["kind"] == "shared" for r in mixed_plan) / len(mixed_plan) < 0.55
    aborted = [r for r in mixed_plan if r["abort_after_steps"]]
    assert len(aborted) == 8 and min(len(r["ids"]) for r in aborted) >= sorted(lengths)[len(lengths) // 2 - 1]
    sampled = [r for r in mixed_plan if r["n"] > 1]
    assert len(sampled) == 16 and all(r["seed"] is not None and not r["abort_after_steps"] for r in sampled)
    assert all(r["seed"] is None for r in mixed_plan if r["n"] == 1)
    assert len({r["id"] for r in mixed_plan}) == len(mixed_plan)


def test_shared_requests_are_cuts_of_their_document_asking_about_a_number_inside(tokenizer, mixed_plan):
    documents = [vllm_soak.shared_document(tokenizer, accuracy_tasks.haystack_sentences(None),
                                           32768 - vllm_soak.NEEDLE_NEW_TOKENS, d) for d in range(vllm_soak.DOCUMENTS)]
    shared = [r for r in mixed_plan if r["kind"] == "shared"]
    for r in shared:
        document = documents[r["document"]]
        assert r["ids"][:r["cut"]] == document["ids"][:r["cut"]]
        needle = next(n for n in document["needles"] if n["value"] == r["answers"][0])
        assert needle["end"] <= r["cut"]
        assert r["ids"][r["cut"]:] == vllm_soak.question_ids(tokenizer, needle["key"])
    assert all(len(d["needles"]) == vllm_soak.NEEDLES_PER_DOCUMENT for d in documents)
    assert all(d["needles"][0]["end"] < vllm_soak.MIN_LENGTH for d in documents)  # every cut holds one
    # Cached prefixes end at every offset modulo 128 that 16-token blocks allow.
    histogram = vllm_soak.alignment_histogram(vllm_soak.planned_cached_prefixes(mixed_plan))
    assert set(histogram) == set(range(0, 128, 16))


def test_planned_cached_prefixes_are_the_longest_earlier_cut_in_whole_blocks():
    def shared(document, cut):
        return {"document": document, "cut": cut}

    plan = [shared(0, 1000), {"document": None, "cut": None}, shared(0, 500), shared(1, 300), shared(0, 2000),
            shared(1, 290)]
    assert vllm_soak.planned_cached_prefixes(plan) == [0, 496, 0, 992, 288]
    assert vllm_soak.alignment_histogram([0, 496, 0, 992, 288]) == {32: 1, 96: 1, 112: 1}


def test_the_long_plan(tokenizer):
    plan = vllm_soak.plan_long(tokenizer, accuracy_tasks.haystack_sentences(None), 4, 8000, seed=0)
    top = 8000 - vllm_soak.NEEDLE_NEW_TOKENS
    assert all(vllm_soak.LONG_SPAN * top - 64 <= len(r["ids"]) <= top for r in plan)
    assert [r["kind"] for r in plan] == [*vllm_soak.SINGLE_TASKS, vllm_soak.SINGLE_TASKS[0]]
    assert not any(r["abort_after_steps"] or r["n"] > 1 for r in plan)


class StandInEngine:
    """vLLM's LLMEngine as the soak drives it: each request prefills for ``prefill_steps`` steps,
    then streams one token per step and sample (deltas) until ``new_tokens``; log-probabilities of
    ``bad`` requests are NaN."""

    def __init__(self, prefill_steps=2, new_tokens=3, bad=()):
        self.prefill_steps, self.new_tokens, self.bad = prefill_steps, new_tokens, set(bad)
        self.running, self.aborted, self.most_in_flight = {}, [], 0

    def add_request(self, request_id, prompt, params):
        assert prompt["prompt_token_ids"]
        self.running[request_id] = {"n": params["n"], "step": 0}
        self.most_in_flight = max(self.most_in_flight, len(self.running))

    def abort_request(self, request_ids):
        for request_id in request_ids:
            self.aborted.append(request_id)
            del self.running[request_id]

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        outputs = []
        for request_id, state in list(self.running.items()):
            state["step"] += 1
            token = state["step"] - self.prefill_steps
            if token < 1:
                continue
            value = math.nan if request_id in self.bad else -0.5
            completions = [SimpleNamespace(index=i, text=f" {i}", token_ids=[7],
                                           logprobs=[{7: SimpleNamespace(logprob=value)}]) for i in range(state["n"])]
            done = token == self.new_tokens
            outputs.append(SimpleNamespace(request_id=request_id, outputs=completions, finished=done))
            if done:
                del self.running[request_id]
        return outputs


def test_the_engine_loop_streams_aborts_and_counts_non_finite_log_probabilities():
    plan = [{"id": f"r{i}", "ids": [1, 2, 3], "n": 2 if i == 1 else 1, "abort_after_steps": 1 if i == 2 else None}
            for i in range(5)]
    engine = StandInEngine(bad={"r3"})
    ticks = iter(range(1000))
    records = vllm_soak.drive(engine, plan, lambda r: {"n": r["n"]}, in_flight=2, clock=lambda: next(ticks))
    assert engine.most_in_flight == 2 and engine.aborted == ["r2"]
    assert records["r2"]["aborted"] and records["r2"]["aborted_before_first_token"]
    assert records["r2"]["finished_s"] is None and records["r2"]["samples"] == []
    for request_id in ("r0", "r1", "r3", "r4"):
        record = records[request_id]
        assert not record["aborted"] and record["submitted_s"] < record["first_token_s"] < record["finished_s"]
    assert [s["text"] for s in records["r1"]["samples"]] == [" 0 0 0", " 1 1 1"]
    assert [s["tokens"] for s in records["r1"]["samples"]] == [3, 3]
    assert [s["nonfinite"] for s in records["r3"]["samples"]] == [3]
    assert sum(s["nonfinite"] for r in records.values() for s in r["samples"]) == 3
    plan[0]["answers"], plan[1]["answers"] = ["0"], ["1"]
    vllm_soak.score_records(records, plan[:2])
    assert records["r0"]["score"] == 1.0 and records["r1"]["score"] == 0.5  # the mean of the two samples


def test_non_finite_log_probabilities_of_either_form():
    def lp(value):
        return SimpleNamespace(logprob=value)

    assert vllm_soak.nonfinite_logprobs(None) == 0
    assert vllm_soak.nonfinite_logprobs([{1: lp(-1.0), 2: lp(-math.inf)}, None, {3: lp(math.nan)}]) == 2


def test_kv_blocks_preemptions_and_percentiles():
    pool = SimpleNamespace(num_gpu_blocks=100, get_num_free_blocks=lambda: 97)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=SimpleNamespace(
        scheduler=SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=pool))))))
    assert vllm_soak.kv_blocks_in_use(llm) == 2  # the null block is never free
    assert vllm_soak.kv_blocks_in_use(SimpleNamespace(llm_engine=None)) is None
    metric = SimpleNamespace
    assert vllm_soak.preemptions([metric(name="vllm:num_preemptions", value=3),
                                  metric(name="vllm:num_requests_running", value=9)]) == 3
    assert vllm_soak.preemptions([metric(name="vllm:num_requests_running", value=9)]) is None
    assert vllm_soak.percentile([], 0.5) is None
    assert vllm_soak.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert vllm_soak.percentile(list(range(101)), 0.99) == pytest.approx(99.0)


def engine_result(impl, phase, count, scores, ttft_ms=100.0, aborted=(), preemptions=5, leaked=0, nonfinite=0,
                  memory_delta=0):
    """An engine's results as the worker writes them: ``count`` requests, each finished with its score
    and a time to first token of ``ttft_ms`` (one value, or one per request), ``aborted`` indices
    aborted."""
    ttft = ttft_ms if isinstance(ttft_ms, list) else [ttft_ms] * count
    records = {}
    for i in range(count):
        if i in aborted:
            records[f"{phase}-{i:04d}"] = {"submitted_s": 0.0, "first_token_s": None, "finished_s": None,
                                           "aborted": True, "samples": []}
            continue
        records[f"{phase}-{i:04d}"] = {"submitted_s": 1.0, "first_token_s": 1.0 + ttft[i] / 1e3, "finished_s": 3.0,
                                       "aborted": False, "score": scores[i],
                                       "samples": [{"text": "x", "tokens": 4, "nonfinite": nonfinite if i == 0 else 0}]}
    return {"impl": impl, "phase": phase, "records": records, "wall_s": 10.0, "preemptions": preemptions,
            "kv_blocks_in_use": leaked, "memory_after_warmup": 1 << 30, "memory_at_end": (1 << 30) + memory_delta,
            "peak_memory": 3 << 30, "routing": {"requests": {"cosa": 7, "decode": 90}} if impl == "cosa" else None}


def soak_plan(phase, count):
    return [{"id": f"{phase}-{i:04d}", "ids": [0] * 100} for i in range(count)]


def good_results():
    scores = [1.0, 0.0] * 250
    return {("flash_attn", "mixed"): engine_result("flash_attn", "mixed", 500, scores, aborted={3, 9}),
            ("cosa", "mixed"): engine_result("cosa", "mixed", 500, scores, ttft_ms=90.0, aborted={3, 9}),
            ("flash_attn", "long"): engine_result("flash_attn", "long", 20, [1.0] * 20, preemptions=0),
            ("cosa", "long"): engine_result("cosa", "long", 20, [1.0] * 20, preemptions=0)}


PLANS = {"mixed": soak_plan("mixed", 500), "long": soak_plan("long", 20)}


def test_a_clean_soak_passes_with_its_figures():
    rows, differences, failures = vllm_soak.compare(good_results(), PLANS)
    assert failures == []
    cosa = next(r for r in rows if r["impl"] == "cosa" and r["phase"] == "mixed")
    assert (cosa["requests"], cosa["finished"], cosa["aborted"], cosa["lost"]) == (500, 498, 2, 0)
    assert cosa["tokens"] == 498 * 104 and cosa["tokens_per_s"] == pytest.approx(498 * 104 / 10)
    assert cosa["ttft_median_ms"] == pytest.approx(90.0) and cosa["ttft_p99_ms"] == pytest.approx(90.0)
    assert cosa["routing"] == "cosa 7, decode 90" and cosa["peak_memory_gib"] == 3
    assert differences["mixed"]["pairs"] == 498 and differences["mixed"]["diff"] == 0
    assert differences["long"] == {"pairs": 20, "diff": 0.0, "low": 0.0, "high": 0.0}


@pytest.mark.parametrize("change, words", [
    (dict(leaked=3), "3 KV blocks still in use"),
    (dict(leaked=None), "could not be read"),
    (dict(nonfinite=2), "2 non-finite log-probabilities"),
    (dict(preemptions=0), "no preemption"),
    (dict(preemptions=None), "no preemption"),
    (dict(aborted=()), "no request aborted"),
    (dict(memory_delta=100 << 20), "above its level"),
    (dict(scores=[0.0] * 500), "the interval must lie above -0.05"),
    (dict(ttft_ms=[100.0] * 490 + [900.0] * 10), "p99 time to first token"),
])
def test_each_missed_target_is_a_failure(change, words):
    results = good_results()
    kwargs = dict(scores=[1.0, 0.0] * 250, ttft_ms=90.0, aborted={3, 9})
    kwargs.update(change)
    results[("cosa", "mixed")] = engine_result("cosa", "mixed", 500, **kwargs)
    _, _, failures = vllm_soak.compare(results, PLANS)
    assert len(failures) == 1 and words in failures[0] and failures[0].startswith("mixed"), failures


def test_too_few_requests_a_crash_and_lost_requests_are_failures():
    results = good_results()
    few = {"mixed": soak_plan("mixed", 50), "long": soak_plan("long", 20)}
    results[("flash_attn", "mixed")] = engine_result("flash_attn", "mixed", 50, [1.0] * 50, aborted={3})
    results[("cosa", "mixed")] = engine_result("cosa", "mixed", 50, [1.0] * 50, aborted={3})
    _, _, failures = vllm_soak.compare(results, few)
    assert failures == ["mixed, FLASH_ATTN: 50 requests, the target is at least 500",
                        "mixed, CUSTOM: 50 requests, the target is at least 500"]
    results = good_results()
    results[("cosa", "long")] = "exit status 1: CUDA error: an illegal memory access"
    _, differences, failures = vllm_soak.compare(results, PLANS)
    assert failures == ["long, CUSTOM: the engine crashed: exit status 1: CUDA error: an illegal memory access"]
    assert differences["long"] is None
    results = good_results()
    del results[("cosa", "long")]["records"]["long-0007"]  # submitted, never seen again
    _, _, failures = vllm_soak.compare(results, PLANS)
    assert "long, CUSTOM: 1 requests neither finished nor were aborted" in failures


def test_bad_settings_must_each_be_refused_by_name():
    from cosa.integrations import vllm_plugin

    for settings, name in vllm_soak.BAD_SETTINGS:  # what the CoSA engine's start runs
        with pytest.raises(ValueError, match=name):
            vllm_plugin.Settings.from_additional_config({"cosa": settings})
    refused = [{"started": False, "error": f"ValueError: additional_config['cosa']: {name} is bad"}
               for _, name in vllm_soak.BAD_SETTINGS]
    assert vllm_soak.check_bad_settings(refused) == []
    refused[0] = {"started": True, "error": None}
    refused[2] = {"started": False, "error": "RuntimeError: Engine core initialization failed"}
    refused[3] = "exit status 1: out of memory"
    failures = vllm_soak.check_bad_settings(refused)
    assert len(failures) == 3 and "the engine started" in failures[0] and "without naming 'top_p'" in failures[1]
    assert "the start attempt itself failed" in failures[2]


def test_an_error_text_holds_its_causes():
    try:
        try:
            raise ValueError("additional_config['cosa']['vote'] bad")
        except ValueError as inner:
            raise RuntimeError("Engine core initialization failed") from inner
    except RuntimeError as outer:
        text = vllm_soak.error_text(outer)
    assert text == ("RuntimeError: Engine core initialization failed <- "
                    "ValueError: additional_config['cosa']['vote'] bad")


@pytest.mark.parametrize("bad, flag", [
    (["--requests", "0"], "--requests"), (["--long-requests", "-1"], "--long-requests"),
    (["--max-length", "50"], "--max-length"), (["--long-length", "1000", "--max-length", "2000"], "--long-length"),
    (["--kv-blocks", "100"], "--kv-blocks"), (["--in-flight", "0"], "--in-flight"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"), (["--yarn-factor", "1"], "--yarn-factor"),
    (["--haystack", "/nonexistent-haystack"], "--haystack"), (["--impls", "dense"], "--impls"),
])
def test_arguments_are_checked_by_name(bad, flag, tmp_path, capsys):
    with pytest.raises(SystemExit):
        vllm_soak.parse_args(["--model", str(tmp_path), *bad])
    assert flag in capsys.readouterr().err
    args = vllm_soak.parse_args(["--model", str(tmp_path)])
    assert (args.requests, args.long_requests, args.max_length, args.kv_blocks) == (500, 20, 32768, 3072)


def test_exits_2_without_a_model_folder_or_without_vllm(tmp_path, capsys, monkeypatch):
    pytest.importorskip("vllm")
    for blocked in (False, True):
        if blocked:
            monkeypatch.setitem(sys.modules, "vllm", None)
        with pytest.raises(SystemExit) as exit_info:
            vllm_soak.main(["--model", str(tmp_path), "--out", str(tmp_path)])
        assert exit_info.value.code == 2
        assert ("needs vLLM" if blocked else "not a model directory") in capsys.readouterr().err
    assert not list(tmp_path.glob("*.json"))


def test_exits_2_when_the_lengths_exceed_the_models_positions(tiny_model_dir, tmp_path, capsys):
    pytest.importorskip("vllm")
    assert vllm_soak.main(["--model", str(tiny_model_dir), "--out", str(tmp_path)]) == 2
    assert "--max-length 32768 exceeds the model's 4096 positions" in capsys.readouterr().err
    assert vllm_soak.main(["--model", str(tiny_model_dir), "--max-length", "4096", "--long-length", "20000",
                           "--out", str(tmp_path)]) == 2
    assert "--long-length 20000 exceeds the 16384 positions" in capsys.readouterr().err
