"""CoSA prefill inside vLLM (V1 engine): the plugin entry point, the settings and the routing rule.

Installing cosa registers :func:`register` under vLLM's ``vllm.general_plugins`` entry point, which
puts CoSA's attention backend (``cosa.integrations.vllm_backend``) in vLLM's ``CUSTOM`` backend slot.
It is used only where it is asked for::

    from vllm import LLM
    llm = LLM(model=path, attention_backend="CUSTOM",
              additional_config={"cosa": {"min_prefill_tokens": 4096, "top_p": 0.95}})

The backend runs CoSA (``torch.ops.cosa.prefill``: KAP then OSK, over vLLM's paged KV cache and
block table) for long prefill chunks and vLLM's FlashAttention for everything else. :func:`route` is
the rule, kept free of vLLM so that it is tested without it. Each request of each step gets one
reason:

- ``cosa``: a prefill chunk of at least ``min_prefill_tokens`` queries. Where the chunk's prefix (the
  tokens already in the cache) is not a multiple of 128 (vLLM cuts chunked prefills at any token
  count), FlashAttention runs the chunk's first ``(-prefix) % 128`` tokens (counted as
  ``alignment_piece`` tokens) and CoSA the rest: the ops take any prefix (docs/spec.md section 1),
  but their kernels' path for an unaligned one has not yet run on a GPU, so serving keeps the
  measured one;
- ``decode``: one query token;
- ``short_prefill``: fewer than ``min_prefill_tokens`` queries, or fewer once the alignment piece is
  taken off (``unaligned_prefix``);
- ``layer_unsupported``: the KV-cache group has a layer CoSA cannot run (sliding window, ALiBi, soft
  cap, attention sinks, a quantised KV cache, a head size other than 64 or 128, or an encoder), or
  the batch has a per-request causal flag or bidirectional multimodal ranges.

Consecutive pieces of the same kind form one call: the batch becomes a short sequence of runs, each
one FlashAttention call or one CoSA call over its tokens.
"""

from __future__ import annotations

import collections.abc
import threading
from dataclasses import dataclass, fields

import torch

from cosa import validation
from cosa.reference import BLOCK
from cosa.tuning import Tuning

REASONS = ("cosa", "decode", "short_prefill", "unaligned_prefix", "layer_unsupported")
BACKEND_CLASS = "cosa.integrations.vllm_backend.CosaAttentionBackend"


