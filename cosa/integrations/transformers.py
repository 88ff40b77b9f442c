"""CoSA prefill inside Hugging Face transformers models (Llama, Qwen2 and Qwen3 families).

    import cosa.integrations.transformers as cosa_hf
    with cosa_hf.enable(model, top_p=0.95, delta=2000.0, stride=8, min_prefill_tokens=4096) as handle:
        model.generate(input_ids, max_new_tokens=32)
    print(handle.summary())

:func:`enable` registers an attention function in transformers' ``AttentionInterface`` (and, where
the version has one, the SDPA mask builder for it in ``AttentionMaskInterface``, so that the model
builds the same masks as for ``"sdpa"``) under a name of its own, and switches the model to it. The
function runs CoSA (``cosa.sparse_attention``: KAP then OSK) when all of these hold:

- the call is a prefill of at least ``min_prefill_tokens`` query tokens;
- the attention is plain causal: no mask (the model's own causal mask skipped, as for SDPA), or a
  4-D mask that is exactly bottom-right causal (chunked prefill over a cached prefix), with the
  prefix a multiple of 128 tokens (the ops take any prefix, docs/spec.md section 1, but their
  kernels' path for an unaligned one has not yet run on a GPU: such calls stay dense);
- no sliding window, no dropout, no attention weights requested, bf16/fp16, head dim 64 or 128;
- no gradient is needed (the ops have no backward: training and fine-tuning stay dense).

Every other call (decode steps, short prompts, padded batches, sliding-window layers) goes to
transformers' own SDPA function, exactly as ``attn_implementation="sdpa"`` would run it. Exiting the
context (or :meth:`CosaAttention.restore`) puts the previous implementation back.

transformers >= 4.48 has the attention-function registry (a plain dict before 4.50); the mask
registry (and with it the "no mask for plain causal" fast path) exists from 4.53 on. On older
versions the model hands a materialised 4-D causal mask, which is checked and accepted, at the cost
of building it. The tests run transformers 5.x; tests/test_integration.py also passed by hand on
4.48.3 (Llama and Qwen2; Qwen3 arrived in 4.51).
"""

from __future__ import annotations

import collections
import itertools
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

import cosa
from cosa import reference, validation
from cosa.tuning import Tuning
from cosa.layout import paged_from_contiguous
from cosa.reference import BLOCK

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# Rows of a 4-D mask compared with the causal pattern at once (bounds the temporary's size).
_MASK_CHECK_ELEMENTS = 1 << 26

_names = itertools.count()
# Handles restored while a later handle of the same model was on top: name -> the implementation it
# had replaced, where that later handle's restore() goes instead.
_restored_under: dict[str, str] = {}


def _restored_target(name: str) -> str:
    while name in _restored_under:
        name = _restored_under.pop(name)
    return name

# A block selector replaces KAP: (module, q [Sq, Hq, d], k [Sk, Hkv, d]) -> (order, counts) for OSK,
# one sequence (``counts`` has exactly ceil(Sq/128) rows). Used by bench/accuracy.py and bench/e2e.py.
BlockSelector = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], tuple]


@dataclass(frozen=True)
class Settings(Tuning):
    """The tuning settings (checked when made) and the integration's own."""
    min_prefill_tokens: int = 4096
    collect_stats: bool = False
    block_selector: BlockSelector | None = None


class AttentionOverride:
    """Runs a model's attention through ``fn`` (transformers' attention-function signature:
    ``(module, query [B, Hq, S, d], key [B, Hkv, Skv, d], value, attention_mask, **kwargs) ->
    (out [B, S, Hq, d], weights or None)``) until :meth:`restore` or the end of a ``with`` block.
    The model builds the same masks as for ``"sdpa"``."""

    def __init__(self, model: torch.nn.Module, fn):
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "_attn_implementation"):
            raise TypeError("cosa.integrations.transformers needs a transformers PreTrainedModel")
        self.model = model
        self.name = f"cosa_{next(_names)}"
        self.previous = config._attn_implementation
        _register(self.name, fn)
        try:
            _set_implementation(model, self.name)
        except Exception:
            _unregister(self.name)
            raise
        self.active = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def restore(self) -> None:
        """Put the previous attention implementation back and drop the registrations. Handles of one
        model may be restored in any order: one restored under a later one leaves the model to that
        one, which then restores past it."""
        if not self.active:
            return
        try:
            if self.model.config._attn_implementation == self.name:
                _set_implementation(self.model, _restored_target(self.previous))
            else:
                _restored_under[self.name] = self.previous
        finally:
            _unregister(self.name)
            self.active = False


