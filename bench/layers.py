#!/usr/bin/env python3
"""Attention kernels on real activations: the post-RoPE Q/K/V of a few layers of a causal LM on a
long prompt of real text, captured once, then every implementation timed on the same tensors.

One forward pass of ``--model`` (a model directory or a GGUF file; Llama, Qwen2 and Qwen3 families)
over ``--n`` tokens of the essays in ``--haystack`` captures the query, key and value tensors of
``--layers`` as the attention function receives them (after the rotary embedding), through
transformers' attention-function registry; they stay on the GPU as ``[N, H, d]`` and the model is
freed. Then, per layer:

  cudnn           SDPA cuDNN, dense causal (K/V with repeated heads: SDPA has no GQA path for it)
  fa4             FlashAttention-4 dense (flash_attn.cute, native GQA), when the package is installed
  cosa            cosa.prefill at its defaults: KAP, then OSK with the in-kernel skip (KAP's proxy
                  "auto": the fp8 proxy from 8K keys)
  cosa-noskip     the same with the skip off (delta 0)
  cosa-tile       the defaults, the skip voted by all 128 rows of a tile
  cosa-native     the defaults with KAP's native proxy (q and k as given)
  cosa-fp8        the defaults with KAP's fp8 (e4m3) proxy
  kap             KAP alone (stage 1: the ordered block lists)
  kap-fp8         KAP alone with the fp8 proxy; its row also compares its lists with kap's: the IoU of
                  the kept sets (iou_vs_native) and the share of each query block's exact attention
                  mass that the kept blocks hold (mass_native, mass_fp8)
  osk, osk-fp8    OSK alone (the defaults' delta and vote) on the lists of kap and kap-fp8: with the
                  KAP rows they split cosa and cosa-fp8 into their two stages
  osk-noskip      OSK alone on kap's lists with the skip off (delta 0)
  osk-skipnone    the same with the skip on but a threshold so low that nothing is skipped (delta 1e-30)

With ``--serving-page-size P`` and/or ``--serving-chunk C`` the CoSA rows also run the layer as a
serving engine does (vLLM: page size 16 and chunks of 16384 queries by default), timed in the same
rounds as ``cosa``, so that each one's paired ratio to it says what that shape costs:

  cosa-page{P}          one call over a cache of P-token pages (the timed rows' pages are 128 tokens)
  cosa-chunk{C}         the prompt as successive calls of C queries each, each over every key before
                        its last query (the chunked prefill of a serving engine), on 128-token pages
  cosa-page{P}-chunk{C} both

A chunked row's time is the sum of its calls, its budgets the causal-block-weighted mean of theirs;
their outputs, laid end to end, are checked as the one call's are. ``serving_x_cosa`` on those rows is
the median over the rounds of the row's time over ``cosa``'s.

The ``kap`` and ``kap-fp8`` rows carry ``stages_ms``, each stage's kernel time per call under
torch.profiler (input checks, index, key range, quantisation, scoring, select, other; the kernels of
the chain overlap, so the stages sum to more than the row's time). The CoSA rows of a layer are
timed together in interleaved rounds, and so are its OSK rows (each row keeps its ``rounds_ms``):
the ratios below are medians of per-round ratios, which a few percent of drift between rows timed
one after another would otherwise decide. ``skip_gain`` is the skip-off time over the skip-on time
(above 1: the skip pays), on the ``cosa`` row from cosa-noskip, on the ``osk`` row from osk-noskip.
The ``osk`` row also carries two ratios from the three OSK times on the native lists:
``skip_tax``, the skip-none time over the skip-off time (what the skip machinery costs the blocks
that are computed; 1 when free), and ``skip_cost``, what a skipped block costs as a share of a
computed one with the machinery on: ``(t_osk / t_skipnone - r) / (1 - r)`` with ``r`` = realised /
stage-1 budget (the per-block model ignores each tile's fixed cost; None when under 5% of the listed
blocks are skipped).

With ``--lists-only`` nothing is timed, and the run needs no GPU (``--device cpu`` captures on the CPU
and computes the lists with the ops' CPU path, the PyTorch reference): per layer only the ``kap`` and
``kap-fp8`` rows, their stage-1 budgets and the fp8 lists' agreement with the native ones. With
``--save-ab-inputs FILE`` it also writes each layer's Q/K/V and KAP's lists at the defaults (the
proxy precision ``auto`` resolves to at this length) for ``dev/kernel_ab.py --inputs FILE``, which
times OSK variants side by side on them. The file, little-endian: the bytes ``COSAOSK1``; int32
tokens, query heads, KV heads, head dim, layers; then per layer int32 layer index, float32 softmax
scale, q ``[tokens, Hq, d]``, k and v ``[tokens, Hkv, d]`` (bf16), order ``[Hq, tokens/128,
tokens/128]`` and counts ``[Hq, tokens/128]`` (int32).

Each row has the median time, the stage-1 and realised budgets (cosa.prefill's statistics; 1 for the
dense rows; the stage-1 budget of its lists for kap) and the error against a float32 dense reference
on 8 query blocks spread over the prompt, every head: ``rel_err`` = ||out - ref|| / ||ref|| over
those rows, ``max_row_err`` the largest of the same ratio for one (query, head) row. ``x_cudnn`` and
``x_fa4``: the dense kernel's time on the layer over the row's (above 1: faster); the summary's
``x_fa4_tw`` is the time-weighted one (FA4's summed time over the row's). The ``cosa`` row also says what
its budgets allow (``add_ideal``): ``kap_share``, KAP's time at the defaults' proxy over the dense
kernel's, and ``ideal_ms``, the dense kernel's time scaled to the blocks CoSA computes (plus 0.4 of each
block it skips, the cost of its logits) plus KAP's time; ``x_ideal`` is the speed-up that would give,
``of_ideal`` how much of it the measured time realises. The ops run with their device checks on, as a
default call does.

Past the model's positions (``--n`` above its ``max_position_embeddings``) the capture runs with YaRN
rope scaling, factor 4 unless ``--yarn-factor`` says otherwise, as Qwen2.5 documents it and as
``bench/vllm_e2e.py --long-lengths`` runs vLLM; ``config.yarn_factor`` records it, ``config.n`` the length.

    python bench/layers.py --model DIR|FILE.gguf --haystack DIR [--n 32768] [--layers 2,8,14,20,27]
                           [--yarn-factor F] [--serving-page-size 16] [--serving-chunk 16384] [--lists-only] [--device auto|cuda|cpu] [--seed 0] [--plot] [--out bench/results]
"""

