"""Small CPU runs of bench/fidelity.py, bench/e2e.py and bench/accuracy.py through their main()
(the reference path), plus the accuracy tasks' construction and scoring, its statistics (bootstrap
and paired intervals), the dropping of tasks dense fails, and the methods' lists (stage-1 matching,
the peers' own rules, KAP's lists in ascending order); the CPU pieces of
bench/kernel.py (the FA4 peer's call, the anchors' columns, the skip accounting) and of
bench/layers.py (arguments, the Q/K/V capture, one layer's rows with the timer stubbed, results), of
bench/long_context.py (the list agreement) and of bench/vllm_e2e.py (arguments, the rows of the two engines),
and the source digest every results file records."""

import contextlib
import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from cosa import defaults
from helpers import require_transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import accuracy  # noqa: E402
import accuracy_tasks  # noqa: E402
import common  # noqa: E402
import e2e  # noqa: E402
import fidelity  # noqa: E402
import kernel  # noqa: E402
import layers  # noqa: E402
import long_context  # noqa: E402
import stats  # noqa: E402
import vllm_e2e  # noqa: E402


HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def only_json(folder: Path, prefix: str) -> dict:
    files = sorted(folder.glob(f"{prefix}-*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def test_fidelity_synthetic_cpu(tmp_path):
    rc = fidelity.main(["--n", "2048", "--heads", "4", "2", "--head-dim", "64", "--budgets", "0.1", "0.3",
                        "--deltas", "200", "1000", "--plot", "--out", str(tmp_path)])
    assert rc == 0
    data = only_json(tmp_path, "fidelity")
    mask_rows = [r for r in data["rows"] if r["section"] == "mask"]
    assert {r["method"] for r in mask_rows} == set(fidelity.METHODS)
    assert len(mask_rows) == len(fidelity.METHODS) * 3
    for r in mask_rows:
        assert 0 < r["budget"] <= 1 and 0 <= r["recall"] <= 1 and 0 <= r["iou"] <= 1 and r["rel_err"] >= 0
    oracle = {r["target_budget"]: r for r in mask_rows if r["method"] == "oracle" and r["selection"] == "budget"}
    for r in mask_rows:  # nothing keeps more attention mass than the oracle at the same budget
        if r["selection"] == "budget":
            assert r["mass"] <= oracle[r["target_budget"]]["mass"] + 1e-6
    skip = {(r["order"], r["delta"]): r for r in data["rows"] if r["section"] == "skip"}
    assert set(skip) == {(o, d) for o in ("kap", "ascending") for d in (0.0, 200.0, 1000.0)}
    assert skip[("kap", 0.0)]["skip_ratio"] == 0
    for delta in (200.0, 1000.0):  # the KAP order lets the same skip scale skip at least as much
        assert skip[("kap", delta)]["skip_ratio"] >= skip[("ascending", delta)]["skip_ratio"]
    assert skip[("kap", 1000.0)]["skip_ratio"] > 0
    assert any(tmp_path.glob("fidelity-*.png")) or not HAS_MATPLOTLIB


def test_fidelity_model_capture_cpu(tmp_path, tiny_model_dir):
    rc = fidelity.main(["--n", "--model", str(tiny_model_dir), "--model-n", "512", "--model-layers", "0,1",
                        "--budgets", "0.5", "--deltas", "100", "--methods", "oracle,kap,xattention",
                        "--device", "cpu", "--out", str(tmp_path)])
    assert rc == 0
    rows = only_json(tmp_path, "fidelity")["rows"]
    assert {r["layer"] for r in rows} == {0, 1}
    assert {r["source"] for r in rows} == {f"model:{tiny_model_dir.name}"}
    assert all(r["n"] == 512 for r in rows)


def test_e2e_cpu(tmp_path):
    require_transformers()  # the tiny Llama-shaped model
    rc = e2e.main(["--config", "tiny", "--device", "cpu", "--n", "512", "--impls", "dense-math,cosa,budgets",
                   "--budgets", "0.5", "--reps", "1", "--plot", "--out", str(tmp_path)])
    assert rc == 0
    rows = only_json(tmp_path, "e2e")["rows"]
    assert [r["impl"] for r in rows] == ["dense-math", "cosa", "cosa-50%"]
    assert all(r["ttft_ms"] > 0 and r["x_dense"] > 0 for r in rows)
    assert 0 < rows[1]["realised"] <= rows[1]["budget"] <= 1
    assert rows[2]["budget"] == pytest.approx(0.7)  # 4 query blocks keep 1, 2, 2, 2 of 1, 2, 3, 4 blocks


def test_e2e_real_model_cpu(tmp_path, tiny_model_dir):
    rc = e2e.main(["--model", str(tiny_model_dir), "--device", "cpu", "--n", "512", "--impls", "dense-math,cosa",
                   "--reps", "1", "--out", str(tmp_path)])
    assert rc == 0
    run = only_json(tmp_path, "e2e")
    assert run["config"]["model"] == tiny_model_dir.name and run["config"]["weights"] == "trained"
    assert [r["impl"] for r in run["rows"]] == ["dense-math", "cosa"]
    assert 0 < run["rows"][1]["realised"] <= run["rows"][1]["budget"] <= 1


def test_e2e_rejects_layers_with_a_model(tiny_model_dir):
    with pytest.raises(SystemExit):
        e2e.main(["--model", str(tiny_model_dir), "--layers", "2", "--device", "cpu", "--n", "512"])


def accuracy_run(tmp_path, model_dir, *extra):
    """bench/accuracy.py's main on the tiny model, small enough for the CPU; returns the results JSON."""
    rc = accuracy.main(["--model", str(model_dir), "--min-prefill-tokens", "256", "--max-new-tokens", "3",
                        "--device", "cpu", "--bootstrap", "200", "--out", str(tmp_path), *extra])
    assert rc == 0
    return only_json(tmp_path, "accuracy")


def arms(rows) -> set:
    return {(r["method"], r["match"]) for r in rows}


def test_accuracy_cpu(tmp_path, tiny_model_dir):
    data = accuracy_run(tmp_path, tiny_model_dir, "--lengths", "512", "--samples", "2", "--ppl-samples", "2",
                        "--no-drop-failed-tasks", "--plot")
    expected = {(m, "stage1" if m in accuracy.proxies.PEERS else None) for m in accuracy.METHODS}
    assert arms(data["samples"]) == arms(data["scores"]) == arms(data["summary"]) == expected
    assert {(r["method"], r["task"]) for r in data["scores"]} == {(m, t) for m in accuracy.METHODS
                                                                  for t in accuracy_tasks.TASKS}
    assert all(r["tokens"] <= 512 for r in data["samples"])
    assert data["dropped"] == [] and data["config"]["match"] == ["stage1"]
    for r in data["scores"] + data["summary"]:
        assert r["ci_low"] <= r["score"] + 1e-12 and r["score"] <= r["ci_high"] + 1e-12
        paired = (r["diff"], r["diff_ci_low"], r["diff_ci_high"], r["diff_excludes_zero"])
        if r["method"] == "dense":
            assert paired == (None,) * 4
        else:
            assert r["diff_ci_low"] <= r["diff_ci_high"] and isinstance(r["diff_excludes_zero"], bool)
    for r in data["summary"]:
        assert r["ppl"] > 1 and r["ppl_ci_low"] <= r["ppl"] <= r["ppl_ci_high"] and r["windows"] == 2
        assert 0 < r["realised"] <= r["stage1"] <= 1 and 0 <= r["skipped"] < 1
        assert (r["ppl_ratio"] is None) == (r["method"] == "dense")
    assert any(tmp_path.glob("accuracy-*.png")) or not HAS_MATPLOTLIB


def test_accuracy_cosa_fp8_arm(tmp_path, tiny_model_dir, monkeypatch):
    """cosa-fp8 runs KAP with the fp8 proxy and cosa with --proxy-precision's, on the same prompts."""
    seen = []
    real_kap = accuracy.cosa.kap

    def spy(*a, **kw):
        seen.append(kw["proxy_precision"])
        return real_kap(*a, **kw)

    monkeypatch.setattr(accuracy.cosa, "kap", spy)
    data = accuracy_run(tmp_path, tiny_model_dir, "--lengths", "512", "--samples", "1", "--ppl-samples", "0",
                        "--tasks", "niah_single", "--methods", "dense,cosa,cosa-fp8", "--no-drop-failed-tasks")
    assert arms(data["samples"]) == {("dense", None), ("cosa", None), ("cosa-fp8", None)}
    calls = len(seen) // 2  # the sparse calls of one prefill, once per arm
    assert calls > 0 and seen == [defaults.PROXY_PRECISION] * calls + ["fp8"] * calls
    fp8 = next(r for r in data["samples"] if r["method"] == "cosa-fp8")
    assert 0 < fp8["realised"] <= fp8["stage1"] <= 1


def test_accuracy_peers_at_a_fixed_budget(tmp_path, tiny_model_dir):
    data = accuracy_run(tmp_path, tiny_model_dir, "--lengths", "1024", "--samples", "1", "--ppl-samples", "0",
                        "--tasks", "niah_single", "--methods", "xattention,meanpool", "--match", "0.30")
    for r in data["samples"]:
        assert r["match"] == "0.3"
        assert r["stage1"] < 0.6  # 8 query blocks at budget 0.3 (each row keeps at least two)


def test_accuracy_match_stage1_and_none_in_one_run(tmp_path, tiny_model_dir):
    data = accuracy_run(tmp_path, tiny_model_dir, "--lengths", "512", "--samples", "1", "--ppl-samples", "1",
                        "--tasks", "niah_single", "--methods", "dense,cosa,xattention,flexprefill",
                        "--match", "stage1,none", "--no-drop-failed-tasks")
    expected = {("dense", None), ("cosa", None), ("xattention", "stage1"), ("xattention", "none"),
                ("flexprefill", "stage1"), ("flexprefill", "none")}
    for rows in (data["samples"], data["ppl"], data["scores"], data["summary"]):
        assert arms(rows) == expected
    assert len(data["samples"]) == len(expected)  # one prompt, each arm once


def test_accuracy_drops_the_tasks_dense_fails(tmp_path, tiny_model_dir, capsys):
    """Random weights answer nothing: with the default rule dense runs alone on the tasks, both are
    dropped, and the other methods still run the perplexity windows."""
    argv = ["--lengths", "512", "--samples", "2", "--ppl-samples", "1", "--tasks", "niah_single,vt",
            "--methods", "dense,cosa,xattention"]
    data = accuracy_run(tmp_path / "dropped", tiny_model_dir, *argv)
    assert [(d["n"], d["task"], d["score"], d["samples"]) for d in data["dropped"]] == [
        (512, "niah_single", 0.0, 2), (512, "vt", 0.0, 2)]
    assert {r["method"] for r in data["samples"]} == {"dense"}
    assert all(r["dropped"] for r in data["scores"])
    assert arms(data["ppl"]) == {("dense", None), ("cosa", None), ("xattention", "stage1")}
    assert all(r["score"] is None and r["ppl"] > 1 for r in data["summary"])
    assert "dropped at n=512: niah_single" in capsys.readouterr().out
    kept = accuracy_run(tmp_path / "kept", tiny_model_dir, *argv, "--min-dense-score", "0")
    assert kept["dropped"] == [] and {r["method"] for r in kept["samples"]} == {"dense", "cosa", "xattention"}


def test_dropped_tasks_rule():
    def row(method, n, task, score):
        return {"method": method, "match": None, "n": n, "task": task, "sample": 0, "score": score}

    samples = ([row("dense", 8192, "niah_single", s) for s in (1.0, 1.0, 0.4, 0.8)]  # 0.8: kept
               + [row("dense", 8192, "vt", s) for s in (0.0, 0.6, 0.6, 0.4)]  # 0.4: dropped
               + [row("dense", 8192, "cwe", s) for s in (0.5, 0.5)]  # exactly the threshold: kept
               + [row("cosa", 8192, "cwe", 0.0), row("dense", 16384, "niah_single", 0.0)])  # other method, length
    dropped = accuracy.dropped_tasks(samples, 8192, 0.5, 500, 0)
    assert [(d["task"], d["samples"]) for d in dropped] == [("vt", 4)]
    assert dropped[0]["score"] == pytest.approx(0.4) and 0.0 <= dropped[0]["ci_low"] < 0.4 < dropped[0]["ci_high"]


def test_source_digest_names_the_code(tmp_path):
    """Every results file records `sources`: it changes with a byte of csrc/ or cosa/ and with a
    file's name, not with files of other folders or suffixes (build outputs, caches)."""
    for rel, text in (("csrc/osk/a.cuh", "x"), ("csrc/b.cu", "y"), ("cosa/c.py", "z")):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    first = common.source_digest(tmp_path)
    assert len(first) == 12 and int(first, 16) >= 0
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "d.py").write_text("ignored")
    (tmp_path / "cosa" / "_C.abi3.so").write_bytes(b"ignored")
    (tmp_path / "cosa" / "__pycache__").mkdir()
    (tmp_path / "cosa" / "__pycache__" / "c.cpython-312.pyc").write_bytes(b"ignored")
    assert common.source_digest(tmp_path) == first
    (tmp_path / "csrc" / "b.cu").write_text("y ")
    changed = common.source_digest(tmp_path)
    assert changed != first
    (tmp_path / "csrc" / "b.cu").rename(tmp_path / "csrc" / "e.cu")
    assert common.source_digest(tmp_path) not in (first, changed)
    assert "sources" in common.run_metadata() and common.run_metadata()["sources"] == common.source_digest()


def test_bootstrap_interval_on_known_distributions():
    low, high = stats.bootstrap_interval([0.7] * 20)
    assert low == high == pytest.approx(0.7)
    assert stats.bootstrap_interval([0.25]) == (0.25, 0.25)
    # 60 ones in 200: mean 0.3, standard error sqrt(0.3 * 0.7 / 200) = 0.032, so a 95% interval ~0.127 wide.
    outcomes = [1.0] * 60 + [0.0] * 140
    low, high = stats.bootstrap_interval(outcomes, resamples=4000, seed=3)
    assert low < 0.3 < high and 0.10 < high - low < 0.16
    assert stats.bootstrap_interval(outcomes, 4000, 3) == (low, high)  # seeded: the same bounds again
    narrow = stats.bootstrap_interval(outcomes, 4000, 3, level=0.5)
    assert low < narrow[0] < narrow[1] < high
    with pytest.raises(ValueError):
        stats.bootstrap_interval([])


def test_paired_difference():
    baseline = [1.0, 0.0, 0.5, 1.0, 0.0, 0.25, 0.75, 1.0]
    assert stats.paired_difference(baseline, baseline) == (0.0, 0.0, 0.0)
    # A constant shift on inputs of very different difficulty: pairing leaves no spread, while the
    # unpaired interval of either side is wide.
    diff, low, high = stats.paired_difference([b + 0.125 for b in baseline], baseline)
    assert diff == low == high == pytest.approx(0.125)
    spread = stats.bootstrap_interval(baseline)
    assert spread[1] - spread[0] > 0.3
    with pytest.raises(ValueError):
        stats.paired_difference([1.0, 0.0], [1.0])


def test_accuracy_aggregate_pairs_with_dense_and_leaves_dropped_tasks_out():
    rng = torch.Generator().manual_seed(0)
    dense = (torch.rand(40, generator=rng) < 0.5).float().tolist()
    better = [1.0] * 40

    def rows(method, match, task, scores):
        return [{"method": method, "match": match, "n": 1024, "task": task, "sample": s, "score": v,
                 "stage1": 1.0 if method == "dense" else 0.4, "realised": 1.0 if method == "dense" else 0.3}
                for s, v in enumerate(scores)]

    samples = (rows("dense", None, "niah_single", dense) + rows("kap", None, "niah_single", dense)
               + rows("cosa", None, "niah_single", better) + rows("xattention", "stage1", "niah_single", dense[::-1])
               + rows("dense", None, "vt", [0.0] * 40))
    nll = [2.0, 2.5, 1.5, 3.0]
    ppl_rows = [{"method": m, "match": None, "n": 1024, "sample": s, "nll": 1000 * (v + shift), "tokens": 1000,
                 "stage1": 1.0, "realised": 1.0} for m, shift in (("dense", 0.0), ("cosa", 0.01))
                for s, v in enumerate(nll)]
    dropped = [{"n": 1024, "task": "vt"}]
    scores, summary = accuracy.aggregate(samples, ppl_rows, dropped, 1000, 0)
    score = {(r["method"], r["task"]): r for r in scores}
    assert score["dense", "vt"]["dropped"] and not score["dense", "niah_single"]["dropped"]
    identical = score["kap", "niah_single"]
    assert (identical["diff"], identical["diff_ci_low"], identical["diff_ci_high"]) == (0.0, 0.0, 0.0)
    assert identical["diff_excludes_zero"] is False
    assert identical["ci_low"] < identical["score"] < identical["ci_high"]
    gain = score["cosa", "niah_single"]
    assert gain["diff"] == pytest.approx(1 - sum(dense) / 40) and gain["diff_ci_low"] > 0 and gain["diff_excludes_zero"]
    shuffled = score["xattention", "niah_single"]  # the same scores on other prompts: no mean difference
    assert shuffled["diff"] == pytest.approx(0.0) and shuffled["diff_ci_low"] < 0 < shuffled["diff_ci_high"]
    total = {(r["method"], r["match"]): r for r in summary}
    assert [r["method"] for r in summary] == ["dense", "cosa", "kap", "xattention"]
    assert total["dense", None]["score"] == pytest.approx(sum(dense) / 40)  # vt left out
    assert total["dense", None]["tasks"] == 1 and total["dense", None]["samples"] == 40
    assert total["cosa", None]["skipped"] == pytest.approx(1 - (40 * 0.3 + 4) / (40 * 0.4 + 4))
    assert total["dense", None]["ppl"] == pytest.approx(math.exp(sum(nll) / 4))
    ratio = total["cosa", None]
    assert ratio["ppl_ratio"] == pytest.approx(math.exp(0.01))  # the same shift on every window
    assert ratio["ppl_ratio_ci_low"] == pytest.approx(math.exp(0.01)) and ratio["ppl_ratio_excludes_one"]
    assert ratio["ppl_ci_low"] < math.exp(0.01) * total["dense", None]["ppl"] < ratio["ppl_ci_high"]
    table = common.format_table(accuracy.table_rows(scores), accuracy.SCORE_COLUMNS)
    assert f"{gain['score']:.3f} [{gain['ci_low']:.3f}, {gain['ci_high']:.3f}]" in table
    assert f"{gain['diff']:.3f} [{gain['diff_ci_low']:.3f}, {gain['diff_ci_high']:.3f}]*" in table
    assert "0.000 [0.000, 0.000]*" not in table


def test_accuracy_arguments(tiny_model_dir):
    base = ["--model", str(tiny_model_dir)]
    args = accuracy.parse_args(base)
    assert (args.samples, args.lengths, args.ppl_samples) == (50, [8192, 16384, 32768], 8)
    assert (args.drop_failed_tasks, args.min_dense_score, args.bootstrap, args.match) == (True, 0.5, 2000, ["stage1"])
    assert accuracy.parse_args(base + ["--methods", "dense,xattention"]).match == ["none"]
    assert accuracy.parse_args(base + ["--match", "stage1, none,0.20,none"]).match == ["stage1", "none", "0.2"]
    assert not accuracy.parse_args(base + ["--no-drop-failed-tasks"]).drop_failed_tasks
    assert accuracy.arms_of(accuracy.parse_args(base + ["--methods", "xattention,cosa,dense",
                                                        "--match", "stage1,none"])) == [
        ("dense", None), ("cosa", None), ("xattention", "stage1"), ("xattention", "none")]
    for bad in (["--match", "cosa"], ["--match", "1.5"], ["--match", ","], ["--match", "stage1", "--methods", "dense"],
                ["--match", "realised", "--methods", "xattention"], ["--methods", "kap-descending"]):
        with pytest.raises(SystemExit):
            accuracy.parse_args(base + bad)


def layer_qkv(n=1024, seed=0):
    """q, k of one structured layer (sinks, a band, needles, stripes, slashes) in bf16."""
    return accuracy.proxies.contiguous(accuracy.proxies.structured_problem(n, 4, 2, 64, seed=seed))[:2]


def test_kap_ascending_runs_kaps_lists_in_ascending_order(tiny_model_dir):
    runner = accuracy.Runner(None, accuracy.parse_args(["--model", str(tiny_model_dir), "--top-p", "0.9"]))
    layer = SimpleNamespace(layer_idx=3, scaling=None)
    q, k = layer_qkv()
    kap_order, kap_counts = runner.selector("kap", None)(layer, q, k)
    cosa_order, cosa_counts = runner.selector("cosa", None)(layer, q, k)
    order, counts = runner.selector("kap-ascending", None)(layer, q, k)
    assert torch.equal(cosa_order, kap_order) and torch.equal(cosa_counts, kap_counts)  # cosa: the same lists
    assert torch.equal(counts, kap_counts) and runner.lists == {(3, 1024, 1024): counts}
    assert (kap_counts < torch.arange(1, 9)).any()  # KAP dropped blocks somewhere
    for h in range(order.shape[0]):
        for i in range(order.shape[1]):
            c = int(counts[h, i])
            assert order[h, i, :c].tolist() == sorted(kap_order[h, i, :c].tolist())
            assert (order[h, i, c:] == -1).all()
    assert not torch.equal(order, kap_order)  # KAP's own order is not ascending: the two runs differ


def test_peers_without_a_match_use_their_own_adaptive_rules(tiny_model_dir):
    args = accuracy.parse_args(["--model", str(tiny_model_dir), "--methods", "xattention,flexprefill,meanpool"])
    runner = accuracy.Runner(None, args)
    layer = SimpleNamespace(layer_idx=0, scaling=None)
    q, k = layer_qkv(seed=1)
    for peer in accuracy.proxies.PEERS:
        order, counts = runner.selector(peer, "none")(layer, q, k)
        own = accuracy.proxies.peer_selection(peer, q, k, stride=args.stride, xattn_threshold=args.xattn_threshold,
                                              flex_gamma=args.flex_gamma, flex_tau=args.flex_tau,
                                              meanpool_top_p=args.meanpool_top_p)[1]
        expected = accuracy.proxies.mask_to_lists(own)
        assert torch.equal(order, expected[0]) and torch.equal(counts, expected[1]), peer
        # Adaptive: the rows of one query block differ between heads (a uniform count would not).
        assert (counts != counts[:1]).any(), peer


def test_stage1_matching_gives_each_peer_cosas_list_lengths(tiny_model_dir, monkeypatch):
    """The tiny model's attention is too diffuse for KAP to drop much, so its lists are cut here to
    seeded random lengths: the peers must then keep exactly those lengths, row by row."""
    args = accuracy.parse_args(["--model", str(tiny_model_dir), "--device", "cpu", "--min-prefill-tokens", "256",
                                "--match", "stage1,realised"])
    model, tokenizer, _ = accuracy.load_model(str(tiny_model_dir), "cpu", torch.bfloat16)
    runner = accuracy.Runner(model, args)
    ids = accuracy_tasks.haystack_token_ids(tokenizer, None, 1024)
    kap_lists = accuracy.kap_lists
    cuts = torch.Generator().manual_seed(0)

    def cut_kap_lists(q, k, a, scale):
        order, counts = kap_lists(q, k, a, scale)
        counts = (1 + (counts - 1) * torch.rand(counts.shape, generator=cuts)).int()
        listed = torch.arange(order.shape[-1])[None, None, :] < counts[..., None]
        return torch.where(listed, order, -1), counts

    monkeypatch.setattr(accuracy, "kap_lists", cut_kap_lists)

    def forward():
        return accuracy.tail_nll(model, ids)

    runner.new_prompt()
    runner.run("cosa", None, forward, ids)
    cosa_counts = runner.cosa_lists
    assert set(cosa_counts) == {(0, 1024, 1024), (1, 1024, 1024)}
    # Lengths that differ between the heads of one query block: no count per query block could give them.
    assert all((c != c[:1]).any() for c in cosa_counts.values())
    for peer in accuracy.proxies.PEERS:
        runner.run(peer, "stage1", forward, ids)
        assert runner.lists.keys() == cosa_counts.keys(), peer
        for call, counts in cosa_counts.items():
            assert torch.equal(runner.lists[call], counts), (peer, call)
        runner.run(peer, "realised", forward, ids)
        for (layer, _, _), counts in runner.lists.items():
            uniform = accuracy.proxies.budget_counts(8, 8, 0, runner.cosa_realised[layer])
            assert torch.equal(counts, uniform.expand_as(counts).int()), (peer, layer)
    runner.new_prompt()  # a new prompt without CoSA's run: nothing to match, and no silent fallback
    with pytest.raises(RuntimeError, match="cosa must run before the matched peers"):
        runner.run("xattention", "stage1", forward, ids)


def test_accuracy_skip_only_where_the_method_has_it(tiny_model_dir, monkeypatch):
    """cosa, cosa-fp8 and kap-ascending run OSK with the skip at --delta and --vote; kap and the peers
    without it."""
    import cosa.integrations.transformers as cosa_hf

    settings = {}
    enable = cosa_hf.enable

    def recording_enable(model, **kwargs):
        settings[method] = (kwargs["delta"], kwargs["vote"])
        return enable(model, **kwargs)

    monkeypatch.setattr(cosa_hf, "enable", recording_enable)
    args = accuracy.parse_args(["--model", str(tiny_model_dir), "--device", "cpu", "--min-prefill-tokens", "256",
                                "--delta", "300", "--vote", "tile", "--match", "none"])
    model, tokenizer, _ = accuracy.load_model(str(tiny_model_dir), "cpu", torch.bfloat16)
    runner = accuracy.Runner(model, args)
    ids = accuracy_tasks.haystack_token_ids(tokenizer, None, 512)
    runner.new_prompt()
    for method, match in accuracy.arms_of(args):
        _, budgets = runner.run(method, match, lambda: accuracy.tail_nll(model, ids), ids)
        assert 0 < budgets["realised"] <= budgets["stage1"] <= 1
    skip = (300.0, "tile")
    matched_delta, matched_vote = settings.pop("kap-ascending-matched")
    assert matched_delta > 0 and matched_vote == "tile"
    assert settings == {"cosa": skip, "cosa-fp8": skip, "kap": (0.0, "tile"), "kap-ascending": skip,
                        **{peer: (0.0, "tile") for peer in accuracy.proxies.PEERS}}


def matched_runner(tiny_model_dir, monkeypatch):
    """A Runner whose prefills are replaced by a skipped share that grows with delta / keys as the
    skip's does (0.1 at delta 2000 over 8192 keys, at most 0.9); returns it, the deltas run and the
    prompt (``prompt["keys"]``: its length, which the stand-in share reads)."""
    runner = accuracy.Runner(None, accuracy.parse_args(["--model", str(tiny_model_dir), "--delta", "2000"]))
    deltas = []
    prompt = {"keys": 8192}

    def fake_sparse_run(method, match, fn, delta):  # probes are prefills (not run here), the last run answers
        assert method == "kap-ascending-matched"
        deltas.append(delta)
        share = min(0.9, 0.1 * (delta / prompt["keys"] * 4.096) ** 1.5)
        return fn() if fn is answer else None, {"stage1": 0.5, "realised": 0.5 * (1 - share)}

    monkeypatch.setattr(runner, "sparse_run", fake_sparse_run)
    return runner, deltas, prompt


def answer():
    return "answer"


@pytest.mark.parametrize("target", [0.42, 0.05, 0.0, 0.95])
def test_kap_ascending_matched_finds_the_delta_of_cosas_skip_share(tiny_model_dir, monkeypatch, target):
    """The search over log(delta) reaches CoSA's skip share from --delta, upwards or downwards; the
    final run uses the delta found and its rows record it. A prompt on which CoSA skipped nothing
    keeps --delta; a share out of reach below 0.99 of the prompt's length gets the closest delta
    probed."""
    runner, deltas, prompt = matched_runner(tiny_model_dir, monkeypatch)
    ids = list(range(prompt["keys"]))
    with pytest.raises(RuntimeError, match="cosa must run before"):
        runner.run("kap-ascending-matched", None, answer, ids)
    runner.cosa_skipped = {"share": target}
    result, budgets = runner.run("kap-ascending-matched", None, answer, ids)
    assert result == "answer" and budgets["skip_target"] == target and budgets["delta"] == deltas[-1]
    if target == 0.0:
        assert deltas == [2000.0]
        return
    assert deltas[0] == 2000.0 and len(deltas) <= accuracy.EQUAL_SKIP_PROBES + 1
    assert all(d <= 0.99 * len(ids) for d in deltas)
    if target > 0.9:
        assert budgets["delta"] == max(deltas[:-1]) and accuracy.skipped_share(budgets) < target
    else:
        assert abs(accuracy.skipped_share(budgets) - target) <= accuracy.EQUAL_SKIP_TOLERANCE


def test_kap_ascending_matched_starts_from_the_previous_prompts_answer(tiny_model_dir, monkeypatch):
    """The next prompt's search starts from the last delta found, as a share of the prompt's length:
    where the skip behaves alike, one prefill finds it."""
    runner, deltas, prompt = matched_runner(tiny_model_dir, monkeypatch)
    runner.cosa_skipped = {"share": 0.42}
    runner.run("kap-ascending-matched", None, answer, list(range(8192)))
    first_search = len(deltas) - 1
    found = deltas[-1]
    deltas.clear()
    prompt["keys"] = 4096
    _, budgets = runner.run("kap-ascending-matched", None, answer, list(range(4096)))
    assert deltas == [found / 2, found / 2] and first_search > 1
    assert abs(accuracy.skipped_share(budgets) - 0.42) <= accuracy.EQUAL_SKIP_TOLERANCE


@pytest.mark.parametrize("task", accuracy_tasks.TASKS)
def test_prompts_fit_and_hold_their_answers(task, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    sentences = accuracy_tasks.haystack_sentences(None)
    ids, answers, count = accuracy_tasks.build_prompt(tokenizer, task, 1024, 0, sentences)
    assert 900 < len(ids) <= 1024 and count > 0
    text = tokenizer.decode(ids).replace(" ", "")
    assert answers and all(a.replace(" ", "") in text for a in answers)
    assert accuracy_tasks.score_answer(" ".join(answers), answers) == 1.0
    assert accuracy_tasks.score_answer("nothing", answers) == 0.0


def test_essay_question_asks_for_the_sentence_that_follows_a_unique_one():
    hay = ["Short one.",
           "This sentence appears twice in the haystack and cannot be asked about.",
           "Cities were built near rivers because water carried goods cheaply.",
           "Merchants gathered wherever barges unloaded their cargo.",
           "This sentence appears twice in the haystack and cannot be asked about.",
           "Every later paragraph repeats the earlier point about rivers and water.",
           "Nothing follows this closing remark about harbours."]
    question, answers = accuracy_tasks.essay_question(hay, 0.0)
    # The nearest askable sentence to depth 0: index 2 (index 1 occurs twice, index 0 is too short).
    assert '"Cities were built near rivers because water carried goods cheaply."' in question
    assert answers == ["merchants", "gathered", "wherever", "unloaded"]  # longest first, then earliest
    assert accuracy_tasks.score_answer(hay[3], answers) == 1.0
    assert accuracy_tasks.score_answer(hay[2], answers) == 0.0  # echoing the quoted sentence scores nothing
    # Near the end: index 5, whose answers skip "about", a word of its own.
    question, answers = accuracy_tasks.essay_question(hay, 1.0)
    assert question.count("Every later paragraph") == 1
    assert answers == ["harbours", "nothing", "follows", "closing"]
    with pytest.raises(ValueError, match="no sentence of a 2-sentence haystack"):
        accuracy_tasks.essay_question(hay[:2], 0.5)


def test_essay_prompt_grows_past_haystacks_too_short_to_ask_about(tiny_model_dir, monkeypatch):
    """The search for the haystack that fills the length starts at 16 sentences: where none of them
    can be asked about it grows on instead of failing, and where no haystack that fits holds one it
    raises instead of growing forever."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    sentences = accuracy_tasks.haystack_sentences(None)
    real = accuracy_tasks.essay_question

    def askable_from_40(hay, depth):
        if len(hay) < 40:
            raise accuracy_tasks.NothingToAsk("too short")
        return real(hay, depth)

    monkeypatch.setattr(accuracy_tasks, "essay_question", askable_from_40)
    ids, answers, count = accuracy_tasks.build_prompt(tokenizer, "essay_qa", 1024, 0, sentences)
    assert len(ids) <= 1024 and count >= 40 and len(answers) == accuracy_tasks.ESSAY_QA_WORDS

    def never_askable(hay, depth):
        raise accuracy_tasks.NothingToAsk("never")

    monkeypatch.setattr(accuracy_tasks, "essay_question", never_askable)
    with pytest.raises(ValueError, match="never"):
        accuracy_tasks.build_prompt(tokenizer, "essay_qa", 1024, 0, sentences)


def test_accuracy_resume_adds_a_task(tmp_path, tiny_model_dir, capsys):
    """--resume with a task the file lacks runs it for every arm (dense judging it first, as at the
    start: random weights fail it, so it is dropped and the sparse arms do not answer it), keeps the
    earlier answers, and refuses a resume that leaves out a task of the file."""
    common = ["--lengths", "512", "--samples", "2", "--ppl-samples", "1", "--methods", "dense,cosa"]
    first = accuracy_run(tmp_path, tiny_model_dir, *common, "--tasks", "niah_single", "--min-dense-score", "0")
    path = next(tmp_path.glob("accuracy-*.json"))
    run = ["--model", str(tiny_model_dir), "--min-prefill-tokens", "256", "--max-new-tokens", "3", "--device", "cpu",
           "--bootstrap", "200", "--resume", str(path), *common]
    capsys.readouterr()
    assert accuracy.main([*run, "--tasks", "niah_single,essay_qa", "--min-dense-score", "0"]) == 0
    kept = json.loads(path.read_text())
    assert kept["complete"] and kept["config"]["tasks"] == ["niah_single", "essay_qa"]
    assert [r for r in kept["samples"] if r["task"] == "niah_single"] == first["samples"]
    assert {(r["method"], r["task"]) for r in kept["samples"]} == {
        (m, t) for m in ("dense", "cosa") for t in ("niah_single", "essay_qa")}
    # With the default rule: the file's length was judged already (niah_single dropped there), and
    # the new task is judged when it is added: dense fails it too, so it is dropped as well.
    second = tmp_path / "second"
    accuracy_run(second, tiny_model_dir, *common, "--tasks", "niah_single")
    path = next(second.glob("accuracy-*.json"))
    run[run.index("--resume") + 1] = str(path)
    capsys.readouterr()
    assert accuracy.main([*run, "--tasks", "niah_single,essay_qa"]) == 0
    judged = json.loads(path.read_text())
    assert [(d["n"], d["task"]) for d in judged["dropped"]] == [(512, "niah_single"), (512, "essay_qa")]
    assert {r["method"] for r in judged["samples"]} == {"dense"}
    err = capsys.readouterr().err
    assert "n=512: essay_qa dropped" in err and "niah_single dropped" not in err
    with pytest.raises(SystemExit, match="--tasks must include that run's niah_single, essay_qa"):
        accuracy.main([*run, "--tasks", "essay_qa"])


def test_a_stored_haystack_count_renders_the_prompt_once(tiny_model_dir, monkeypatch):
    """The count that the search found gives the same prompt with one tokenization instead of the
    search's dozen; a count that no longer fits (another tokenizer, say) is searched for again."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    sentences = accuracy_tasks.haystack_sentences(None)
    searched = accuracy_tasks.build_prompt(tokenizer, "niah_multikey", 1024, 3, sentences)
    encode, calls = tokenizer.encode, []
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: calls.append(1) or encode(*a, **k))
    assert accuracy_tasks.build_prompt(tokenizer, "niah_multikey", 1024, 3, sentences, searched[2]) == searched
    assert len(calls) == 1
    assert accuracy_tasks.build_prompt(tokenizer, "niah_multikey", 1024, 3, sentences, 4 * searched[2]) == searched
    assert len(calls) > 5


def test_haystack_from_a_text_folder(tmp_path):
    (tmp_path / "b.txt").write_text("Second file. It has two sentences!")
    (tmp_path / "a.txt").write_text("First file here.   With spacing?")
    assert accuracy_tasks.haystack_sentences(str(tmp_path)) == ["First file here.", "With spacing?", "Second file.",
                                                          "It has two sentences!"]
    assert len(accuracy_tasks.filler_sentences(5, 1)) == 5
    assert accuracy_tasks.filler_sentences(5, 1) == accuracy_tasks.filler_sentences(5, 1)


# ---------------------------------------------------------------------------------------------
# bench/kernel.py
# ---------------------------------------------------------------------------------------------


def sdpa_as_fa4(q4, k4, v4, softmax_scale=None, causal=False):
    """FA4's calling convention ([B, N, H, d], GQA native) served by SDPA, for the CPU."""
    out = F.scaled_dot_product_attention(q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2),
                                         is_causal=causal, scale=softmax_scale, enable_gqa=True)
    return out.transpose(1, 2)


