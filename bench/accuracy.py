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
The haystack is the text of ``--haystack-dir`` (every *.txt file, in name order, cut into sentences)
or, without it, synthetic filler sentences. Answers are greedy (``--max-new-tokens``); a sample scores
the share of its expected strings found in the answer (RULER's string match).

Perplexity: ``--ppl-samples`` windows of N tokens of the haystack text; the score is the perplexity of
the second half of each window given everything before it (the tokens that read a long context).

Methods (prefill only; decoding is always dense):
  dense        the model's SDPA attention
  cosa         KAP + OSK with the in-kernel skip (--top-p, --delta, --stride)
  kap          KAP + OSK without the skip (delta 0)
  xattention, flexprefill, meanpool
               the peers' masks (bench/proxies.py) turned into ascending lists and run by OSK, no skip
Matched budgets (``--match cosa``, the default when cosa runs): each peer keeps, per layer and per
query block, the number of blocks that gives CoSA's realised budget of that layer on the same
prompt (proxies.budget_mask over the peer's scores). ``--match none`` runs each peer with its
own threshold; ``--match 0.2`` fixes one budget for all.

    python bench/accuracy.py --model DIR|FILE.gguf [--lengths 4096 8192 16384 32768] [--samples 10]
        [--tasks ...] [--methods dense,cosa,kap,xattention,flexprefill,meanpool] [--haystack-dir DIR]
        [--ppl-samples 2] [--plot] [--out bench/results]
"""

from __future__ import annotations

import math
import random
import re
import string
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import (add_run_arguments, argument_parser, format_table, progress, resolve_device,  # noqa: E402
                    save_figure, start_run, write_json)

import proxies  # noqa: E402

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe")
METHODS = ("dense", "cosa", "kap", "xattention", "flexprefill", "meanpool")
SCORE_COLUMNS = ("method", "n", "task", "score", "samples", "stage1", "realised")
SUMMARY_COLUMNS = ("method", "n", "score", "ppl", "stage1", "realised")

# ---------------------------------------------------------------------------------------------
# Model and text
# ---------------------------------------------------------------------------------------------


def load_model(path: str, device: str, dtype: torch.dtype):
    """``(model, tokenizer, name)`` from a model directory or a ``.gguf`` file (dequantised by
    transformers; needs the ``gguf`` package). SDPA attention, eval mode, on ``device``."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    extra = {"gguf_file": p.name} if p.suffix == ".gguf" else {}
    where = str(p.parent if extra else p)
    dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    tokenizer = AutoTokenizer.from_pretrained(where, **extra)
    model = AutoModelForCausalLM.from_pretrained(where, attn_implementation="sdpa", **{dtype_key: dtype}, **extra)
    model = model.to(device).eval()
    return model, tokenizer, p.stem if extra else p.name


_FILLER_WORDS = {
    "subject": ("The old bridge", "A quiet river", "The night train", "Our small garden", "The city library",
                "A distant mountain", "The morning market", "An open window", "The winter field", "A long road"),
    "verb": ("stood near", "ran past", "looked over", "waited beside", "turned toward", "rested under",
             "shone above", "moved along", "faded behind", "opened onto"),
    "object": ("the harbour", "a row of trees", "the empty square", "the northern hills", "a stone wall",
               "the painted door", "a field of wheat", "the sleeping town", "the wide valley", "a narrow lane"),
    "tail": ("in the evening", "before the rain", "as the bells rang", "while people talked", "for many years",
             "under a grey sky", "after the storm", "in early spring", "without a sound", "at first light"),
}


def filler_sentences(count: int, seed: int) -> list[str]:
    """Synthetic haystack: plain sentences from a small grammar (no facts a question could need)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_FILLER_WORDS[part]) for part in ("subject", "verb", "object", "tail")) + "."
            for _ in range(count)]


def haystack_sentences(text_dir: str | None, seed: int = 0) -> list[str]:
    """Sentences of every ``*.txt`` file of ``text_dir`` (name order), or synthetic filler."""
    if text_dir:
        files = sorted(Path(text_dir).glob("*.txt"))
        if not files:
            raise FileNotFoundError(f"no .txt files in {text_dir}")
        text = " ".join(f.read_text(errors="replace") for f in files)
        sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s.strip()]
        if sentences:
            return sentences
    return filler_sentences(4000, seed)


def haystack_token_ids(tokenizer, text_dir: str | None, n: int, seed: int = 0) -> list[int]:
    """``n`` token ids of haystack text, starting at a seed-chosen sentence (the text repeats when short)."""
    sentences = haystack_sentences(text_dir, seed)
    start = random.Random(seed).randrange(len(sentences))
    ids: list[int] = []
    i = start
    while len(ids) < n:
        chunk = " ".join(sentences[(i + j) % len(sentences)] for j in range(64))
        ids += tokenizer.encode(" " + chunk, add_special_tokens=False)
        i += 64
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return (bos + ids)[:n]


# ---------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------

_KEY_WORDS = ("amber", "brisk", "cobalt", "dusky", "ember", "fable", "gusty", "hazel", "ivory", "jolly", "karma",
              "lunar", "mossy", "noble", "olive", "pearl", "quill", "rusty", "sable", "tidal", "umber", "vivid",
              "wispy", "zesty")
_KEY_NOUNS = ("falcon", "harbor", "lantern", "meadow", "orchard", "pebble", "quarry", "saddle", "thimble",
              "violet", "willow", "canyon", "dagger", "beacon", "garnet", "kettle")


def _key(rng) -> str:
    return f"{rng.choice(_KEY_WORDS)}-{rng.choice(_KEY_NOUNS)}"


def _number(rng) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


NIAH_INTRO = ("A few special magic numbers are hidden in the text below. Remember them: there will be "
              "a question about them at the end.")


def make_task(task: str, rng: random.Random):
    """``(intro, needles, question, answer_prefix, answers, items)``: needles are inserted at random
    depths of the haystack; ``items`` replaces the haystack (the word list of cwe) when not None."""
    if task in ("niah_single", "niah_multikey", "niah_multivalue"):
        keys = [_key(rng)]
        while len(keys) < (4 if task == "niah_multikey" else 1):
            candidate = _key(rng)
            if candidate not in keys:
                keys.append(candidate)
        if task == "niah_multivalue":
            values = [_number(rng) for _ in range(4)]
            needles = [_needle(keys[0], v) for v in values]
            answers = values
        else:
            values = [_number(rng) for _ in keys]
            needles = [_needle(k, v) for k, v in zip(keys, values, strict=True)]
            answers = [values[0]]
        rng.shuffle(needles)
        target = keys[0]
        if task == "niah_multivalue":
            question = f"What are all the special magic numbers for {target} mentioned in the text above?"
            prefix = f"The special magic numbers for {target} mentioned in the text are:"
        else:
            question = f"What is the special magic number for {target} mentioned in the text above?"
            prefix = f"The special magic number for {target} mentioned in the text is:"
        return NIAH_INTRO, needles, question, prefix, answers, None
    if task == "vt":
        names = []
        while len(names) < 5:
            name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
            if name not in names:
                names.append(name)
        value = str(rng.randrange(10_000, 100_000))
        needles = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 5)]
        intro = "Memorize the variable assignments in the text below and follow them to the end."
        question = (f"Which variables are assigned the value {value}, directly or through other variables, "
                    "in the text above?")
        prefix = f"Following the chain of assignments, the variables that hold the value {value} are:"
        return intro, needles, question, prefix, names, None
    if task == "cwe":
        vocab = sorted({w.lower() for part in _FILLER_WORDS.values() for phrase in part for w in phrase.split()
                        if len(w) > 3} | set(_KEY_NOUNS) | set(_KEY_WORDS))
        rng.shuffle(vocab)
        common, rare = vocab[:10], vocab[10:]
        intro = "Below is a numbered list of words. Some words appear far more often than the others."
        question = "What are the 10 most common words in the list above?"
        prefix = "The 10 most common words in the list are:"
        return intro, [], question, prefix, common, (common, rare)
    raise ValueError(f"unknown task {task!r}; choose from {TASKS}")


def _cwe_items(common, rare, count: int, rng: random.Random) -> list[str]:
    """A word list of ``count`` entries where each common word appears 30 times per 100 rare ones."""
    words = []
    while len(words) < count:
        block = [w for w in common for _ in range(3)] + [rng.choice(rare) for _ in range(10)]
        rng.shuffle(block)
        words += block
    return [f"{i + 1}. {w}" for i, w in enumerate(words[:count])]


def build_prompt(tokenizer, task: str, n: int, seed: int, sentences: list[str]) -> tuple[list[int], list[str]]:
    """Token ids of one sample of ``task`` filled to at most ``n`` tokens, and its expected answers."""
    rng = random.Random(f"{task}:{n}:{seed}")
    intro, needles, question, prefix, answers, items = make_task(task, rng)
    depths = sorted(rng.random() for _ in needles)
    start = rng.randrange(len(sentences))

    def render(count: int) -> list[int]:
        if items is not None:
            body = "\n".join(_cwe_items(*items, count, random.Random(seed)))
        else:
            hay = [sentences[(start + i) % len(sentences)] for i in range(count)]
            for depth, needle in reversed(list(zip(depths, needles, strict=True))):
                hay.insert(int(round(depth * count)), needle)
            body = " ".join(hay)
        user = f"{intro}\n\n{body}\n\n{question}"
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                 add_generation_prompt=True)
            return tokenizer.encode(text + prefix, add_special_tokens=False)
        return tokenizer.encode(f"{user}\n{prefix}", add_special_tokens=True)

    # Grow the haystack geometrically to the length, then bisect for the largest that fits.
    low, high = 0, 16
    while len(render(high)) <= n:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        if len(render(mid)) <= n:
            low = mid
        else:
            high = mid
    return render(low), answers


def score_answer(text: str, answers: list[str]) -> float:
    """Share of the expected strings present in the answer (case-insensitive)."""
    text = text.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


# ---------------------------------------------------------------------------------------------
# Methods
# ---------------------------------------------------------------------------------------------


class Runner:
    """Runs one method's prefill on a model: a context manager per call, with the budgets it used."""

    def __init__(self, model, args):
        self.model = model
        self.args = args

    def context(self, method: str, budget_of):
        from cosa.integrations import transformers as cosa_hf

        a = self.args
        if method == "dense":
            return None
        common = dict(stride=a.stride, min_prefill_tokens=a.min_prefill_tokens, collect_stats=True)
        if method == "cosa":
            return cosa_hf.enable(self.model, top_p=a.top_p, delta=a.delta, **common)
        if method == "kap":
            return cosa_hf.enable(self.model, top_p=a.top_p, delta=0.0, **common)
        return cosa_hf.enable(self.model, delta=0.0, block_selector=self.selector(method, budget_of), **common)

    def selector(self, method: str, budget_of):
        a = self.args

        def select(module, q, k):
            scores, natural = proxies.peer_selection(
                method, q, k, stride=a.stride, xattn_threshold=a.xattn_threshold, flex_gamma=a.flex_gamma,
                flex_tau=a.flex_tau, meanpool_top_p=a.meanpool_top_p, softmax_scale=getattr(module, "scaling", None))
            budget = None if budget_of is None else budget_of(getattr(module, "layer_idx", None))
            mask = natural if budget is None else proxies.budget_mask(scores, budget, k.shape[0] - q.shape[0])
            return proxies.mask_to_lists(mask)

        return select

    def run(self, method: str, fn, budget_of):
        """``(fn(), budgets)`` with ``method``'s prefill (peers at ``budget_of(layer)`` blocks when
        given): the stage-1 and realised budgets and the realised budget per layer."""
        handle = self.context(method, budget_of)
        if handle is None:
            with torch.no_grad():
                return fn(), {"stage1": 1.0, "realised": 1.0, "per_layer": None}
        with handle, torch.no_grad():
            result = fn()
        summary = handle.summary()
        if not handle.sparse_calls:
            return result, {"stage1": 1.0, "realised": 1.0, "per_layer": None}
        per_layer = {layer: v["realised_budget"] for layer, v in summary.get("per_layer", {}).items()}
        return result, {"stage1": summary["stage1_budget"], "realised": summary["realised_budget"],
                        "per_layer": per_layer}


def match_budgets(args, method: str, cosa_budgets: dict | None):
    """The budget a peer keeps at each layer, as a function of the layer index (None: the peer's
    own threshold)."""
    if method not in proxies.PEERS or args.match == "none":
        return None
    if args.match == "cosa":
        return None if cosa_budgets is None else cosa_budgets.get
    fixed = float(args.match)
    return lambda layer: fixed


def generate(model, tokenizer, ids: list[int], max_new_tokens: int) -> str:
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], device=device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=pad)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


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