from __future__ import annotations

import argparse
import gc
import inspect
import statistics
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import (REPO_ROOT, argument_parser, finish_report, format_table, interleaved_ms, paired_ratio,  # noqa: E402
                    progress, record_kap_stages, relative_error, require_cuda, save_figure, start_run, time_ms,
                    write_json)
from kernel import (BLOCK, CONFIG, NO_SKIP_DELTA, InputSet, attach_paged, causal_blocks, causal_lists, fa4_dense,  # noqa: E402
                    guarded, load_fa4, one_line, reference_rows, rows_of, sdpa)
import proxies  # noqa: E402
from cosa.layout import kap_layout_args, paged_from_contiguous  # noqa: E402

# cosa.prefill's keyword arguments of each CoSA row, over the wrapper's defaults.
COSA_VARIANTS = {"cosa": {}, "cosa-noskip": {"delta": 0.0}, "cosa-tile": {"vote": "tile"},
                 "cosa-native": {"proxy_precision": "native"}, "cosa-fp8": {"proxy_precision": "fp8"}}
CHECKED_BLOCKS = 8
DEFAULT_YARN_FACTOR = 4.0  # Qwen2.5's documented factor for prompts past its 32K positions
# What a skipped block costs at the least, as a share of a computed one: the skip needs the block's
# logits, S = Q K^T, half of a block's tensor work (of which the vote decides, so a little less).
SKIPPED_BLOCK_FLOOR = 0.4
TABLE_COLUMNS = ("layer", "n", "impl", "ms", "x_cudnn", "x_fa4", "stage1_budget", "realised_budget", "rel_err",
                 "max_row_err", "iou_vs_native", "mass_native", "mass_fp8", "skip_gain", "skip_tax", "skip_cost",
                 "kap_share", "ideal_ms", "x_ideal", "of_ideal", "serving_x_cosa")
SUMMARY_COLUMNS = ("impl", "layers", "ms", "x_cudnn", "x_fa4", "x_fa4_tw", "stage1_budget", "realised_budget",
                   "rel_err", "max_row_err", "iou_vs_native", "mass_native", "mass_fp8", "skip_gain", "skip_tax",
                   "skip_cost", "kap_share", "ideal_ms", "x_ideal", "of_ideal", "serving_x_cosa")
LISTS_COLUMNS = ("layer", "n", "impl", "stage1_budget", "iou_vs_native", "mass_native", "mass_fp8")
PRECISION_IMPLS = {"native": "kap", "fp8": "kap-fp8"}
OSK_IMPLS = {"native": "osk", "fp8": "osk-fp8"}
# OSK alone on the native lists besides the defaults: the skip off, and on with nothing skipped.
OSK_SKIP_VARIANTS = {"osk-noskip": {"delta": 0.0}, "osk-skipnone": {"delta": NO_SKIP_DELTA}}
# Below this share of skipped blocks a skipped block's cost is not estimated (a ratio of small differences).
MIN_SKIPPED_SHARE = 0.05


# ---------------------------------------------------------------------------------------------
# Capture
# ---------------------------------------------------------------------------------------------


def default_layers(num_layers: int) -> list[int]:
    """Five layers spread over the depth, from layer 2 to the last: 2, 8, 14, 20, 27 of 28."""
    first = min(2, num_layers - 1)
    step = (num_layers - 1 - first) // 4
    return sorted({first + i * step for i in range(4)} | {num_layers - 1})


def attention_scales(model) -> dict[int, float]:
    """``{layer: softmax scale}`` of the model's attention modules (the ``scaling`` they hand the
    attention function)."""
    return {m.layer_idx: float(m.scaling) for m in model.modules()
            if hasattr(m, "layer_idx") and hasattr(m, "scaling")}


def model_positions(model_path: str) -> int:
    """The positions the model was trained for (``max_position_embeddings`` of its configuration)."""
    from transformers import AutoConfig

    p = Path(model_path)
    extra = {"gguf_file": p.name} if p.suffix == ".gguf" else {}
    return int(AutoConfig.from_pretrained(str(p.parent if extra else p), **extra).max_position_embeddings)


def resolve_yarn_factor(requested: float | None, n: int, positions: int) -> float | None:
    """``--yarn-factor``: as given (0 turns YaRN off), else DEFAULT_YARN_FACTOR when the prompt has more
    tokens than the model has positions (as vLLM is run past them), else None."""
    if requested is not None:
        return requested or None
    return DEFAULT_YARN_FACTOR if n > positions else None