def test_kernel_fa4_call_with_or_without_lse():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn((256, h, 64), generator=gen) for h in (4, 2, 2))
    plain = kernel.fa4_dense(sdpa_as_fa4, q, k, v, softmax_scale=0.1)
    with_lse = kernel.fa4_dense(lambda *a, **kw: (sdpa_as_fa4(*a, **kw), None), q, k, v, softmax_scale=0.1)
    assert plain.shape == (256, 4, 64)
    assert torch.equal(plain, with_lse)
    order, counts = kernel.causal_lists(2, 4, "cpu")
    torch.testing.assert_close(plain, kernel.reference_rows(q, k, v, order, counts, [0, 1], 0.1))


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn-4 is installed here")
def test_kernel_fa4_peers_left_out_when_the_package_is_missing():
    fa4, why = kernel.load_fa4()
    assert fa4 is None and "flash-attn-4" in why
    fa4, reasons = kernel.load_peers(["dense", "flex"])
    assert fa4 is None and reasons == {"fa4": why, "flex-flash": why}
    assert kernel.load_peers(["osk"]) == (None, {"fa4": None, "flex-flash": None})  # not imported at all


def kernel_row(kind, impl, n, ms):
    return {"kind": kind, "impl": impl, "n": n, "ms": ms}


def test_kernel_speedups_over_cudnn_and_fa4():
    rows = [kernel_row("dense", "sdpa-cudnn", 4096, 2.0), kernel_row("dense", "fa4", 4096, 1.6),
            kernel_row("osk", "dense", 4096, 1.0), kernel_row("kap", "stride-8", 4096, 0.1),
            kernel_row("osk", "dense", 8192, 3.0)]
    kernel.add_speedups(rows)
    osk, kap, lone = rows[2], rows[3], rows[4]
    assert osk["x_cudnn"] == pytest.approx(2.0) and osk["x_fa4"] == pytest.approx(1.6)
    assert kap["frac_of_cudnn"] == pytest.approx(0.05) and kap["frac_of_fa4"] == pytest.approx(0.0625)
    assert "frac_of_fa4" not in osk
    assert lone["x_cudnn"] is None and lone["x_fa4"] is None
    columns = kernel.table_columns(rows)
    assert columns.index("x_fa4") == columns.index("x_cudnn") + 1
    assert "x_fa4" in common.format_table(rows, columns).splitlines()[0]
    assert not set(kernel.FA4_COLUMNS) & set(kernel.table_columns([r for r in rows if r["impl"] != "fa4"]))


