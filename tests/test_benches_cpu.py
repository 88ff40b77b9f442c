"""Small CPU runs of bench/fidelity.py, bench/e2e.py and bench/accuracy.py through their main()
(the reference path), plus the accuracy tasks' construction and scoring."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import accuracy  # noqa: E402
import e2e  # noqa: E402
import fidelity  # noqa: E402


HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def only_json(folder: Path, prefix: str) -> dict:
    files = sorted(folder.glob(f"{prefix}-*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer Llama with random weights and a word-level tokenizer built here (no download)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = {w for part in accuracy._FILLER_WORDS.values() for phrase in part for w in phrase.split()}
    words |= set(accuracy._KEY_WORDS) | set(accuracy._KEY_NOUNS) | set(accuracy.NIAH_INTRO.split())
    vocab = ["<unk>", "<s>", "</s>"] + sorted(words) + list("0123456789.,:?-=") + list("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    vocab = {w: i for i, w in enumerate(dict.fromkeys(vocab))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                 pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.Split(Regex("[A-Z]"), "isolated")])
    tok.decoder = decoders.WordPiece(prefix="##")
    folder = tmp_path_factory.mktemp("tiny-llama")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=len(vocab), max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


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


def test_accuracy_cpu(tmp_path, tiny_model_dir):
    rc = accuracy.main(["--model", str(tiny_model_dir), "--lengths", "512", "--samples", "1", "--ppl-samples", "1",
                        "--min-prefill-tokens", "256", "--max-new-tokens", "3", "--device", "cpu", "--plot",
                        "--out", str(tmp_path)])
    assert rc == 0
    data = only_json(tmp_path, "accuracy")
    assert {(r["method"], r["task"]) for r in data["scores"]} == {(m, t) for m in accuracy.METHODS
                                                                  for t in accuracy.TASKS}
    assert all(r["tokens"] <= 512 for r in data["samples"])
    assert {r["method"] for r in data["summary"]} == set(accuracy.METHODS)
    for r in data["summary"]:
        assert r["ppl"] > 1 and 0 < r["realised"] <= r["stage1"] <= 1
    assert any(tmp_path.glob("accuracy-*.png")) or not HAS_MATPLOTLIB


def test_accuracy_peers_at_a_fixed_budget(tmp_path, tiny_model_dir):
    rc = accuracy.main(["--model", str(tiny_model_dir), "--lengths", "1024", "--samples", "1", "--ppl-samples", "0",
                        "--tasks", "niah_single", "--methods", "xattention,meanpool", "--match", "0.3",
                        "--min-prefill-tokens", "256", "--max-new-tokens", "2", "--device", "cpu",
                        "--out", str(tmp_path)])
    assert rc == 0
    for r in only_json(tmp_path, "accuracy")["samples"]:
        assert r["stage1"] < 0.6  # 8 query blocks at budget 0.3 (each row keeps at least two)


@pytest.mark.parametrize("task", accuracy.TASKS)
def test_prompts_fit_and_hold_their_answers(task, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    sentences = accuracy.haystack_sentences(None)
    ids, answers = accuracy.build_prompt(tokenizer, task, 1024, 0, sentences)
    assert 900 < len(ids) <= 1024
    text = tokenizer.decode(ids).replace(" ", "")
    assert answers and all(a.replace(" ", "") in text for a in answers)
    assert accuracy.score_answer(" ".join(answers), answers) == 1.0
    assert accuracy.score_answer("nothing", answers) == 0.0


def test_haystack_from_a_text_folder(tmp_path):
    (tmp_path / "b.txt").write_text("Second file. It has two sentences!")
    (tmp_path / "a.txt").write_text("First file here.   With spacing?")
    assert accuracy.haystack_sentences(str(tmp_path)) == ["First file here.", "With spacing?", "Second file.",
                                                          "It has two sentences!"]
    assert len(accuracy.filler_sentences(5, 1)) == 5
    assert accuracy.filler_sentences(5, 1) == accuracy.filler_sentences(5, 1)