class CosaAttention(AttentionOverride):
    """The handle :func:`enable` returns: a context manager that restores the model's previous
    attention implementation. It counts the calls that ran CoSA and those that stayed dense, the
    latter per reason (``dense_reasons``), and keeps per-call records in ``calls`` when statistics
    are on."""

    def __init__(self, model: torch.nn.Module, settings: Settings):
        self.settings = settings
        self.calls: list[dict] = []
        self.sparse_calls = 0
        self.dense_calls = 0
        self.dense_reasons: collections.Counter[str] = collections.Counter()
        super().__init__(model, _attention_function(self))

    def reset_stats(self) -> None:
        self.calls.clear()
        self.sparse_calls = self.dense_calls = 0
        self.dense_reasons.clear()

    def summary(self) -> dict:
        """Counts of sparse and dense calls, and ``dense_reasons``: the dense calls per reason,
        ``decode`` (a decode step: one query token), ``short_prompt`` (a prefill shorter than
        ``min_prefill_tokens``), ``sliding_window``, ``dropout`` (training with dropout),
        ``output_attentions`` (attention weights requested), ``grad`` (a gradient is needed),
        ``not_causal``, ``dtype`` (not bf16/fp16), ``head_dim`` (not 64 or 128), ``unsupported_mask`` (a mask other than plain
        causal, e.g. padding) or ``unaligned_prefix`` (a cached prefix that is not a multiple of 128
        tokens). With statistics on, also the mean stage-1 and realised budgets over the sparse
        calls, overall and per layer."""
        out = {"sparse_calls": self.sparse_calls, "dense_calls": self.dense_calls,
               "dense_reasons": dict(self.dense_reasons)}
        sparse = [c for c in self.calls if c["path"] == "cosa"]
        if not sparse or "stage1_budget" not in sparse[0]:
            return out

        def means(calls):
            return {key: sum(c[key] for c in calls) / len(calls) for key in ("stage1_budget", "realised_budget")}

        out.update(means(sparse))
        per_layer: dict = {}
        for c in sparse:
            per_layer.setdefault(c["layer"], []).append(c)
        out["per_layer"] = {layer: means(calls) for layer, calls in per_layer.items()}
        return out


def enable(model: torch.nn.Module, *, top_p: float = Tuning.top_p, delta: float = Tuning.delta,
           stride: int = Tuning.stride, vote: str = Tuning.vote, proxy_precision: str = Tuning.proxy_precision,
           min_prefill_tokens: int = 4096, collect_stats: bool = False,
           block_selector: BlockSelector | None = None) -> CosaAttention:
    """Run the model's long prefills with CoSA (module docstring); returns the handle/context manager.

    ``top_p``, ``stride``: KAP's stage-1 selection; ``delta``: OSK's skip scale (``<= 0``: no
    in-kernel skip); ``vote``: who decides a skip together, each 64-row half of a tile
    (``"warpgroup"``) or the whole tile (``"tile"``); ``proxy_precision``: what KAP's proxy GEMM
    multiplies, q and k as given (``"native"``), e4m3 copies (``"fp8"``) or the fp8 proxy from 8K keys
    on (``"auto"``); ``min_prefill_tokens``: shorter prefills (and every decode step) stay dense;
    ``collect_stats``: record each call's budgets in ``handle.calls`` (reads the lists on the host:
    one synchronisation per layer); ``block_selector``: replace KAP with another selection (the
    benchmarks feed the peers' masks to OSK this way)."""
    op = "integrations.transformers.enable"
    min_prefill_tokens = validation.positive_integer(op, "min_prefill_tokens", min_prefill_tokens)
    # The ops' own domains (Tuning checks them), here rather than at the first long prefill.
    settings = Settings(top_p=top_p, delta=delta, stride=stride, vote=vote, proxy_precision=proxy_precision, op=op,
                        min_prefill_tokens=min_prefill_tokens, collect_stats=collect_stats,
                        block_selector=block_selector)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
        warnings.warn(f"cosa: model type {model_type!r} is not one of the tested families {SUPPORTED_MODEL_TYPES}; "
                      "CoSA runs wherever its attention goes through transformers' AttentionInterface",
                      stacklevel=2)
    return CosaAttention(model, settings)