def test_paired_share_is_the_median_of_per_round_ratios():
    """A round where both are slow (a clock dip) moves neither the median nor the quartiles much: the
    ratio is taken within each round."""
    kap_ms = [0.66, 0.67, 0.65, 0.80, 0.66, 0.66, 0.67]
    fa4_ms = [13.2, 13.3, 13.1, 16.0, 13.2, 13.3, 13.2]
    share = common.paired_ratio(kap_ms, fa4_ms)
    q1, q3 = common.paired_ratio_quartiles(kap_ms, fa4_ms)
    assert share == pytest.approx(statistics.median(k / f for k, f in zip(kap_ms, fa4_ms)))
    assert q1 <= share <= q3 and q3 - q1 < 0.001


def test_kernel_kap_share_of_fa4_goes_into_the_row(monkeypatch):
    """The paired KAP / FA4 rounds fill the checked KAP row: the share, its quartiles and a note; a run
    without FA4 leaves the row as it was."""
    timed = []

    def fake_interleaved(fns, rounds):
        timed.append(sorted(fns))
        return {"kap": [0.66] * rounds, "fa4": [13.2] * rounds}

    monkeypatch.setattr(kernel, "interleaved_ms", fake_interleaved)
    monkeypatch.setattr(kernel.torch.cuda, "synchronize", lambda: None)
    inputs = SimpleNamespace(q=torch.zeros(4, 2, 8), k=torch.zeros(4, 1, 8), v=torch.zeros(4, 1, 8))
    ctx = {"sets": SimpleNamespace(first=inputs, take=lambda: inputs), "n": 32768}
    fake_cosa = SimpleNamespace(set_device_checks=lambda enabled: contextlib.nullcontext())
    fa4 = lambda q, k, v, softmax_scale=None, causal=False: q  # noqa: E731

    bench = kernel.Bench(SimpleNamespace(only=["kap"]), {}, fake_cosa, {}, None, fa4=fa4)
    row = {"impl": "stride-8-fp8", "note": "top_p 0.95"}
    bench.kap_share_of_fa4(ctx, lambda s: None, row)
    assert timed == [["fa4", "kap"]]
    assert row["frac_of_fa4_paired"] == pytest.approx(0.05)
    assert row["frac_of_fa4_paired_quartiles"] == pytest.approx([0.05, 0.05])
    assert row["note"] == f"top_p 0.95; 5.00% of FA4 dense in {kernel.PAIRED_ROUNDS} paired rounds [5.00 5.00]"

    without = kernel.Bench(SimpleNamespace(only=["kap"]), {}, fake_cosa, {}, None, fa4=None)
    row = {"impl": "stride-8-fp8", "note": "top_p 0.95"}
    without.kap_share_of_fa4(ctx, lambda s: None, row)
    assert row == {"impl": "stride-8-fp8", "note": "top_p 0.95"} and len(timed) == 1


