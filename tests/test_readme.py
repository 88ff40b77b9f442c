"""The README's examples, run as a reader would paste them: each Python block builds its own inputs
and runs in a fresh namespace, on the CPU (the reference; the examples pick the CPU where
cosa.cuda_kernels_available() is False) and, marked `gpu`, on a Hopper GPU (the kernels). The
transformers example gets a tiny random model in place of the download. A change to an op's
signature, a keyword, a statistic's name, an output's shape or a default that leaves the README
behind fails here, and so does a block that uses a name it does not make."""

import ast
import contextlib
import io
import math
import re
from pathlib import Path

import pytest
import torch

import cosa
from cosa import defaults
from cosa.integrations.vllm_plugin import Settings
from cosa.reference import BLOCK

from helpers import require_transformers

README = Path(__file__).resolve().parents[1] / "README.md"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# One marker for each Python block of the README, naming the test that runs it.
MARKERS = {
    "contiguous": "cosa.sparse_attention(q, k, v, return_stats=True)",
    "paged": "torch.ops.cosa.prefill(",
    "transformers": "cosa_hf.enable(",
    "vllm": "from vllm import LLM",
}


def python_examples():
    """Each ```python block of the README as (its first line's number, its source)."""
    lines = README.read_text().splitlines()
    examples, start = [], None
    for number, line in enumerate(lines, start=1):
        if start is None and line.strip() == "```python":
            start = number + 1
        elif start is not None and line.strip() == "```":
            examples.append((start, "\n".join(lines[start - 1:number - 1])))
            start = None
    assert start is None, f"README.md: the python block from line {start} is not closed"
    return examples


def example_with(marker):
    hits = [example for example in python_examples() if marker in example[1]]
    assert len(hits) == 1, f"README.md has {len(hits)} python examples containing {marker!r}, expected one"
    return hits[0]


def run_example(example, names=None):
    """Runs an example in a fresh namespace (or one holding `names`); returns the namespace and what
    it printed. Tracebacks name README.md and its own line numbers."""
    start, source = example
    code = compile("\n" * (start - 1) + source, str(README), "exec")
    names = {} if names is None else names
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code, names)
    return names, printed.getvalue()


def call_in(example, function_name):
    """The example's one call of a function whose dotted name ends in `function_name`."""
    calls = [node for node in ast.walk(ast.parse(example[1])) if isinstance(node, ast.Call)
             and ast.unparse(node.func).endswith(function_name)]
    assert len(calls) == 1, f"README.md:{example[0]}: expected one call of {function_name}, found {len(calls)}"
    return calls[0]


def test_every_python_example_is_run_here():
    examples = python_examples()
    assert len(examples) == len(MARKERS)
    for marker in MARKERS.values():
        example_with(marker)


def test_the_two_commands_and_the_virtual_environment():
    """The set-up of "The two commands": a virtual environment first, then the demo and the test
    command (the one .ci/run finds with `^bash scripts/setup.sh && .*pytest`)."""
    lines = README.read_text().splitlines()
    assert "python3 -m venv .venv && source .venv/bin/activate" in lines
    assert "bash scripts/setup.sh && python3 -m cosa.demo" in lines
    assert [line for line in lines if re.match(r"^bash scripts/setup.sh && .*pytest", line)] == [
        "bash scripts/setup.sh && python3 -m pytest -q tests"]


def on_device(device, monkeypatch):
    """The examples choose the GPU where the kernels can run: on "cpu", make them choose the CPU."""
    if device == "cpu":
        monkeypatch.setattr(cosa, "cuda_kernels_available", lambda: False)