# ----------------------------------------------------------------------------------------------
# The attention function
# ----------------------------------------------------------------------------------------------


def sdpa_attention():
    """transformers' own SDPA attention function (the dense path)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward


def _attention_function(handle: CosaAttention):
    settings = handle.settings
    dense = sdpa_attention()

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        prefix, reason = _sparse_prefix(module, query, key, value, attention_mask, dropout, settings, kwargs)
        layer = getattr(module, "layer_idx", None)
        if reason is not None:
            handle.dense_calls += 1
            handle.dense_reasons[reason] += 1
            if settings.collect_stats:
                handle.calls.append({"layer": layer, "path": "dense", "reason": reason,
                                     "q_len": query.shape[2], "kv_len": key.shape[2]})
            return dense(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        seqlen_k = query.shape[2] + prefix
        q = query.transpose(1, 2)
        k = key[:, :, :seqlen_k].transpose(1, 2)
        v = value[:, :, :seqlen_k].transpose(1, 2)
        out, stats = _sparse(module, q, k, v, scaling, settings)
        handle.sparse_calls += 1
        if settings.collect_stats:
            handle.calls.append({"layer": layer, "path": "cosa", "q_len": q.shape[1], "kv_len": seqlen_k, **stats})
        return out, None

    return attention


def _sparse_prefix(module, query, key, value, attention_mask, dropout, settings: Settings, kwargs):
    """``(prefix, None)`` when the call can run CoSA over keys ``[0, Sq + prefix)``, else
    ``(None, reason)``."""
    _, _, seqlen_q, head_dim = query.shape
    seqlen_kv = key.shape[2]
    # A decode step's mask is dropped even with a cache (all keys attend), which the no-mask case
    # below would read as keys without a prefix: decode stays dense whatever min_prefill_tokens is.
    if seqlen_q == 1:
        return None, "decode"
    if seqlen_q < settings.min_prefill_tokens:
        return None, "short_prompt"
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return None, "grad"
    if kwargs.get("sliding_window") is not None:
        return None, "sliding_window"
    if dropout and module.training:
        return None, "dropout"
    if kwargs.get("output_attentions"):
        return None, "output_attentions"
    if kwargs.get("is_causal") is False or not getattr(module, "is_causal", True):
        return None, "not_causal"
    if query.dtype not in (torch.bfloat16, torch.float16) or key.dtype != query.dtype:
        return None, "dtype"
    if head_dim not in (64, 128):
        return None, "head_dim"
    if attention_mask is None:
        # transformers drops the mask only when the keys are the queries' own (kv == q) or an empty
        # static cache longer than the prompt (keys past Sq unused): top-left aligned, no prefix.
        return 0, None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        return None, "unsupported_mask"
    prefix = seqlen_kv - seqlen_q
    if prefix < 0 or prefix % BLOCK:
        return None, "unaligned_prefix"
    if not _mask_is_bottom_right_causal(attention_mask, seqlen_q, seqlen_kv):
        return None, "unsupported_mask"
    return prefix, None


# Every layer of one forward gets the same mask tensor: its verdict is kept for that tensor (alive,
# not modified in place since) rather than recomputed by a scan of Sq x Skv elements per layer.
# Tensors made under torch.inference_mode() have no version counter: theirs is kept for the tensor
# alone (transformers builds a new mask for each forward and does not write to it).
_mask_verdict: tuple = (None, -1, 0, 0, False)  # (weakref to the mask, its _version, Sq, Skv, verdict)


def _mask_version(mask: torch.Tensor) -> int | None:
    return None if mask.is_inference() else mask._version


def _mask_is_bottom_right_causal(mask: torch.Tensor, seqlen_q: int, seqlen_kv: int) -> bool:
    global _mask_verdict
    ref, version, cached_q, cached_kv, verdict = _mask_verdict
    if (ref is not None and ref() is mask and version == _mask_version(mask)
            and (cached_q, cached_kv) == (seqlen_q, seqlen_kv)):
        return verdict
    # Older versions size the mask past the keys (one spare column); SDPA reads its first Skv columns.
    verdict = _is_bottom_right_causal(mask[..., :seqlen_kv], seqlen_q, seqlen_kv)
    _mask_verdict = (weakref.ref(mask), _mask_version(mask), seqlen_q, seqlen_kv, verdict)
    return verdict


def _is_bottom_right_causal(mask: torch.Tensor, seqlen_q: int, seqlen_kv: int) -> bool:
    """Whether a 4-D mask (bool: True attends; float: 0 attends) is exactly causal with the queries
    as the last ``seqlen_q`` of ``seqlen_kv`` positions, for every batch row (no padding)."""
    if mask.shape[-2] != seqlen_q or mask.shape[-1] != seqlen_kv:
        return False
    keys = torch.arange(seqlen_kv, device=mask.device)
    rows = max(1, _MASK_CHECK_ELEMENTS // max(1, seqlen_kv * mask.shape[0] * mask.shape[1]))
    for r0 in range(0, seqlen_q, rows):
        r1 = min(seqlen_q, r0 + rows)
        chunk = mask[:, :, r0:r1]
        allowed = chunk if chunk.dtype == torch.bool else chunk == 0
        q_pos = seqlen_kv - seqlen_q + torch.arange(r0, r1, device=mask.device)
        expected = keys[None, :] <= q_pos[:, None]
        if not bool((allowed == expected).all()):
            return False
    return True


def _sparse(module, q, k, v, scaling, settings: Settings):
    """CoSA on ``q [B, Sq, Hq, d]``, ``k, v [B, Sk, Hkv, d]`` (Sk - Sq a multiple of 128, as routed): KAP + OSK,
    or the block selector's lists + OSK. Returns ``([B, Sq, Hq, d], stats)``."""
    if settings.block_selector is None:
        result = cosa.sparse_attention(q, k, v, stride=settings.stride, top_p=settings.top_p,
                                       softmax_scale=scaling, delta=settings.delta, vote=settings.vote,
                                       proxy_precision=settings.proxy_precision,
                                       return_stats=settings.collect_stats)
        if not settings.collect_stats:
            return result, {}
        out, stats = result
        return out, {"stage1_budget": stats["stage1_budget"], "realised_budget": stats["realised_budget"]}
    outs, visited, skipped, causal = [], 0, 0, 0
    for b in range(q.shape[0]):
        layout = paged_from_contiguous(q[b], k[b], v[b])
        order, counts = settings.block_selector(module, q[b], k[b])
        out, _, skip = cosa.osk(layout["q"], layout["k_cache"], layout["v_cache"], layout["page_table"],
                                layout["cu_seqlens_q"], layout["seqused_k"], order, counts, q.shape[1],
                                softmax_scale=scaling, delta=settings.delta, vote=settings.vote)
        outs.append(out)
        if settings.collect_stats:
            nq = reference.cdiv(q.shape[1], BLOCK)
            causal += q.shape[2] * (nq * ((k.shape[1] - q.shape[1]) // BLOCK) + nq * (nq + 1) // 2)
            visited += int(counts.sum())
            skipped += int(skip.sum())
    stats = {}
    if settings.collect_stats:
        # skipped counts 64-row halves of tiles: two make one block
        stats = {"stage1_budget": visited / causal, "realised_budget": (visited - skipped / 2) / causal}
    return torch.stack(outs), stats


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------


def _attention_registry() -> dict:
    """The class-wide mapping of attention functions (a plain dict before transformers 4.50)."""
    try:
        from transformers import AttentionInterface
    except ImportError:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        return ALL_ATTENTION_FUNCTIONS
    return AttentionInterface._global_mapping


def _mask_registry() -> dict | None:
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # transformers < 4.53: the model builds its own 4-D masks
        return None
    return AttentionMaskInterface._global_mapping


def _register(name: str, fn) -> None:
    _attention_registry()[name] = fn
    masks = _mask_registry()
    if masks is not None:
        from transformers.masking_utils import sdpa_mask
        masks[name] = sdpa_mask


def _unregister(name: str) -> None:
    _attention_registry().pop(name, None)
    masks = _mask_registry()
    if masks is not None:
        masks.pop(name, None)


def _set_implementation(model, name: str | None) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # transformers < 4.54 reads the config attribute at every forward
        model.config._attn_implementation = name


__all__ = ["AttentionOverride", "CosaAttention", "enable", "sdpa_attention", "SUPPORTED_MODEL_TYPES"]