def test_kernel_skipped_output_counts_halves():
    counts = torch.tensor([[1, 2], [1, 2]], dtype=torch.int32)  # 6 blocks listed, 4 of them diagonal
    skipped = torch.tensor([[0, 2], [0, 1]], dtype=torch.int32)  # a whole block and one half
    assert kernel.skipped_blocks(skipped) == 1.5
    assert kernel.block_flops(counts, skipped) == 4 * 128 * 128 * 128 * (6 - 1.5 - 0.5 * 4)


# ---------------------------------------------------------------------------------------------
# bench/layers.py
# ---------------------------------------------------------------------------------------------


@pytest.fixture()
def haystack_dir(tmp_path):
    folder = tmp_path / "essays"
    folder.mkdir()
    (folder / "one.txt").write_text(" ".join(accuracy_tasks.filler_sentences(300, 0)))
    return folder


def test_layers_arguments(tmp_path, haystack_dir):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"")
    base = ["--model", str(model), "--haystack", str(haystack_dir)]
    args = layers.parse_args(base)
    assert (args.n, args.layers, args.seed, args.plot) == (32768, None, 0, False)
    assert layers.parse_args(base + ["--layers", "27,2,8,2", "--n", "8192"]).layers == [2, 8, 27]
    lists = layers.parse_args(base + ["--lists-only", "--device", "cpu"])
    assert (lists.lists_only, lists.device) == (True, "cpu") and not args.lists_only
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv in (base + ["--layers", "2,x"], base + ["--layers", "-1"], base + ["--n", "1000"],
                 base + ["--device", "cpu"], base + ["--lists-only", "--device", "tpu"],
                 base + ["--save-ab-inputs", str(tmp_path / "ab.bin")],
                 ["--model", str(model)], ["--model", str(tmp_path / "absent"), "--haystack", str(haystack_dir)],
                 ["--model", str(model), "--haystack", str(empty)]):
        with pytest.raises(SystemExit):
            layers.parse_args(argv)