def capture_layers(model_path: str, haystack: str, n: int, layers: list[int] | None, seed: int, device: str,
                   yarn_factor: float | None = None):
    """``({layer: (q, k, v, scale)}, facts)``: one forward pass of the model (YaRN rope scaling by
    ``yarn_factor`` when given) over ``n`` tokens of the haystack's text, q ``[n, Hq, d]`` and k, v
    ``[n, Hkv, d]`` on ``device``. The model is released on return."""
    from accuracy_tasks import haystack_token_ids
    from models import load_model
    from fidelity import capture_qkv

    model, tokenizer, name = load_model(model_path, device, torch.bfloat16, yarn_factor)
    num_layers = model.config.num_hidden_layers
    layers = layers or default_layers(num_layers)
    if layers[-1] >= num_layers:
        raise ValueError(f"--layers: {name} has {num_layers} layers (0 to {num_layers - 1}), asked for {layers}")
    ids = torch.tensor([haystack_token_ids(tokenizer, haystack, n, seed=seed)], device=device)
    progress(f"{name}: {num_layers} layers; capturing layers {layers} at {ids.shape[1]} tokens")
    captured = capture_qkv(model, ids, set(layers))
    missing = sorted(set(layers) - set(captured))
    if missing:
        raise RuntimeError(f"no attention call of layers {missing} went through transformers' attention "
                           "registry: this model's attention cannot be captured")
    scales = attention_scales(model)
    q, k, _ = captured[layers[0]]
    facts = {"model": name, "num_layers": num_layers, "layers": layers, "hq": q.shape[1], "hkv": k.shape[1],
             "d": q.shape[2], "yarn_factor": yarn_factor}
    return {layer: (*captured[layer], scales.get(layer)) for layer in layers}, facts


# ---------------------------------------------------------------------------------------------
# KAP's lists at both proxy precisions
# ---------------------------------------------------------------------------------------------


def list_agreement(lists: dict, q: torch.Tensor, k: torch.Tensor, scale: float | None) -> dict:
    """How the fp8 lists compare with the native ones (``lists``: precision -> ``(order, counts)``):
    ``iou_vs_native``, the intersection over union of the kept sets summed over (head, query block),
    and ``mass_native``/``mass_fp8``, the share of each query block's exact attention mass that its
    kept blocks hold, averaged over (head, query block)."""
    mass = proxies.oracle_mass(q, k, scale)
    kept = {precision: proxies.lists_to_mask(*lists[precision]) for precision in lists}
    union = int((kept["native"] | kept["fp8"]).sum())
    return {"iou_vs_native": int((kept["native"] & kept["fp8"]).sum()) / max(union, 1),
            "mass_native": proxies.mask_metrics(kept["native"], kept["native"], mass)["mass"],
            "mass_fp8": proxies.mask_metrics(kept["fp8"], kept["native"], mass)["mass"]}


def report_agreement(layer: int, comparison: dict) -> None:
    progress(f"  layer {layer} kap-fp8 against kap: IoU {comparison['iou_vs_native']:.4f}, attention mass "
             f"kept {100 * comparison['mass_native']:.2f}% (native) / {100 * comparison['mass_fp8']:.2f}% (fp8)")


def stage1_budget(counts: torch.Tensor) -> float:
    return int(counts.sum()) / causal_blocks(counts.shape[1], counts.shape[0])


def lists_rows(cosa_mod, layer: int, q, k, scale: float | None) -> tuple[list[dict], dict]:
    """``--lists-only``: the ``kap`` and ``kap-fp8`` rows of one layer, untimed, on q's device (the
    CUDA kernels, or on the CPU the reference), and the lists (precision -> ``(order, counts)``)."""
    n = q.shape[0]
    layout_args = kap_layout_args(paged_from_contiguous(q, k))
    lists, rows = {}, []
    for precision, impl in PRECISION_IMPLS.items():
        lists[precision] = cosa_mod.kap(*layout_args, softmax_scale=scale, proxy_precision=precision)
        rows.append({"kind": "lists", "layer": layer, "n": n, "impl": impl,
                     "stage1_budget": stage1_budget(lists[precision][1])})
    comparison = list_agreement(lists, q, k, scale)
    rows[-1].update(comparison)
    report_agreement(layer, comparison)
    return rows, lists


AB_INPUTS_MAGIC = b"COSAOSK1"


def write_ab_inputs_header(f, n: int, facts: dict) -> None:
    """The header of ``--save-ab-inputs`` (module docstring)."""
    f.write(AB_INPUTS_MAGIC + struct.pack("<5i", n, facts["hq"], facts["hkv"], facts["d"], len(facts["layers"])))


def write_ab_inputs_layer(f, layer: int, scale: float, q, k, v, order, counts) -> None:
    """One layer's record of ``--save-ab-inputs`` (module docstring)."""
    f.write(struct.pack("<if", layer, scale))
    for x in (q, k, v):
        f.write(x.to(torch.bfloat16).contiguous().cpu().view(torch.int16).numpy().tobytes())
    for x in (order, counts):
        f.write(x.to(torch.int32).contiguous().cpu().numpy().tobytes())


# ---------------------------------------------------------------------------------------------
# Timing and checking one layer
# ---------------------------------------------------------------------------------------------


def checked_blocks(nq: int, count: int = CHECKED_BLOCKS) -> list[int]:
    """``count`` query blocks spread evenly from the first to the last."""
    return sorted({round(i * (nq - 1) / max(1, count - 1)) for i in range(count)})