def evaluate(args, model, tokenizer, name: str, meta: dict, json_path: Path) -> dict:
    from tqdm.auto import tqdm

    runner = Runner(model, args)
    sentences = haystack_sentences(args.haystack_dir, args.seed)
    ordered = sorted(args.methods, key=lambda m: m != "cosa")  # cosa first: its budgets are matched
    samples: list[dict] = []
    ppl_rows: list[dict] = []
    total = len(args.lengths) * (len(args.tasks) * args.samples + args.ppl_samples) * len(ordered)
    bar = tqdm(total=total, desc="accuracy", file=sys.stderr, dynamic_ncols=True)

    def save(final=False):
        payload = {**meta, "model": name, "config": config_of(args), "samples": samples, "ppl": ppl_rows}
        if final:
            payload["scores"], payload["summary"] = aggregate(samples, ppl_rows)
        write_json(json_path, payload)

    for n in args.lengths:
        for task in args.tasks:
            for s in range(args.samples):
                ids, answers = build_prompt(tokenizer, task, n, args.seed + s, sentences)
                cosa_budgets = None
                for method in ordered:
                    bar.set_postfix_str(f"n={n} {task} #{s} {method}")
                    answer = lambda ids=ids: generate(model, tokenizer, ids, args.max_new_tokens)  # noqa: E731
                    text, budgets = runner.run(method, answer, match_budgets(args, method, cosa_budgets))
                    if method == "cosa":
                        cosa_budgets = budgets["per_layer"]
                    samples.append({"method": method, "n": n, "task": task, "sample": s, "tokens": len(ids),
                                    "score": score_answer(text, answers), "answer": text.strip()[:200],
                                    "expected": answers, "stage1": budgets["stage1"], "realised": budgets["realised"]})
                    bar.update(1)
                save()
        for s in range(args.ppl_samples):
            ids = haystack_token_ids(tokenizer, args.ppl_dir or args.haystack_dir, n, seed=args.seed + 1000 + s)
            cosa_budgets = None
            for method in ordered:
                bar.set_postfix_str(f"n={n} ppl #{s} {method}")
                (nll, count), budgets = runner.run(method, lambda ids=ids: tail_nll(model, ids),
                                                   match_budgets(args, method, cosa_budgets))
                if method == "cosa":
                    cosa_budgets = budgets["per_layer"]
                ppl_rows.append({"method": method, "n": n, "sample": s, "nll": nll, "tokens": count,
                                 "ppl": math.exp(nll / count), "stage1": budgets["stage1"],
                                 "realised": budgets["realised"]})
                bar.update(1)
            save()
    bar.close()
    save(final=True)
    return aggregate(samples, ppl_rows)


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def aggregate(samples: list[dict], ppl_rows: list[dict]):
    """Per (method, n, task) scores, and per (method, n) the mean score, perplexity and budgets."""
    scores, summary = [], []
    keys = sorted({(r["method"], r["n"], r["task"]) for r in samples}, key=lambda k: (METHODS.index(k[0]), k[1], k[2]))
    for method, n, task in keys:
        rs = [r for r in samples if (r["method"], r["n"], r["task"]) == (method, n, task)]
        scores.append({"method": method, "n": n, "task": task, "score": _mean(r["score"] for r in rs),
                       "samples": len(rs), "stage1": _mean(r["stage1"] for r in rs),
                       "realised": _mean(r["realised"] for r in rs)})
    pairs = sorted({(r["method"], r["n"]) for r in samples + ppl_rows}, key=lambda k: (METHODS.index(k[0]), k[1]))
    for method, n in pairs:
        rs = [r for r in samples if (r["method"], r["n"]) == (method, n)]
        ps = [r for r in ppl_rows if (r["method"], r["n"]) == (method, n)]
        ppl = math.exp(sum(r["nll"] for r in ps) / sum(r["tokens"] for r in ps)) if ps else None
        summary.append({"method": method, "n": n, "score": _mean(r["score"] for r in rs), "ppl": ppl,
                        "stage1": _mean(r["stage1"] for r in rs + ps),
                        "realised": _mean(r["realised"] for r in rs + ps)})
    return scores, summary