def test_layers_default_layers_spread_over_the_depth():
    assert layers.default_layers(28) == [2, 8, 14, 20, 27]
    assert layers.default_layers(36) == [2, 10, 18, 26, 35]
    assert layers.default_layers(2) == [1]
    assert layers.default_layers(1) == [0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without a GPU")
def test_layers_exits_2_without_a_gpu(tmp_path, haystack_dir, capsys):
    with pytest.raises(SystemExit) as stop:
        layers.main(["--model", str(tmp_path), "--haystack", str(haystack_dir)])
    assert stop.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def tiny_causal_lm(family: str):
    """Three layers of the family with random float32 weights, 4 query heads over 2 KV heads, d 32."""
    require_transformers()
    import transformers

    config_class, model_class = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                                 "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                                 "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[family]
    config = getattr(transformers, config_class)(
        hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, vocab_size=64, max_position_embeddings=512)
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config).eval()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_capture_is_what_the_attention_kernel_receives(family):
    """The captured q, k, v, attended causally with the module's scale, give exactly the layer's own
    attention output (o_proj's input): the tensors are post-RoPE (and post-norm in Qwen3)."""
    model = tiny_causal_lm(family)
    ids = torch.randint(0, 64, (1, 96), generator=torch.Generator().manual_seed(1))
    attention_out = {}
    hooks = [model.model.layers[i].self_attn.o_proj.register_forward_pre_hook(
        lambda module, inputs, i=i: attention_out.__setitem__(i, inputs[0][0])) for i in (0, 2)]
    captured = fidelity.capture_qkv(model, ids, {0, 2})
    for hook in hooks:
        hook.remove()
    scales = layers.attention_scales(model)
    assert set(captured) == {0, 2} and scales == {i: pytest.approx(32 ** -0.5) for i in range(3)}
    for layer, (q, k, v) in captured.items():
        assert q.shape == (96, 4, 32) and k.shape == v.shape == (96, 2, 32)
        out = sdpa_as_fa4(q[None], k[None], v[None], softmax_scale=scales[layer], causal=True)[0]
        torch.testing.assert_close(out.reshape(96, -1), attention_out[layer], rtol=1e-4, atol=1e-5)


def test_layers_capture_from_a_model_folder(tiny_model_dir, haystack_dir):
    captured, facts = layers.capture_layers(str(tiny_model_dir), str(haystack_dir), 256, None, 0, "cpu")
    assert facts == {"model": tiny_model_dir.name, "num_layers": 2, "layers": [1], "hq": 2, "hkv": 1, "d": 64,
                     "yarn_factor": None}
    q, k, v, scale = captured[1]
    assert q.shape == (256, 2, 64) and k.shape == v.shape == (256, 1, 64) and q.dtype == torch.bfloat16
    assert scale == pytest.approx(64 ** -0.5)
    with pytest.raises(ValueError, match="2 layers"):
        layers.capture_layers(str(tiny_model_dir), str(haystack_dir), 256, [0, 2], 0, "cpu")


def test_capture_with_yarn_changes_the_rotated_queries_only(tiny_model_dir, haystack_dir):
    plain, _ = layers.capture_layers(str(tiny_model_dir), str(haystack_dir), 256, [0], 0, "cpu")
    yarn, facts = layers.capture_layers(str(tiny_model_dir), str(haystack_dir), 256, [0], 0, "cpu", yarn_factor=4.0)
    assert facts["yarn_factor"] == 4.0
    q0, k0, v0, _ = plain[0]
    q1, k1, v1, _ = yarn[0]
    assert torch.equal(v0, v1)  # the first layer's values carry no rotary embedding
    assert not torch.allclose(q0.float(), q1.float())


def test_layers_checked_rows_and_errors():
    assert layers.checked_blocks(256) == [0, 36, 73, 109, 146, 182, 219, 255]
    assert layers.checked_blocks(3) == [0, 1, 2] and layers.checked_blocks(1) == [0]
    ref = torch.randn((10, 3, 8), generator=torch.Generator().manual_seed(0))
    out = ref.clone()
    out[4, 1] *= 1.5
    rel_err, max_row_err = layers.errors(out, ref)
    assert max_row_err == pytest.approx(0.5)
    assert rel_err == pytest.approx(0.5 * float(ref[4, 1].norm() / ref.norm()))
    out[0, 0, 0] = float("nan")
    assert all(e != e for e in layers.errors(out, ref))