def errors(out_rows: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """``(||out - ref|| / ||ref|| over all the rows, the largest of that ratio for one (query, head)
    row)`` of ``[rows, H, d]`` tensors; NaN anywhere gives NaN."""
    diff = torch.linalg.vector_norm(out_rows.float() - ref, dim=-1)
    per_row = diff / torch.linalg.vector_norm(ref, dim=-1)
    return relative_error(out_rows, ref), float(per_row.max())


@dataclass
class Check:
    """The float32 dense reference of one layer on its checked query blocks."""
    n: int
    blocks: list[int]
    ref: torch.Tensor


class LayerRun:
    """Times every implementation on one captured layer after another; a failing row is reported
    and the run goes on."""

    def __init__(self, cosa_mod, fa4, seed: int, serving: dict[str, tuple[int, int | None]] | None = None):
        self.cosa = cosa_mod
        self.fa4 = fa4
        self.seed = seed
        self.serving = serving or {}
        self.rows: list[dict] = []
        self.failures: list[str] = []
        self.peers_left_out: dict[str, str] = {}

    def guarded(self, label: str, fn, *args) -> None:
        guarded(self.failures, label, fn, *args)

    def add(self, layer: int, impl: str, ms: float, check: Check, out=None, stage1=1.0, realised=1.0,
            rounds_ms=None) -> dict:
        rel_err, max_row_err = errors(rows_of(out, check.blocks, check.n), check.ref) if out is not None \
            else (None, None)
        row = {"kind": "layer", "layer": layer, "n": check.n, "impl": impl, "ms": ms, "stage1_budget": stage1,
               "realised_budget": realised, "rel_err": rel_err, "max_row_err": max_row_err}
        if rounds_ms is not None:
            row["rounds_ms"] = rounds_ms
        self.rows.append(row)
        parts = [f"layer {layer} {impl}: {ms:.3f} ms"]
        if impl not in ("cudnn", "fa4"):
            parts.append(f"budgets {stage1:.3f}" + (f" / {realised:.3f}" if realised is not None else ""))
        if rel_err is not None:
            parts.append(f"rel_err {rel_err:.2e} (max row {max_row_err:.2e})")
        progress("  " + ", ".join(parts))
        return row

    def add_interleaved(self, layer: int, runs: dict, check: Check, budgets) -> dict[str, dict]:
        """Rows for the implementations in ``runs`` (impl -> (function, its first output)), timed in
        interleaved rounds (common.interleaved_ms): their ``ms`` is the median round and ``rounds_ms``
        every round, so that two rows of the same layer compare in paired rounds. ``budgets(impl,
        output)`` gives a row's stage-1 and realised budgets."""
        times = interleaved_ms({impl: fn for impl, (fn, _) in runs.items()})
        return {impl: self.add(layer, impl, statistics.median(times[impl]), check, output[0],
                               *budgets(impl, output), rounds_ms=times[impl])
                for impl, (_, output) in runs.items()}

    def layer(self, layer: int, q, k, v, scale: float | None) -> None:
        """Every row of one layer: q ``[N, Hq, d]``, k, v ``[N, Hkv, d]`` on the GPU."""
        n, hq, d = q.shape
        group = hq // k.shape[1]
        s = InputSet(q=q, k=k, v=v, k_rep=k.repeat_interleave(group, dim=1), v_rep=v.repeat_interleave(group, dim=1))
        attach_paged(s, n, self.seed, self.cosa)
        nq = -(-n // BLOCK)
        blocks = checked_blocks(nq)
        check = Check(n, blocks, reference_rows(q, k, v, *causal_lists(nq, hq, q.device), blocks,
                                                scale if scale is not None else d ** -0.5))
        self.guarded(f"layer {layer} cudnn", self.cudnn_row, layer, s, check, scale)
        if self.fa4 is not None:
            self.guarded(f"layer {layer} fa4", self.fa4_row, layer, s, check, scale)
        self.guarded(f"layer {layer} cosa", self.cosa_rows, layer, s, check, scale)
        self.guarded(f"layer {layer} kap", self.kap_rows, layer, s, check, scale)

    def cudnn_row(self, layer, s: InputSet, check: Check, scale):
        run = lambda: sdpa(SDPBackend.CUDNN_ATTENTION, s.bhsd_view(s.q), s.bhsd_view(s.k_rep),  # noqa: E731
                           s.bhsd_view(s.v_rep), False, scale)
        out = run()[0].transpose(0, 1)
        self.add(layer, "cudnn", time_ms(run), check, out)

    def fa4_row(self, layer, s: InputSet, check: Check, scale):
        """FA4 is an optional peer: when its first call (which compiles the kernel for the shape) fails,
        one line says why and its rows are left out from here on."""
        run = lambda: fa4_dense(self.fa4, s.q, s.k, s.v, softmax_scale=scale)  # noqa: E731
        try:
            out = run()
            torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001  (an optional peer must not fail the run)
            self.peers_left_out["fa4"] = one_line(error)
            self.fa4 = None
            progress(f"fa4: rows left out ({self.peers_left_out['fa4']})")
            return
        self.add(layer, "fa4", time_ms(run), check, out)

    def cosa_rows(self, layer, s: InputSet, check: Check, scale):
        """The CoSA variants in interleaved rounds; the ``cosa`` row's ``skip_gain`` is the median over
        the rounds of cosa-noskip's time over cosa's (above 1: the skip pays on this layer)."""
        n = check.n
        runs = {}
        for impl, options in COSA_VARIANTS.items():
            def run(options=options, **stats):
                return self.cosa.prefill(s.q, s.k_cache, s.v_cache, s.page_table, s.cu_seqlens_q, s.seqused_k,
                                         n, n, softmax_scale=scale, **options, **stats)

            def first_call(impl=impl, run=run):
                runs[impl] = (run, run(return_stats=True))
            self.guarded(f"layer {layer} {impl}", first_call)
        for impl, (page_size, chunk) in self.serving.items():
            def serving_first_call(impl=impl, page_size=page_size, chunk=chunk):
                run = self.serving_run(s, n, page_size, chunk, scale)
                runs[impl] = (run, run(return_stats=True))
            self.guarded(f"layer {layer} {impl}", serving_first_call)
        rows = self.add_interleaved(layer, runs, check,
                                    lambda impl, output: (output[1]["stage1_budget"], output[1]["realised_budget"]))
        if "cosa" in rows and "cosa-noskip" in rows:
            rows["cosa"]["skip_gain"] = skip_gain(rows["cosa"], rows["cosa-noskip"])
        if "cosa" in rows:
            for impl in self.serving:
                if impl in rows:
                    rows[impl]["serving_x_cosa"] = paired_ratio(rows[impl]["rounds_ms"], rows["cosa"]["rounds_ms"])

    def serving_run(self, s: InputSet, n: int, page_size: int, chunk: int | None, scale: float | None):
        """cosa.prefill over the layer as a serving engine runs it: on a cache of ``page_size``-token
        pages, as successive calls of ``chunk`` queries (None: one call), each over every key up to its
        last query. Returns ``run(return_stats=False)``: the outputs end to end, with the budgets
        weighted by each call's causal blocks when asked."""
        if page_size == CONFIG["page_size"]:
            k_cache, v_cache, page_table = s.k_cache, s.v_cache, s.page_table
        else:
            k_cache, v_cache, page_table = self.cosa.testing.paged_kv(
                s.k, s.v, [n], page_size, shuffle=True, generator=torch.Generator().manual_seed(self.seed))
        spans = chunk_spans(n, chunk)
        lengths = lambda *values: torch.tensor(values, dtype=torch.int32, device=s.q.device)  # noqa: E731
        calls = [(s.q[start:end], lengths(0, end - start), lengths(end), end - start, end) for start, end in spans]
        weights = [causal_block_count(start, end) for start, end in spans]

        def run(return_stats=False):
            results = [self.cosa.prefill(q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, lq, lk,
                                         softmax_scale=scale, return_stats=return_stats)
                       for q, cu_seqlens_q, seqused_k, lq, lk in calls]
            if not return_stats:
                return torch.cat(results)
            stats = {key: sum(w * stats[key] for w, (_, stats) in zip(weights, results)) / sum(weights)
                     for key in ("stage1_budget", "realised_budget")}
            return torch.cat([out for out, _ in results]), stats
        return run

    def kap_rows(self, layer, s: InputSet, check: Check, scale):
        """KAP alone at each proxy precision (rows ``kap``, ``kap-fp8``), the fp8 row with how its lists
        compare with the native ones (:func:`list_agreement`); then OSK alone on each precision's lists
        (rows ``osk``, ``osk-fp8``), so that a CoSA row's time splits into its two stages."""
        n = check.n
        lists = {}
        for precision, impl in PRECISION_IMPLS.items():
            run = lambda: self.cosa.kap(s.q, s.k_cache, s.page_table, s.cu_seqlens_q,  # noqa: E731
                                        s.seqused_k, n, n, softmax_scale=scale, proxy_precision=precision)
            order, counts = run()
            self.add(layer, impl, time_ms(run), check, stage1=stage1_budget(counts), realised=None)
            if s.q.is_cuda:  # a failure here costs only this field, not the rows after it
                self.guarded(f"layer {layer} {impl} stages", record_kap_stages, self.rows[-1], run,
                             f"layer {layer} {impl}")
            lists[precision] = (order, counts)
        comparison = list_agreement(lists, s.q, s.k, scale)
        self.rows[-1].update(comparison)
        report_agreement(layer, comparison)
        variants = {impl: (lists[precision], {}) for precision, impl in OSK_IMPLS.items()}
        variants.update({impl: (lists["native"], options) for impl, options in OSK_SKIP_VARIANTS.items()})
        runs, counts_of = {}, {}
        for impl, ((order, counts), options) in variants.items():
            def run(order=order, counts=counts, options=options):
                return self.cosa.osk(s.q, s.k_cache, s.v_cache, s.page_table, s.cu_seqlens_q, s.seqused_k, order,
                                     counts, check.n, softmax_scale=scale, **options)

            def first_call(impl=impl, run=run):
                runs[impl] = (run, run())
            counts_of[impl] = counts
            self.guarded(f"layer {layer} {impl}", first_call)
        rows = self.add_interleaved(layer, runs, check, lambda impl, output: self.cosa.reference.budgets(
            counts_of[impl], output[2], s.cu_seqlens_q, s.seqused_k))
        if all(impl in rows for impl in ("osk", *OSK_SKIP_VARIANTS)):
            rows["osk"].update(skip_ratios(rows["osk"], rows["osk-noskip"], rows["osk-skipnone"]))


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


def serving_variants(page_size: int | None, chunk: int | None) -> dict[str, tuple[int, int | None]]:
    """The serving-shaped CoSA rows (module docstring) for ``--serving-page-size`` and
    ``--serving-chunk``: row name -> (page size, queries per call or None for one call)."""
    variants = {}
    if page_size is not None:
        variants[f"cosa-page{page_size}"] = (page_size, None)
    if chunk is not None:
        variants[f"cosa-chunk{chunk}"] = (CONFIG["page_size"], chunk)
    if page_size is not None and chunk is not None:
        variants[f"cosa-page{page_size}-chunk{chunk}"] = (page_size, chunk)
    return variants


def chunk_spans(n: int, chunk: int | None) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: the queries of each call when ``n`` queries go ``chunk`` at a time."""
    step = chunk or n
    return [(start, min(start + step, n)) for start in range(0, n, step)]


def causal_block_count(start: int, end: int) -> int:
    """The causal 128 x 128 blocks of queries ``[start, end)`` of one sequence whose keys end at
    ``end``: query block ``i`` (counted from the sequence's start) sees ``i + 1`` key blocks."""
    return sum(i + 1 for i in range(start // BLOCK, -(-end // BLOCK)))


def skip_gain(skip_on: dict, skip_off: dict) -> float:
    """The skip-off row's time over the skip-on row's, from their paired rounds (above 1: the skip pays)."""
    return paired_ratio(skip_off["rounds_ms"], skip_on["rounds_ms"])


def skip_ratios(osk: dict, noskip: dict, skipnone: dict) -> dict:
    """``skip_gain``, ``skip_tax`` and ``skip_cost`` (module docstring) of OSK's rows at the defaults,
    with the skip off and with nothing skipped, all on the same lists, each from paired rounds."""
    computed = osk["realised_budget"] / osk["stage1_budget"]
    skip_cost = None
    if 1 - computed >= MIN_SKIPPED_SHARE:
        skip_cost = (paired_ratio(osk["rounds_ms"], skipnone["rounds_ms"]) - computed) / (1 - computed)
    return {"skip_gain": skip_gain(osk, noskip),
            "skip_tax": paired_ratio(skipnone["rounds_ms"], noskip["rounds_ms"]), "skip_cost": skip_cost}


def add_speedups(rows: list[dict]) -> None:
    """``x_cudnn``, ``x_fa4``: the dense kernel's time on the same layer over the row's (None where
    that kernel has no row on the layer)."""
    for anchor in ("cudnn", "fa4"):
        base = {r["layer"]: r["ms"] for r in rows if r["impl"] == anchor}
        for r in rows:
            r[f"x_{anchor}"] = base[r["layer"]] / r["ms"] if r["layer"] in base else None


def add_ideal(rows: list[dict], kap_impl: str) -> None:
    """On each ``cosa`` row, what its budgets allow beside what it took, from the same layer's rows:
    ``kap_share`` (the time of KAP at the defaults' proxy, the ``kap_impl`` row, over the dense anchor's:
    FA4, else cuDNN) and ``ideal_ms``, the anchor's time scaled to the blocks CoSA computes plus
    SKIPPED_BLOCK_FLOOR of each block it skips, plus KAP's time: attention at the dense kernel's speed
    per block on CoSA's budgets. ``x_ideal`` is the anchor's time over the ideal one, ``of_ideal`` the
    ideal time over the measured one (1: the budgets' whole gain realised)."""
    for layer in {r["layer"] for r in rows}:
        mine = {r["impl"]: r for r in rows if r["layer"] == layer}
        anchor = mine.get("fa4") or mine.get("cudnn")
        cosa, kap = mine.get("cosa"), mine.get(kap_impl)
        if anchor is None or cosa is None or kap is None:
            continue
        computed, listed = cosa["realised_budget"], cosa["stage1_budget"]
        ideal = anchor["ms"] * (computed + SKIPPED_BLOCK_FLOOR * (listed - computed)) + kap["ms"]
        cosa.update(kap_share=kap["ms"] / anchor["ms"], ideal_ms=ideal, x_ideal=anchor["ms"] / ideal,
                    of_ideal=ideal / cosa["ms"])


def summarise(rows: list[dict]) -> list[dict]:
    """Per implementation over the layers: the mean of each column, the largest ``max_row_err``, and
    ``x_fa4_tw``/``x_cudnn_tw``, the time-weighted speed-ups (the anchor's summed time over the row's
    summed time, on the layers that have both)."""
    summary = []
    for impl in dict.fromkeys(r["impl"] for r in rows):
        mine = [r for r in rows if r["impl"] == impl]
        entry = {"impl": impl, "layers": len(mine)}
        for key in (k for k in SUMMARY_COLUMNS[2:] if not k.endswith("_tw")):
            values = [r[key] for r in mine if r.get(key) is not None]
            pick = max if key == "max_row_err" else (lambda vs: sum(vs) / len(vs))
            entry[key] = pick(values) if values else None
        for anchor in ("fa4", "cudnn"):
            base = {r["layer"]: r["ms"] for r in rows if r["impl"] == anchor}
            paired = [r for r in mine if r["layer"] in base]
            entry[f"x_{anchor}_tw"] = (sum(base[r["layer"]] for r in paired) / sum(r["ms"] for r in paired)
                                       if paired else None)
        summary.append(entry)
    return summary


def results(meta: dict, config: dict, run: LayerRun) -> dict:
    """The results file: the run's metadata and configuration, every row, the summary per
    implementation, the failures and the optional peers left out (with why)."""
    return {**meta, "config": config, "rows": run.rows, "summary": summarise(run.rows), "failures": run.failures,
            "peers_left_out": run.peers_left_out}


def prefill_defaults(cosa_mod) -> dict:
    """The tuning defaults of cosa.prefill, which the ``cosa`` row runs with (read from its signature)."""
    params = inspect.signature(cosa_mod.prefill).parameters
    return {name: params[name].default for name in ("stride", "top_p", "delta", "vote", "proxy_precision")
            if name in params}


def plot(rows: list[dict], path: Path, title: str) -> bool:
    """Left: time per layer and implementation. Right: speedup over FA4 dense (cuDNN without FA4),
    the single stages (KAP alone, OSK alone) left out. False when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    layers = sorted({r["layer"] for r in rows})
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    anchor = "fa4" if "fa4" in impls else "cudnn"
    width = 0.8 / len(impls)
    fig, (ax_ms, ax_x) = plt.subplots(1, 2, figsize=(15, 5.5))
    for i, impl in enumerate(impls):
        by_layer = {r["layer"]: r for r in rows if r["impl"] == impl}
        xs = [j + (i - (len(impls) - 1) / 2) * width for j, layer in enumerate(layers) if layer in by_layer]
        mine = [by_layer[layer] for layer in layers if layer in by_layer]
        # Ten default colours until they would repeat; then twenty, so that no two rows share one.
        color = f"C{i}" if len(impls) <= 10 else plt.get_cmap("tab20")(i % 20)
        ax_ms.bar(xs, [r["ms"] for r in mine], width, label=impl, color=color)
        if not impl.startswith(("kap", "osk")):
            ax_x.bar(xs, [r[f"x_{anchor}"] or 0.0 for r in mine], width, label=impl, color=color)
    for ax in (ax_ms, ax_x):
        ax.set_ylim(top=ax.get_ylim()[1] * 1.25)  # room for the legend above the bars
        ax.set_xticks(range(len(layers)), [str(layer) for layer in layers])
        ax.set_xlabel("layer")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, ncol=4, loc="upper center")
    ax_ms.set_ylabel("median time (ms)")
    ax_ms.set_title(f"{title}: one attention layer")
    ax_x.axhline(1.0, color="black", linewidth=0.8)
    ax_x.set_ylabel(f"{anchor} time / time (above 1: faster)")
    ax_x.set_title(f"speedup over {anchor} dense on the same layer")
    return save_figure(fig, path)


def plot_agreement(rows: list[dict], path: Path, title: str) -> bool:
    """``--lists-only``: per layer, the kept-set IoU of the fp8 lists against the native ones, and the
    attention mass each precision's lists keep. False when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fp8 = sorted((r for r in rows if r["impl"] == "kap-fp8"), key=lambda r: r["layer"])
    xs = range(len(fp8))
    fig, (ax_iou, ax_mass) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax_iou.bar(xs, [r["iou_vs_native"] for r in fp8], 0.6, color="C1")
    ax_iou.set_ylim(min(r["iou_vs_native"] for r in fp8) - 0.02, 1.0)
    ax_iou.set_ylabel("kept-set IoU, fp8 against native")
    for offset, key, label in ((-0.15, "mass_native", "native"), (0.15, "mass_fp8", "fp8")):
        ax_mass.bar([x + offset for x in xs], [r[key] for r in fp8], 0.3, label=label)
    ax_mass.set_ylim(min(min(r["mass_native"], r["mass_fp8"]) for r in fp8) - 0.02, 1.0)
    ax_mass.set_ylabel("exact attention mass kept")
    ax_mass.legend(fontsize=8)
    for ax in (ax_iou, ax_mass):
        ax.set_xticks(list(xs), [str(r["layer"]) for r in fp8])
        ax.set_xlabel("layer")
        ax.grid(axis="y", alpha=0.3)
        ax.set_title(title, fontsize=9)
    return save_figure(fig, path)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def layer_list(text: str) -> list[int]:
    """``"2,8,14"`` -> ``[2, 8, 14]`` (sorted, distinct, non-negative)."""
    try:
        layers = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of layer indices: {text!r}") from None
    if not layers or layers[0] < 0:
        raise argparse.ArgumentTypeError(f"layer indices must be >= 0, got {text!r}")
    return layers


def parse_args(argv=None):
    p = argument_parser(__doc__)
    p.add_argument("--model", required=True, help="a model directory or a .gguf file")
    p.add_argument("--haystack", required=True, help="a folder of .txt files (essays): the prompt's text")
    p.add_argument("--n", type=int, default=32768, help="prompt length in tokens, a multiple of 128")
    p.add_argument("--layers", type=layer_list, default=None,
                   help="comma-separated layer indices (default five spread over the depth: 2,8,14,20,27 of 28)")
    p.add_argument("--yarn-factor", type=float, default=None,
                   help=f"YaRN rope scaling factor (default: {DEFAULT_YARN_FACTOR:g} when --n exceeds the model's "
                        "positions, as vLLM runs such prompts; 0: never)")
    p.add_argument("--seed", type=int, default=0, help="where in the text the prompt starts, and the page order")
    p.add_argument("--lists-only", action="store_true",
                   help="time nothing: per layer only KAP's native and fp8 lists and how they agree (any device)")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                   help="where the model and the ops run (auto, the default: the GPU when torch sees one); "
                        "cpu only with --lists-only, where the ops run as the PyTorch reference")
    p.add_argument("--save-ab-inputs", metavar="FILE",
                   help="with --lists-only: also write each layer's Q/K/V and KAP's lists for dev/kernel_ab.py --inputs")
    p.add_argument("--serving-page-size", type=int, default=None, choices=(16, 32, 64, 256),
                   help="also time the CoSA rows on a cache of this page size (vLLM's default: 16)")
    p.add_argument("--serving-chunk", type=int, default=None,
                   help="also time the CoSA rows as calls of this many queries, a multiple of 128 (vLLM's "
                        "default chunk: 16384)")
    p.add_argument("--plot", action="store_true", help="also save a PNG next to the JSON")
    p.add_argument("--out", default=str(REPO_ROOT / "bench" / "results"), help="folder for the results")
    args = p.parse_args(argv)
    if args.serving_chunk is not None and (args.serving_chunk <= 0 or args.serving_chunk % BLOCK):
        p.error(f"--serving-chunk must be a positive multiple of 128, got {args.serving_chunk}")
    if args.lists_only and (args.serving_page_size or args.serving_chunk):
        p.error("--serving-page-size and --serving-chunk time CoSA rows, which --lists-only leaves out")
    if args.n <= 0 or args.n % BLOCK:
        p.error("--n must be a positive multiple of 128")
    if args.yarn_factor is not None and args.yarn_factor != 0 and not args.yarn_factor > 1:
        p.error(f"--yarn-factor must be greater than 1 (or 0: no YaRN), got {args.yarn_factor:g}")
    if args.save_ab_inputs and not args.lists_only:
        p.error("--save-ab-inputs needs --lists-only")
    if args.device == "cpu" and not args.lists_only:
        p.error("--device cpu needs --lists-only: the timed rows run the CUDA kernels")
    if not Path(args.model).exists():
        p.error(f"--model: {args.model} does not exist")
    if not any(Path(args.haystack).glob("*.txt")):
        p.error(f"--haystack: no .txt files in {args.haystack}")
    return args


def why_no_kernels(cosa_mod) -> str:
    """Why cosa's CUDA kernels cannot run here: not built, or built but no Hopper GPU in sight."""
    if not cosa_mod.cuda_kernels_built():
        return ("the timed rows need cosa built with its CUDA kernels (see the README's Install); torch.ops.cosa "
                f"has none here ({cosa_mod._C_IMPORT_ERROR or 'a CPU-only build'})")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"cosa's CUDA kernels need a Hopper GPU (compute capability 9.0); torch sees {names or 'none'}"


def lists_main(args) -> int:
    """``--lists-only``: capture on ``args.device``, then KAP's lists of every layer at both precisions."""
    import cosa

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not cosa.cuda_kernels_available():
        print(f"bench/layers.py --lists-only on a GPU: {why_no_kernels(cosa)}; use --device cpu for the reference",
              file=sys.stderr)
        return 2
    meta, json_path = start_run(args.out, "layers")
    captured, facts = capture_layers(args.model, args.haystack, args.n, args.layers, args.seed, device,
                                     resolve_yarn_factor(args.yarn_factor, args.n, model_positions(args.model)))
    config = {**facts, "n": args.n, "dtype": "bfloat16", "haystack": Path(args.haystack).name, "seed": args.seed,
              "lists_only": True, "device": device, "cosa_defaults": prefill_defaults(cosa)}
    rows: list[dict] = []
    failures: list[str] = []
    ab_inputs = open(args.save_ab_inputs, "wb") if args.save_ab_inputs else None
    if ab_inputs is not None:
        write_ab_inputs_header(ab_inputs, args.n, facts)
        config["ab_inputs"] = Path(args.save_ab_inputs).name
    default_precision = cosa.reference.resolved_proxy_precision(prefill_defaults(cosa)["proxy_precision"], args.n)

    def layer_lists(layer, q, k, v, scale):
        layer_rows, lists = lists_rows(cosa, layer, q, k, scale)
        rows.extend(layer_rows)
        if ab_inputs is not None:
            write_ab_inputs_layer(ab_inputs, layer, scale if scale is not None else q.shape[-1] ** -0.5, q, k, v,
                                  *lists[default_precision])

    for layer in facts["layers"]:
        progress(f"layer {layer}")
        q, k, v, scale = captured.pop(layer)
        guarded(failures, f"layer {layer} lists", lambda: layer_lists(layer, q, k, v, scale))
        write_json(json_path, {**meta, "config": config, "rows": rows, "failures": failures})
    if ab_inputs is not None:
        ab_inputs.close()
        if failures:  # a layer is missing: the header's count would not hold
            Path(args.save_ab_inputs).unlink()
            progress(f"--save-ab-inputs: {args.save_ab_inputs} removed (a layer failed)")
    if args.plot and any(r["impl"] == "kap-fp8" for r in rows):
        png = json_path.with_suffix(".png")
        shown = plot_agreement(rows, png, f"{facts['model']}, {args.n} tokens, lists on {device}")
        progress(f"plot -> {png}" if shown else "no plot: matplotlib is not installed")
    print(format_table(rows, LISTS_COLUMNS))
    return finish_report(json_path, failures)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.lists_only:
        return lists_main(args)
    require_cuda("bench/layers.py")
    import cosa

    if not cosa.cuda_kernels_available():
        print(f"bench/layers.py: {why_no_kernels(cosa)}", file=sys.stderr)
        return 2
    meta, json_path = start_run(args.out, "layers")
    fa4, why = load_fa4()
    if why is not None:
        progress(f"fa4: rows left out ({why})")
    captured, facts = capture_layers(args.model, args.haystack, args.n, args.layers, args.seed, "cuda",
                                     resolve_yarn_factor(args.yarn_factor, args.n, model_positions(args.model)))
    gc.collect()
    torch.cuda.empty_cache()
    config = {**facts, "n": args.n, "dtype": "bfloat16", "haystack": Path(args.haystack).name, "seed": args.seed,
              "cosa_defaults": prefill_defaults(cosa), "checked_blocks": CHECKED_BLOCKS,
              "serving_page_size": args.serving_page_size, "serving_chunk": args.serving_chunk}
    run = LayerRun(cosa, fa4, args.seed, serving_variants(args.serving_page_size, args.serving_chunk))
    if why is not None:
        run.peers_left_out["fa4"] = why
    default_kap = PRECISION_IMPLS[cosa.reference.resolved_proxy_precision(config["cosa_defaults"]["proxy_precision"],
                                                                          args.n)]
    for layer in facts["layers"]:
        progress(f"layer {layer}")
        run.layer(layer, *captured.pop(layer))
        add_speedups(run.rows)
        add_ideal(run.rows, default_kap)
        write_json(json_path, results(meta, config, run))
    if args.plot and run.rows:
        png = json_path.with_suffix(".png")
        shown = plot(run.rows, png, f"{facts['model']}, {args.n} tokens")
        progress(f"plot -> {png}" if shown else "no plot: matplotlib is not installed")
    print(format_table(run.rows, TABLE_COLUMNS))
    print()
    print(format_table(summarise(run.rows), SUMMARY_COLUMNS))
    return finish_report(json_path, run.failures)


if __name__ == "__main__":
    sys.exit(main())