def config_of(args) -> dict:
    return {k: getattr(args, k) for k in ("lengths", "tasks", "methods", "samples", "ppl_samples", "top_p", "delta",
                                          "stride", "min_prefill_tokens", "match", "xattn_threshold", "flex_gamma",
                                          "flex_tau", "meanpool_top_p", "max_new_tokens", "seed", "haystack_dir")}


def plot(summary: list[dict], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    for method in METHODS:
        rs = sorted((r for r in summary if r["method"] == method), key=lambda r: r["n"])
        if any(r["score"] is not None for r in rs):
            ax1.plot([r["n"] for r in rs if r["score"] is not None], [r["score"] for r in rs if r["score"] is not None],
                     marker="o", label=method)
        if any(r["ppl"] is not None for r in rs):
            ax2.plot([r["n"] for r in rs if r["ppl"] is not None], [r["ppl"] for r in rs if r["ppl"] is not None],
                     marker="o", label=method)
    for ax, title in ((ax1, "RULER-style score (mean over tasks)"), (ax2, "perplexity of the second half")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    return save_figure(fig, path)


def parse_args(argv=None):
    p = argument_parser(__doc__)
    p.add_argument("--model", required=True, help="a model directory or a .gguf file")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768],
                   help="prompt lengths in tokens, one run of every task and perplexity window at each "
                        "(default 4096 8192 16384 32768)")
    p.add_argument("--samples", type=int, default=10, help="prompts per task and length (default 10)")
    p.add_argument("--tasks", default=",".join(TASKS),
                   help=f"comma-separated, of {','.join(TASKS)} (default all; empty: none)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated, of {','.join(METHODS)} (default all)")
    p.add_argument("--ppl-samples", type=int, default=2, help="perplexity windows per length (0: none; default 2)")
    p.add_argument("--haystack-dir", default=None, help="folder of .txt files (default: synthetic filler)")
    p.add_argument("--ppl-dir", default=None, help="folder of .txt files for perplexity (default: the haystack)")
    p.add_argument("--top-p", type=float, default=0.95,
                   help="KAP's top-p, the share of the proxy mass its lists keep (cosa and kap; default 0.95)")
    p.add_argument("--delta", type=float, default=2000.0,
                   help="OSK's skip threshold for cosa (<= 0: no in-kernel skip; kap and the peers always "
                        "run without it; default 2000)")
    p.add_argument("--stride", type=int, default=8,
                   help="antidiagonal downsampling stride of KAP and of XAttention, a divisor of 128 (default 8)")
    p.add_argument("--min-prefill-tokens", type=int, default=1024,
                   help="prefills shorter than this stay dense (every method; default 1024)")
    p.add_argument("--match", default=None,
                   help="peers' budgets: cosa (CoSA's per-layer realised budget; default when cosa runs), "
                        "none (their own thresholds), or a fraction")
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
    if args.match is None:
        args.match = "cosa" if "cosa" in args.methods else "none"
    elif args.match not in ("cosa", "none"):
        try:
            if not 0 < float(args.match) <= 1:
                raise ValueError
        except ValueError:
            p.error("--match: cosa, none, or a budget in (0, 1]")
    if args.match == "cosa" and "cosa" not in args.methods:
        p.error("--match cosa needs cosa among --methods")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    meta, json_path = start_run(args.out, "accuracy")
    progress(f"loading {args.model}")
    model, tokenizer, name = load_model(args.model, args.device, getattr(torch, args.dtype))
    progress(f"{name}: {model.config.num_hidden_layers} layers, {model.config.num_attention_heads} query heads")
    scores, summary = evaluate(args, model, tokenizer, name, meta, json_path)
    if args.plot and summary:
        png = json_path.with_suffix(".png")
        progress(f"plot -> {png}" if plot(summary, png) else "no plot: matplotlib is not installed")
    print(format_table(scores, SCORE_COLUMNS))
    print()
    print(format_table(summary, SUMMARY_COLUMNS))
    print(f"\nresults: {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