def test_layers_one_layer_on_the_cpu(monkeypatch):
    """Every row of one layer through the ops' CPU path, the timer and the dense kernel stubbed
    (common.time_ms and SDPA cuDNN need a GPU). 2560 tokens: the skip is on (delta 2000 < N)."""
    import cosa
    from torch.nn.attention import SDPBackend

    monkeypatch.setattr(layers, "time_ms", lambda fn: 1.0)
    monkeypatch.setattr(layers, "interleaved_ms", lambda fns: {impl: [1.0, 1.0, 1.0] for impl in fns})
    monkeypatch.setattr(layers, "sdpa", lambda backend, *a: kernel.sdpa(SDPBackend.MATH, *a))
    n = 2560
    problem = cosa.testing.random_problem([n], [n], 4, 2, 64, 128, torch.bfloat16, "cpu", structure="mixed", seed=3)
    q, k, v = (problem["q"], cosa.reference.gather_kv(problem["k_cache"], problem["page_table"], 0, n),
               cosa.reference.gather_kv(problem["v_cache"], problem["page_table"], 0, n))
    run = layers.LayerRun(cosa, None, seed=0)
    run.layer(5, q, k, v, None)
    assert run.failures == []
    rows = {r["impl"]: r for r in run.rows}
    assert list(rows) == ["cudnn", *layers.COSA_VARIANTS, "kap", "kap-fp8", "osk", "osk-fp8", *layers.OSK_SKIP_VARIANTS]
    assert all(r["layer"] == 5 and r["n"] == n and r["kind"] == "layer" for r in run.rows)
    assert rows["cudnn"]["rel_err"] < 1e-2 and rows["cudnn"]["stage1_budget"] == 1.0
    for impl in layers.COSA_VARIANTS:
        r = rows[impl]
        kap_row = rows["kap-fp8" if impl == "cosa-fp8" else "kap"]
        assert r["stage1_budget"] == kap_row["stage1_budget"]  # the same lists every time
        assert 0 < r["realised_budget"] <= r["stage1_budget"] < 1
        assert r["rel_err"] <= r["max_row_err"] and r["rel_err"] < 0.5
    assert rows["cosa-noskip"]["realised_budget"] == rows["cosa-noskip"]["stage1_budget"]
    assert rows["cosa"]["realised_budget"] < rows["cosa"]["stage1_budget"]
    # The default vote, per warpgroup, skips at least what the tile vote skips.
    assert rows["cosa"]["realised_budget"] <= rows["cosa-tile"]["realised_budget"]
    assert rows["kap"]["rel_err"] is None and rows["kap"]["realised_budget"] is None
    fp8 = rows["kap-fp8"]
    assert 0.9 < fp8["iou_vs_native"] <= 1 and 0 < fp8["mass_fp8"] <= 1 and 0 < fp8["mass_native"] <= 1
    # OSK alone on each precision's lists is the second stage of the CoSA row with that proxy.
    for osk_impl, cosa_impl in (("osk", "cosa"), ("osk-fp8", "cosa-fp8"), ("osk-noskip", "cosa-noskip"),
                                ("osk-skipnone", "cosa-noskip")):  # nothing skipped: the skip-off output
        for key in ("stage1_budget", "realised_budget", "rel_err", "max_row_err"):
            assert rows[osk_impl][key] == rows[cosa_impl][key], (osk_impl, key)
    # The timer is stubbed (every row 1 ms): the skip costs nothing and a skipped block a computed one.
    assert rows["osk"]["skip_tax"] == 1.0 and rows["osk"]["skip_cost"] == pytest.approx(1.0)
    assert rows["osk"]["skip_gain"] == 1.0 and rows["cosa"]["skip_gain"] == 1.0
    assert all("skip_tax" not in r for impl, r in rows.items() if impl != "osk")
    assert all("skip_gain" not in r for impl, r in rows.items() if impl not in ("osk", "cosa"))
    # The CoSA and OSK rows come from paired rounds; the dense and KAP rows are timed on their own.
    paired = {*layers.COSA_VARIANTS, "osk", "osk-fp8", *layers.OSK_SKIP_VARIANTS}
    assert all((r.get("rounds_ms") == [1.0, 1.0, 1.0]) == (impl in paired) for impl, r in rows.items())
    assert all("stages_ms" not in r for r in rows.values())  # the profiler's kernel times need the GPU


def test_kap_stage_times():
    """Kernel names from the profiler's trace summed per KAP stage and divided by the calls profiled."""
    kernels = [("void cosa::kap::kap_score_kernel<cutlass::bfloat16_t, 128, 8>(cosa::kap::KapDeviceArgs)", 900.0),
               ("void cosa::kap::kap_select_warp_kernel<4>(cosa::kap::KapDeviceArgs)", 200.0),
               ("void cosa::kap::kap_select_block_kernel(cosa::kap::KapDeviceArgs)", 100.0),
               ("cosa::checks::check_lengths_and_pages(cosa::checks::InputCheckParams)", 15.0),
               ("kap_index_kernel(int const*, int, int, int*, int*, unsigned int*, long)", 10.0),
               ("Memset (Device)", 5.0)]
    stages = common.stage_times(kernels, calls=5)
    assert stages == pytest.approx({"checks": 0.003, "index": 0.002, "key_range": 0.0, "quantize": 0.0,
                                    "score": 0.18, "select": 0.06, "other": 0.001})


def test_layers_skip_ratios():
    """skip_cost: a skipped block's time as a share of a computed one's with the machinery on, from OSK
    at the defaults against the same lists with nothing skipped; skip_tax: nothing skipped over skip off."""
    # Two paired rounds, the second 10% slower for every row (drift): the ratios are those of each round.
    osk = {"rounds_ms": [0.8, 0.88], "stage1_budget": 0.4, "realised_budget": 0.2}  # half the listed blocks skipped
    ratios = layers.skip_ratios(osk, {"rounds_ms": [0.95, 1.045]}, {"rounds_ms": [1.0, 1.1]})
    # 0.8 = 1.0 * (0.5 computed + 0.5 skipped * cost)  ->  cost 0.6
    assert ratios == {"skip_gain": pytest.approx(0.95 / 0.8), "skip_tax": pytest.approx(1.0 / 0.95),
                      "skip_cost": pytest.approx(0.6)}
    few = layers.skip_ratios({**osk, "realised_budget": 0.39}, {"rounds_ms": [1.0]}, {"rounds_ms": [1.0]})
    assert few["skip_cost"] is None and few["skip_tax"] == 1.0  # 2.5% skipped: not estimated


