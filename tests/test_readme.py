"""The README's Python examples, run as a reader would paste them, with the names they take as given
(q, k_cache, ..., model, input_ids) bound to a small problem: on the CPU (the reference) and, marked
`gpu`, on a Hopper GPU (the kernels). A change to an op's signature, a keyword, a statistic's name, an
output's shape or a default that leaves the README behind fails here."""

import ast
import contextlib
import io
import math
from pathlib import Path

import pytest
import torch

import cosa
from cosa import defaults
from cosa.integrations.vllm_plugin import Settings
from cosa.reference import BLOCK
from cosa.testing import random_problem

README = Path(__file__).resolve().parents[1] / "README.md"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


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


def run_example(example, names):
    """Runs an example in a namespace holding `names`; returns the namespace and what it printed.
    Tracebacks name README.md and its own line numbers."""
    start, source = example
    code = compile("\n" * (start - 1) + source, str(README), "exec")
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


def paged_problem(device):
    """Two sequences, one with a cached prefix of two blocks, an odd length, GQA, page size 64."""
    return random_problem([300, 128], [556, 128], num_heads_q=4, num_heads_kv=2, head_dim=128, page_size=64,
                          device=device, structure="needles")


def num_query_blocks(p):
    """The bound of the README's output table: min(B * ceil(max_seqlen_q / 128), (total_q + 127 B) // 128)."""
    batch, total_q = p["seqused_k"].numel(), p["q"].shape[0]
    return min(batch * math.ceil(p["max_seqlen_q"] / BLOCK), (total_q + (BLOCK - 1) * batch) // BLOCK)


def test_the_ops_example_passes_the_defaults():
    """Its positional tuning arguments are said to be the defaults of cosa/defaults.py."""
    call = call_in(example_with("torch.ops.cosa.prefill("), "torch.ops.cosa.prefill")
    tuning = [ast.literal_eval(arg) for arg in call.args[8:]]
    assert tuning == [defaults.STRIDE, defaults.TOP_P, defaults.SOFTMAX_SCALE, defaults.DELTA, defaults.VOTE,
                      defaults.PROXY_PRECISION]


@pytest.mark.parametrize("device", DEVICES)
def test_the_ops_example(ops, device):
    p = paged_problem(device)
    names, _ = run_example(example_with("torch.ops.cosa.prefill("), dict(p))
    out, lse, order, counts, skipped = (names[n] for n in ("out", "lse", "order", "counts", "skipped"))
    total_q, heads_q, head_dim = p["q"].shape
    blocks_q, blocks_k = num_query_blocks(p), math.ceil(p["max_seqlen_k"] / BLOCK)
    # The output table of the README.
    assert out.shape == p["q"].shape and out.dtype == p["q"].dtype
    assert lse.shape == (heads_q, total_q) and lse.dtype == torch.float32
    assert order.shape == (heads_q, blocks_q, blocks_k) and order.dtype == torch.int32
    assert counts.shape == skipped.shape == (heads_q, blocks_q)
    assert counts.dtype == skipped.dtype == torch.int32
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
    # Entries past each count are -1.
    listed = torch.arange(blocks_k, device=order.device) < counts[..., None]
    assert (order[~listed] == -1).all() and (order[listed] >= 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_the_python_api_example(ops, device):
    p = paged_problem(device)
    gen = torch.Generator().manual_seed(1)
    contiguous = {name: torch.randn(shape, generator=gen).to(torch.bfloat16).to(device)
                  for name, shape in (("q4", (2, 256, 4, 64)), ("k4", (2, 384, 2, 64)), ("v4", (2, 384, 2, 64)))}
    names, printed = run_example(example_with("out, stats = cosa.prefill("), {"cosa": cosa, **p, **contiguous})
    stage1_budget, realised_budget = (float(word) for word in printed.split())
    assert 0 < realised_budget <= stage1_budget <= 1
    assert names["out"].shape == contiguous["q4"].shape
    assert names["lse"].shape == (p["q"].shape[1], p["q"].shape[0])
    assert names["order"].shape[:2] == names["counts"].shape == names["skipped"].shape


def test_the_transformers_example():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    example = example_with("cosa_hf.enable(")
    min_prefill_tokens = ast.literal_eval(
        next(kw.value for kw in call_in(example, "cosa_hf.enable").keywords if kw.arg == "min_prefill_tokens"))
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=2 * min_prefill_tokens)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    input_ids = torch.randint(0, 512, (1, min_prefill_tokens), generator=torch.Generator().manual_seed(0))
    names, printed = run_example(example, {"model": model, "input_ids": input_ids})
    new_tokens = names["output"].shape[1] - min_prefill_tokens
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
    call = call_in(example_with("from vllm import LLM"), "LLM")
    keywords = {kw.arg: kw.value for kw in call.keywords}
    assert ast.literal_eval(keywords["attention_backend"]) == "CUSTOM"
    given = ast.literal_eval(keywords["additional_config"])
    settings = Settings.from_additional_config(given)  # raises on a setting the plugin does not know
    assert {name: getattr(settings, name) for name in given["cosa"]} == given["cosa"]