@dataclass(frozen=True)
class Settings(Tuning):
    """``additional_config={"cosa": {...}}`` of the vLLM engine: the tuning settings (checked when
    made, in the ops' own words) and the routing threshold; the defaults are cosa's own."""
    min_prefill_tokens: int = 4096

    def __post_init__(self, op: str) -> None:
        super().__post_init__(op)
        object.__setattr__(self, "min_prefill_tokens", validation.positive_integer(op, "min_prefill_tokens",
                                                                                   self.min_prefill_tokens))

    @classmethod
    def from_additional_config(cls, additional_config) -> "Settings":
        """Read and check ``additional_config["cosa"]`` (absent: the defaults), at engine start rather
        than at the first long prompt; a ValueError names any unknown key or a value that is refused."""
        # vLLM also takes an object of a platform's own there; only a mapping can hold CoSA's settings.
        mapping = isinstance(additional_config, collections.abc.Mapping)
        given = additional_config.get("cosa", {}) if mapping else {}
        if not isinstance(given, collections.abc.Mapping):
            raise ValueError(f"additional_config['cosa'] must be a dict of CoSA settings, got {type(given).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(map(repr, set(given) - set(known)))  # repr: keys need not be strings
        if unknown:
            raise ValueError(f"additional_config['cosa']: unknown setting(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        try:
            return cls(**given, op="integrations.vllm")
        except (TypeError, ValueError) as error:
            raise ValueError(f"additional_config['cosa']: {error}") from None


@dataclass(frozen=True)
class Run:
    """Tokens ``[token_start, token_stop)`` of the batch, one call of ``kind`` ("flash" or "cosa"):
    the parts of requests ``[first, stop)``. A CoSA run may start after its first request's first
    tokens (the alignment piece); a FlashAttention run may end with an alignment piece, whose KV
    length is ``last_kv_len`` (else None). ``max_query_len`` and ``max_seq_len`` are over its parts."""
    kind: str
    first: int
    stop: int
    token_start: int
    token_stop: int
    max_query_len: int
    max_seq_len: int
    last_kv_len: int | None = None


@dataclass(frozen=True)
class Route:
    """The batch's runs in token order, each request's reason, and the tokens of each label
    (the reasons, plus ``alignment_piece``)."""
    runs: tuple[Run, ...]
    reasons: tuple[str, ...]
    tokens: tuple[tuple[str, int], ...]

    @property
    def uses_cosa(self) -> bool:
        return any(run.kind == "cosa" for run in self.runs)


def route(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, min_prefill_tokens: int,
          layers_supported: bool = True) -> Route:
    """The routing rule on the batch's host-side lengths: ``query_start_loc`` ``[R + 1]`` and
    ``seq_lens`` ``[R]`` (the KV length of each request, its new tokens included)."""
    starts = [int(x) for x in query_start_loc.tolist()]
    kv_lens = [int(x) for x in seq_lens.tolist()]
    parts = []  # (kind, request, token_start, token_stop, kv_len, label) in token order
    reasons = []
    for r, kv_len in enumerate(kv_lens):
        q0, q1 = starts[r], starts[r + 1]
        q_len = q1 - q0
        piece = (q_len - kv_len) % BLOCK  # tokens up to the next multiple of 128 of the prefix
        if q_len <= 1:
            reason = "decode" if q_len else "empty"
        elif q_len < min_prefill_tokens:
            reason = "short_prefill"
        elif not layers_supported:
            reason = "layer_unsupported"
        elif q_len - piece < min_prefill_tokens:
            reason = "unaligned_prefix"
        else:
            reason = "cosa"
        reasons.append(reason)
        if reason == "empty":
            continue
        if reason != "cosa":
            parts.append(("flash", r, q0, q1, kv_len, reason))
            continue
        if piece:
            parts.append(("flash", r, q0, q0 + piece, kv_len - q_len + piece, "alignment_piece"))
        parts.append(("cosa", r, q0 + piece, q1, kv_len, "cosa"))

    runs, tokens = [], collections.Counter()
    i = 0
    while i < len(parts):
        j = i
        while j + 1 < len(parts) and parts[j + 1][0] == parts[i][0]:
            j += 1
        group = parts[i:j + 1]
        kind, first, token_start = group[0][0], group[0][1], group[0][2]
        last = group[-1]
        partial_end = kind == "flash" and last[3] < starts[last[1] + 1]
        runs.append(Run(kind, first, last[1] + 1, token_start, last[3],
                        max(p[3] - p[2] for p in group), max(p[4] for p in group),
                        last[4] if partial_end else None))
        for p in group:
            tokens[p[5]] += p[3] - p[2]
        i = j + 1
    return Route(tuple(runs), tuple(reasons), tuple(sorted(tokens.items())))


class RoutingCounts:
    """Requests and query tokens per reason, summed over the steps of this process: one count per
    request, step and metadata build (not per layer), so once per KV-cache group where a model has
    several (docs/vllm.md)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = collections.Counter()
        self.tokens = collections.Counter()

    def add(self, r: Route) -> None:
        with self._lock:
            self.requests.update(reason for reason in r.reasons if reason != "empty")
            self.tokens.update(dict(r.tokens))

    def snapshot(self) -> dict:
        with self._lock:
            return {"requests": dict(self.requests), "tokens": dict(self.tokens)}

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.tokens.clear()


ROUTING = RoutingCounts()


def routing_counts() -> dict:
    """``{"requests": {reason: n}, "tokens": {reason: n}}`` of the attention layers that run in this
    process: the engine's, with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and one GPU; otherwise the worker
    processes hold them, one per tensor-parallel rank (``LLM.collective_rpc`` reads each, as
    bench/vllm_e2e.py does)."""
    return ROUTING.snapshot()


def register() -> None:
    """vLLM plugin entry point: CoSA's backend in the ``CUSTOM`` slot. Safe to call more than once,
    and cheap: the backend module (and cosa's extension) load only when vLLM selects it."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_CLASS)