def test_interleaved_rounds(monkeypatch):
    """Each round starts at the next function, every function is timed once a round, and a paired ratio
    is the median of the per-round ratios (a drift common to a round cancels)."""
    calls = []
    times = iter([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    monkeypatch.setattr(common, "time_ms", lambda fn, warmup_ms, rep_ms: (calls.append(fn()), next(times))[1])
    rounds = common.interleaved_ms({"a": lambda: "a", "b": lambda: "b", "c": lambda: "c"}, rounds=2)
    assert calls == ["a", "b", "c", "b", "c", "a"]
    assert rounds == {"a": [1.0, 6.0], "b": [2.0, 4.0], "c": [3.0, 5.0]}
    assert common.paired_ratio([2.0, 4.4, 3.0], [1.0, 2.0, 1.0]) == pytest.approx(2.2)


def read_ab_inputs(path):
    """bench/layers.py --save-ab-inputs, read back as its docstring lays it out."""
    import numpy as np

    data = path.read_bytes()
    assert data[:8] == b"COSAOSK1"
    n, hq, hkv, d, count = np.frombuffer(data, np.int32, 5, 8).tolist()
    offset, blocks, records = 28, n // 128, {}

    def take(dtype, shape):
        nonlocal offset
        x = np.frombuffer(data, dtype, int(np.prod(shape)), offset).reshape(shape)
        offset += x.nbytes
        return torch.from_numpy(x.copy())

    for _ in range(count):
        layer, scale = int(take(np.int32, (1,))[0]), float(take(np.float32, (1,))[0])
        q, k, v = (take(np.int16, shape).view(torch.bfloat16) for shape in ((n, hq, d), (n, hkv, d), (n, hkv, d)))
        records[layer] = (scale, q, k, v, take(np.int32, (hq, blocks, blocks)), take(np.int32, (hq, blocks)))
    assert offset == len(data)
    return records


def test_layers_lists_only_on_the_cpu(tiny_model_dir, haystack_dir, tmp_path):
    """--lists-only runs without a GPU: the capture and both precisions' lists on the CPU (the
    reference), each fp8 row's agreement computed from the lists it reports on; --save-ab-inputs
    writes each layer's Q/K/V and its lists at the default precision."""
    from cosa import reference as R
    from cosa.layout import kap_layout_args, paged_from_contiguous

    rc = layers.main(["--model", str(tiny_model_dir), "--haystack", str(haystack_dir), "--n", "512",
                      "--layers", "0,1", "--lists-only", "--device", "cpu", "--plot", "--out", str(tmp_path),
                      "--save-ab-inputs", str(tmp_path / "ab.bin")])
    assert rc == 0
    data = only_json(tmp_path, "layers")
    assert data["config"]["lists_only"] and data["config"]["device"] == "cpu" and data["failures"] == []
    assert [(r["layer"], r["impl"]) for r in data["rows"]] == [(0, "kap"), (0, "kap-fp8"), (1, "kap"), (1, "kap-fp8")]
    captured, _ = layers.capture_layers(str(tiny_model_dir), str(haystack_dir), 512, [0, 1], 0, "cpu")
    saved = read_ab_inputs(tmp_path / "ab.bin")
    assert sorted(saved) == [0, 1] and data["config"]["ab_inputs"] == "ab.bin"
    for layer, (q, k, v, scale) in captured.items():
        saved_scale, saved_q, saved_k, saved_v, saved_order, saved_counts = saved[layer]
        assert saved_scale == pytest.approx(scale)
        assert torch.equal(saved_q, q) and torch.equal(saved_k, k) and torch.equal(saved_v, v)
        # 512 keys: the default proxy precision ("auto") is the native one.
        native = R.kap(*kap_layout_args(paged_from_contiguous(q, k)), softmax_scale=scale, proxy_precision="native")
        assert torch.equal(saved_order, native[0]) and torch.equal(saved_counts, native[1])
    for layer, (q, k, _, scale) in captured.items():
        layout_args = kap_layout_args(paged_from_contiguous(q, k))
        lists = {precision: R.kap(*layout_args, softmax_scale=scale, proxy_precision=precision)
                 for precision in ("native", "fp8")}
        rows = {r["impl"]: r for r in data["rows"] if r["layer"] == layer}
        assert rows["kap"]["stage1_budget"] == layers.stage1_budget(lists["native"][1])
        assert rows["kap-fp8"]["stage1_budget"] == layers.stage1_budget(lists["fp8"][1])
        expected = layers.list_agreement(lists, q, k, scale)
        assert {key: rows["kap-fp8"][key] for key in expected} == pytest.approx(expected)
        assert 0 < expected["iou_vs_native"] <= 1
    assert any(tmp_path.glob("layers-*.png")) or not HAS_MATPLOTLIB


def layer_row(layer, impl, ms, budget=1.0, rel_err=0.002):
    return {"kind": "layer", "layer": layer, "n": 1024, "impl": impl, "ms": ms, "stage1_budget": budget,
            "realised_budget": budget, "rel_err": rel_err, "max_row_err": None if rel_err is None else 5 * rel_err}


def test_layers_speedups_summary_and_results(tmp_path):
    rows = [layer_row(2, "cudnn", 4.0), layer_row(2, "fa4", 3.0), layer_row(2, "cosa", 1.5, 0.4, 0.03),
            layer_row(8, "cudnn", 4.0), layer_row(8, "fa4", 2.0), layer_row(8, "cosa", 1.0, 0.2, 0.05),
            layer_row(8, "kap", 0.1, 0.2, None)]
    layers.add_speedups(rows)
    cosa_rows = [r for r in rows if r["impl"] == "cosa"]
    assert [r["x_fa4"] for r in cosa_rows] == [2.0, 2.0]
    assert [r["x_cudnn"] for r in cosa_rows] == [pytest.approx(4 / 1.5), 4.0]
    summary = {s["impl"]: s for s in layers.summarise(rows)}
    assert list(summary) == ["cudnn", "fa4", "cosa", "kap"]
    assert summary["cosa"]["layers"] == 2 and summary["cosa"]["ms"] == pytest.approx(1.25)
    assert summary["cosa"]["x_fa4"] == pytest.approx(2.0) and summary["cosa"]["max_row_err"] == pytest.approx(0.25)
    assert summary["kap"]["rel_err"] is None
    assert "x_fa4" in common.format_table(rows, layers.TABLE_COLUMNS).splitlines()[0]
    run = layers.LayerRun(None, None, seed=0)
    run.rows = rows
    meta, path = common.start_run(tmp_path, "layers")
    common.write_json(path, layers.results(meta, {"n": 1024}, run))
    data = only_json(tmp_path, "layers")
    assert data["rows"] == rows and data["config"] == {"n": 1024} and data["failures"] == []
    assert [s["impl"] for s in data["summary"]] == list(summary)
    if HAS_MATPLOTLIB:
        assert layers.plot(rows, path.with_suffix(".png"), "tiny") and path.with_suffix(".png").exists()
        # More rows than the ten default colours (a full run has 14 per layer).
        many = [layer_row(2, "fa4", 3.0), *(layer_row(2, f"row{i}", 1.0 + i, 0.3, 0.01) for i in range(13))]
        layers.add_speedups(many)
        assert layers.plot(many, tmp_path / "many.png", "tiny") and (tmp_path / "many.png").exists()


def test_accuracy_resumes_a_stopped_run(tmp_path, tiny_model_dir):
    """A run stopped by --time-limit and continued with --resume ends with the answers of one
    uninterrupted run; on a prompt left half done only the missing arm is answered (a peer matched to
    CoSA, with CoSA's lists of that prompt computed again), and a changed configuration is refused."""
    argv = ["--lengths", "512", "--samples", "2", "--ppl-samples", "1", "--methods", "dense,cosa,xattention",
            "--tasks", "niah_single,vt", "--no-drop-failed-tasks"]
    whole = accuracy_run(tmp_path / "whole", tiny_model_dir, *argv)
    assert whole["complete"] and len(whole["runs"]) == 1

    stopped = accuracy_run(tmp_path / "split", tiny_model_dir, *argv, "--time-limit", "0")
    assert stopped["complete"] is False and stopped["samples"] == [] and "scores" not in stopped
    path = next((tmp_path / "split").glob("accuracy-*.json"))
    # As if a run had stopped inside a prompt: the last answers of one prompt and a window gone.
    earlier = [{**r, "answer": "from the earlier run"} for r in whole["samples"][:-1]]
    partial = {**whole, "samples": earlier, "ppl": whole["ppl"][:-1], "complete": False}
    path.write_text(json.dumps(partial))
    rc = accuracy.main(["--model", str(tiny_model_dir), "--min-prefill-tokens", "256", "--max-new-tokens", "3",
                        "--device", "cpu", "--bootstrap", "200", "--resume", str(path), *argv])
    assert rc == 0
    resumed = json.loads(path.read_text())
    assert resumed["complete"] and len(resumed["runs"]) == 2
    # Each prompt's haystack count is kept, so that a resumed run renders it once.
    assert sorted(resumed["prompt_counts"]) == sorted(f"512:{t}:{s}" for t in ("niah_single", "vt") for s in (0, 1))
    assert resumed["prompt_counts"] == whole["prompt_counts"]
    # Every answer of the earlier run was kept; only the missing one (xattention on the last prompt) ran.
    last = whole["samples"][-1]
    assert (last["method"], last["match"]) == ("xattention", "stage1")
    redone = [r for r in resumed["samples"] if r["answer"] != "from the earlier run"]
    assert [(r["method"], r["task"], r["sample"]) for r in redone] == [("xattention", last["task"], last["sample"])]
    assert {k: v for k, v in redone[0].items() if k != "answer"} == {k: v for k, v in last.items() if k != "answer"}

    def key(r):
        return r["method"], r["match"] or "", r["n"], r.get("task", ""), r["sample"]

    for field in ("samples", "ppl"):
        got = sorted(resumed[field], key=key)
        want = sorted(whole[field], key=key)
        assert [key(r) for r in got] == [key(r) for r in want]
        assert [r.get("score", r.get("nll")) for r in got] == pytest.approx([r.get("score", r.get("nll")) for r in want])
    with pytest.raises(SystemExit, match=r"differs in samples \(that run: 2, this one: 3\)"):
        accuracy.main(["--model", str(tiny_model_dir), "--min-prefill-tokens", "256", "--max-new-tokens", "3",
                       "--device", "cpu", "--bootstrap", "200", "--resume", str(path),
                       *[a if a != "2" else "3" for a in argv]])


def test_accuracy_resume_adds_methods(tmp_path, tiny_model_dir):
    """--resume with more methods and match entries than the run it continues keeps that run's answers
    (dense is not run again) and adds the new arms, equal to those of one run with every method; a
    resume that leaves out a method of that run is refused."""
    common_argv = ["--lengths", "512", "--samples", "2", "--ppl-samples", "1", "--tasks", "niah_single,vt",
                   "--no-drop-failed-tasks"]
    every = accuracy_run(tmp_path / "every", tiny_model_dir, *common_argv,
                         "--methods", "dense,cosa,xattention", "--match", "stage1,none")
    first = accuracy_run(tmp_path / "first", tiny_model_dir, *common_argv, "--methods", "dense,cosa")
    path = next((tmp_path / "first").glob("accuracy-*.json"))
    marked = {**first, "samples": [{**r, "answer": "from the first run"} for r in first["samples"]]}
    del marked["prompt_counts"]  # as in the files written before the counts were kept
    path.write_text(json.dumps(marked))
    run = ["--model", str(tiny_model_dir), "--min-prefill-tokens", "256", "--max-new-tokens", "3", "--device", "cpu",
           "--bootstrap", "200", "--resume", str(path), *common_argv]
    assert accuracy.main([*run, "--methods", "dense,cosa,xattention", "--match", "stage1,none"]) == 0
    extended = json.loads(path.read_text())
    assert extended["complete"] and extended["config"]["methods"] == ["dense", "cosa", "xattention"]
    assert extended["prompt_counts"] == every["prompt_counts"]
    new = [r for r in extended["samples"] if r["answer"] != "from the first run"]
    assert {(r["method"], r["match"]) for r in new} == {("xattention", "stage1"), ("xattention", "none")}
    assert len([r for r in extended["samples"] if r["method"] in ("dense", "cosa")]) == len(first["samples"])

    def key(r):
        return r["method"], r["match"] or "", r["n"], r.get("task", ""), r["sample"]

    for field, value in (("samples", "score"), ("ppl", "nll")):
        got = {key(r): r[value] for r in extended[field]}
        want = {key(r): r[value] for r in every[field]}
        assert got.keys() == want.keys()
        assert [got[k] for k in sorted(got)] == pytest.approx([want[k] for k in sorted(want)])
    for field in ("stage1", "realised"):  # the matched peer saw CoSA's lists of the same prompt
        assert ({key(r): r[field] for r in extended["samples"] if r["method"] == "xattention"}
                == pytest.approx({key(r): r[field] for r in every["samples"] if r["method"] == "xattention"}))
    with pytest.raises(SystemExit, match="--methods must include that run's dense, cosa, xattention"):
        accuracy.main([*run, "--methods", "dense,xattention", "--match", "none"])


def test_accuracy_stopped_run_keeps_the_finished_arms_results(tmp_path, tiny_model_dir, capsys):
    """A resumed run that adds a method and stops before its first prompt still holds the scores and
    summary of the arms that were finished (those of the file it continued, equal to that file's
    own), prints their table, and leaves the unfinished arm out of both."""
    argv = ["--lengths", "512", "--samples", "2", "--ppl-samples", "1", "--tasks", "niah_single,vt",
            "--no-drop-failed-tasks"]
    first = accuracy_run(tmp_path, tiny_model_dir, *argv, "--methods", "dense,cosa")
    path = next(tmp_path.glob("accuracy-*.json"))
    capsys.readouterr()
    assert accuracy.main(["--model", str(tiny_model_dir), "--min-prefill-tokens", "256", "--max-new-tokens", "3",
                          "--device", "cpu", "--bootstrap", "200", "--resume", str(path), *argv,
                          "--methods", "dense,cosa,xattention", "--time-limit", "0"]) == 0
    stopped = json.loads(path.read_text())
    assert stopped["complete"] is False and len(stopped["samples"]) == len(first["samples"])
    assert arms(stopped["summary"]) == arms(stopped["scores"]) == {("dense", None), ("cosa", None)}
    assert stopped["summary"] == first["summary"] and stopped["scores"] == first["scores"]
    out = capsys.readouterr().out
    assert "the arms with every answer" in out and "stopped at --time-limit" in out
    assert " cosa " in out and "xattention" not in out
    samples = [r for r in first["samples"] if not (r["method"] == "cosa" and r["sample"] == 1)]
    args = accuracy.parse_args(["--model", "m", *argv, "--methods", "dense,cosa"])
    assert accuracy.finished_arms(samples, first["ppl"], [], args) == {("dense", None)}
    assert accuracy.finished_arms(first["samples"], first["ppl"][1:], [], args) == {("cosa", None)}


def test_accuracy_time_limit_counts_the_model_load(tmp_path, tiny_model_dir, monkeypatch):
    """--time-limit is a wall-clock budget for the whole run: a model that takes longer to load than
    the limit leaves no time for a prompt (counted from the end of the load, one prompt would run)."""
    import time

    real_load = accuracy.load_model

    def slow_load(*a, **kw):
        time.sleep(0.5)
        return real_load(*a, **kw)

    monkeypatch.setattr(accuracy, "load_model", slow_load)
    data = accuracy_run(tmp_path, tiny_model_dir, "--lengths", "512", "--samples", "1", "--ppl-samples", "0",
                        "--methods", "dense", "--tasks", "niah_single", "--time-limit", "0.3")
    assert data["complete"] is False and data["samples"] == []


@pytest.mark.parametrize("flag,value,words", [("--time-limit", "-1", "--time-limit must be"),
                                              ("--time-limit", "nan", "--time-limit must be"),
                                              ("--resume", "no-such-file.json", "--resume: no-such-file.json is not a file")])
def test_accuracy_refuses_a_bad_time_limit_or_resume_file(tiny_model_dir, capsys, flag, value, words):
    with pytest.raises(SystemExit):
        accuracy.parse_args(["--model", str(tiny_model_dir), "--device", "cpu", flag, value])
    assert words in capsys.readouterr().err



def test_long_context_list_agreement():
    order = torch.tensor([[[0, 2, -1], [1, 0, -1]]], dtype=torch.int32)
    ref = torch.tensor([[[2, 0, -1], [1, 0, -1]]], dtype=torch.int32)
    counts = torch.tensor([[2, 2]], dtype=torch.int32)
    got = long_context.list_agreement(order, counts, ref, counts)
    assert got["lists_identical"] == 0.5 and got["iou_mean"] == 1.0 and got["max_count_diff"] == 0
    other = torch.tensor([[[0, -1, -1], [1, 0, -1]]], dtype=torch.int32)
    got = long_context.list_agreement(other, torch.tensor([[1, 2]], dtype=torch.int32), ref, counts)
    assert got["iou_min"] == 0.5 and got["max_count_diff"] == 1


@pytest.mark.parametrize("proxy", ["native", "fp8"])
def test_long_context_valid_kept_sets(proxy):
    """The e4m3 lists' check: the reference's own lists pass, with the slack and without; a list
    missing a forced block fails; one holding a block past its top-p prefix fails without the
    slack (with it, a list whose prefix reached top-p by less than the slack may pass)."""
    from cosa import defaults, reference

    n = 2048 + 77
    p = long_context.structured_input(n, 4, 1, 128, seed=5, device="cpu")
    args = [p[name] for name in ("q", "k_cache", "page_table", "cu_seqlens_q", "seqused_k")]
    order, counts = reference.kap(*args, n, n, proxy_precision=proxy)
    scores, hrm = reference.kap_scores(*args, n, n, proxy_precision=proxy)

    def valid(o, slack=long_context.FP8_SCORE_SLACK):
        return long_context.valid_kept_sets(o, scores, hrm, 0, defaults.TOP_P, slack)[0]

    assert valid(order).all() and valid(order, 0.0).all()
    diagonal = torch.arange(order.shape[1], dtype=torch.int32)[None, :, None]
    assert not valid(torch.where(order == diagonal, -1, order)).any()
    kept = long_context.kept_sets(order, order.shape[2])
    candidate = scores != float("-inf")
    droppable = (candidate & ~kept).any(-1)
    assert droppable.float().mean() > 0.5
    best_dropped = torch.where(candidate & ~kept, scores, float("-inf")).argmax(-1).to(torch.int32)
    widened = torch.cat([order, torch.full_like(order[..., :1], -1)], -1)
    widened.scatter_(2, counts.long()[..., None], torch.where(droppable, best_dropped, -1)[..., None])
    assert not valid(widened[..., :-1], 0.0)[droppable].any()


def test_long_context_arguments_and_no_gpu(capsys):
    with pytest.raises(SystemExit):
        long_context.main(["--n", "64"])
    assert "at least 128" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exit_info:
            long_context.main(["--n", "1024", "--check-n"])
        assert exit_info.value.code == 2


def test_vllm_e2e_arguments(tmp_path, capsys):
    for bad, message in ((["--reps", "0"], "--reps"), (["--lengths", "0"], "positive"),
                         (["--gpu-memory-utilization", "1.5"], "utilization"), (["--batch", "-1"], "--batch"),
                         (["--yarn-factor", "0.5"], "--yarn-factor"), (["--min-prefill-tokens", "0"], "--min-prefill"),
                         (["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
                         (["--max-num-batched-tokens", "100"], "--max-num-batched-tokens"),
                         (["--block-size", "24"], "--block-size")):
        with pytest.raises(SystemExit):
            vllm_e2e.parse_args(["--model", str(tmp_path), *bad])
        assert message in capsys.readouterr().err


def test_vllm_e2e_rows_compare_both_engines():
    def engine(impl, texts, scores, ttft):
        return {"impl": impl, "short": texts,
                "needle": [{"n": 16384, "seed": i, "text": "x", "score": s} for i, s in enumerate(scores)],
                "ttft": [{"n": 8192, "ttft_ms": ttft, "routing_before": None if impl == "flash_attn" else {"tokens": {"cosa": 10}},
                          "routing_after": None if impl == "flash_attn" else {"tokens": {"cosa": 8202}}}]}

    results = {("flash_attn", "main"): engine("flash_attn", ["a", "b"], [1.0, 1.0], 300.0),
               ("cosa", "main"): engine("cosa", ["a", "b"], [1.0, 1.0], 200.0)}
    rows, failures = vllm_e2e.compare(results)
    assert not failures
    ttft = [r for r in rows if r["kind"] == "vllm" and r["impl"] == "cosa"][0]
    assert ttft["x_flash_attn"] == 1.5 and ttft["answers_match"] and ttft["cosa_tokens"] == 8192
    results[("cosa", "main")] = engine("cosa", ["a", "c"], [1.0, 0.0], 200.0)
    rows, failures = vllm_e2e.compare(results)
    assert len(failures) == 2 and not [r for r in rows if r["kind"] == "vllm" and r["impl"] == "cosa"][0]["answers_match"]


def test_vllm_e2e_under_tensor_parallelism_fails_when_ranks_route_apart():
    """Every rank routes the same batch: counts that differ between ranks fail the run; the rows say the
    tensor-parallel size."""
    def engine(impl, disagreements):
        return {"impl": impl, "short": ["a"], "needle": [], "tensor_parallel_size": 2,
                "routing_disagreements": disagreements,
                "ttft": [{"n": 8192, "ttft_ms": 100.0, "routing_before": {}, "routing_after": {}}]}

    results = {("flash_attn", "main"): engine("flash_attn", []), ("cosa", "main"): engine("cosa", [])}
    rows, failures = vllm_e2e.compare(results)
    assert not failures and {r["tp"] for r in rows if r["kind"] == "vllm"} == {2}
    results[("cosa", "main")] = engine("cosa", [[{"requests": {"cosa": 1}}, {"requests": {"cosa": 2}}]])
    _, failures = vllm_e2e.compare(results)
    assert failures == ["engine cosa (main): the ranks' routing counts differ (1 reads)"]


def test_vllm_e2e_reads_and_resets_each_ranks_routing_counts():
    """The functions vLLM's collective_rpc runs on each worker read and zero that process's counts."""
    from cosa.integrations import vllm_plugin

    vllm_plugin.ROUTING.reset()
    vllm_plugin.ROUTING.add(vllm_plugin.route(torch.tensor([0, 5000], dtype=torch.int32), torch.tensor([5000]), 4096))
    assert vllm_e2e.rank_routing_counts(None)["requests"] == {"cosa": 1}
    vllm_e2e.reset_rank_routing(None)
    assert vllm_e2e.rank_routing_counts(None) == vllm_plugin.routing_counts() == vllm_plugin.RoutingCounts().snapshot()


def test_long_context_reference_blocks_are_the_reference_rows():
    """The per-block sub-problems that check the kernel's output at long lengths give exactly the
    rows of the reference run on the whole sequence."""
    import cosa

    n, hq = 700, 4
    p = long_context.structured_input(n, hq, 2, 64, seed=3, device="cpu")
    args = [p[name] for name in ("q", "k_cache", "v_cache", "page_table", "cu_seqlens_q", "seqused_k")]
    order, counts = cosa.reference.kap(p["q"], p["k_cache"], p["page_table"], p["cu_seqlens_q"], p["seqused_k"], n, n)
    blocks = [0, 2, 5]
    for delta in (0.0, 30.0):
        full, _, _ = cosa.reference.osk(*args, order, counts, n, delta=delta)
        got = long_context.reference_blocks(cosa, p, order, counts, hq - 1, blocks, delta)
        expect = torch.cat([full[i * 128: min(n, (i + 1) * 128), hq - 1] for i in blocks])
        assert torch.equal(got, expect)
    assert long_context.sampled_error(cosa, p, full, order, counts, blocks, 30.0) == 0.0


def test_kernel_page_size_flag(capsys):
    assert kernel.parse_args(["--page-size", "16"]).page_size == 16
    assert kernel.parse_args([]).page_size == kernel.CONFIG["page_size"]
    for bad in ("0", "24", "8", "512"):
        with pytest.raises(SystemExit):
            kernel.parse_args(["--page-size", bad])
        assert "--page-size" in capsys.readouterr().err