def num_query_blocks(q, seqused_k, max_seqlen_q):
    """The bound of docs/api.md's output table: min(B * ceil(max_seqlen_q / 128), (total_q + 127 B) // 128)."""
    batch, total_q = seqused_k.numel(), q.shape[0]
    return min(batch * math.ceil(max_seqlen_q / BLOCK), (total_q + (BLOCK - 1) * batch) // BLOCK)


def budgets(printed_line):
    shape, stage1_budget, realised_budget = printed_line.rsplit(" ", 2)
    assert 0 < float(realised_budget) <= float(stage1_budget) <= 1
    return shape


@pytest.mark.parametrize("device", DEVICES)
def test_the_contiguous_example(ops, device, monkeypatch):
    on_device(device, monkeypatch)
    names, printed = run_example(example_with(MARKERS["contiguous"]))
    q, out, out_sdpa = names["q"], names["out"], names["out_sdpa"]
    assert q.device.type == device
    assert budgets(printed.strip()) == str(out.shape) and out.shape == q.shape == (1, 1024, 8, 128)
    assert out.dtype == q.dtype and torch.isfinite(out.float()).all()
    # The SDPA-layout call is the same attention, in SDPA's layout.
    assert out_sdpa.shape == (1, 8, 1024, 128)
    assert torch.equal(out_sdpa.transpose(1, 2), out)


def test_the_ops_example_passes_the_defaults():
    """Its positional tuning arguments are said to be the defaults of cosa/defaults.py."""
    call = call_in(example_with(MARKERS["paged"]), "torch.ops.cosa.prefill")
    tuning = [ast.literal_eval(arg) for arg in call.args[8:]]
    assert tuning == [defaults.STRIDE, defaults.TOP_P, defaults.SOFTMAX_SCALE, defaults.DELTA, defaults.VOTE,
                      defaults.PROXY_PRECISION]


@pytest.mark.parametrize("device", DEVICES)
def test_the_paged_example(ops, device, monkeypatch):
    on_device(device, monkeypatch)
    names, printed = run_example(example_with(MARKERS["paged"]))
    q, seqused_k = names["q"], names["seqused_k"]
    out, lse, order, counts, skipped = (names[n] for n in ("out", "lse", "order", "counts", "skipped"))
    assert q.device.type == device
    assert budgets(printed.strip()) == str(q.shape)
    # The sequences it describes: the second one's queries after a cached prefix of two blocks.
    assert names["cu_seqlens_q"].tolist() == [0, 300, 428] and seqused_k.tolist() == [300, 384]
    total_q, heads_q, _ = q.shape
    blocks_q = num_query_blocks(q, seqused_k, max(names["q_lens"]))
    blocks_k = math.ceil(max(names["k_lens"]) / BLOCK)
    # The output table of docs/api.md.
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (heads_q, total_q) and lse.dtype == torch.float32
    assert order.shape == (heads_q, blocks_q, blocks_k) and order.dtype == torch.int32
    assert counts.shape == skipped.shape == (heads_q, blocks_q)
    assert counts.dtype == skipped.dtype == torch.int32
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
    # Entries past each count are -1.
    listed = torch.arange(blocks_k, device=order.device) < counts[..., None]
    assert (order[~listed] == -1).all() and (order[listed] >= 0).all()


def test_the_transformers_example(monkeypatch):
    require_transformers()
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    example = example_with(MARKERS["transformers"])
    min_prefill_tokens = ast.literal_eval(
        next(kw.value for kw in call_in(example, "cosa_hf.enable").keywords if kw.arg == "min_prefill_tokens"))
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=2 * min_prefill_tokens)
    model = Qwen2ForCausalLM(config).eval()
    asked = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda name, *a, **kw: asked.append(name) or model)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    names, printed = run_example(example)
    assert asked == ["Qwen/Qwen2.5-Coder-1.5B-Instruct"]
    prompt_tokens = names["input_ids"].shape[1]
    assert prompt_tokens >= min_prefill_tokens
    new_tokens = names["output"].shape[1] - prompt_tokens
    assert new_tokens > 0
    # The prompt's prefill is long enough for CoSA in both layers; every decode step stays dense.
    summary = names["handle"].summary()
    assert summary["sparse_calls"] == 2
    assert summary["dense_reasons"] == {"decode": 2 * (new_tokens - 1)}
    assert ast.literal_eval(printed.strip()) == summary
    assert model.config._attn_implementation == "sdpa"  # restored when the block ends


def test_the_vllm_example_settings():
    """vLLM is not run here (tests/test_vllm_backend.py covers the backend); the example's backend
    slot and its `additional_config` are checked against the plugin."""
    call = call_in(example_with(MARKERS["vllm"]), "LLM")
    keywords = {kw.arg: kw.value for kw in call.keywords}
    assert ast.literal_eval(keywords["attention_backend"]) == "CUSTOM"
    given = ast.literal_eval(keywords["additional_config"])
    settings = Settings.from_additional_config(given)  # raises on a setting the plugin does not know
    assert {name: getattr(settings, name) for name in given["cosa"]} == given["cosa"]
