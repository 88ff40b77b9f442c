"""CoSA prefill inside vLLM (V1 engine): the plugin entry point, the settings and the routing rule.

Installing cosa registers :func:`register` under vLLM's ``vllm.general_plugins`` entry point, which
puts CoSA's attention backend (``cosa.integrations.vllm_backend``) in vLLM's ``CUSTOM`` backend slot.
It is used only where it is asked for::

    from vllm import LLM
    llm = LLM(model=path, attention_backend="CUSTOM",
              additional_config={"cosa": {"min_prefill_tokens": 4096, "top_p": 0.95}})

The backend runs vLLM's FlashAttention for every request that CoSA does not take, and CoSA
(``torch.ops.cosa.prefill``: KAP then OSK, over vLLM's paged KV cache and block table) for the
long prefill chunks at the end of each batch. :func:`route` is the rule, kept free of vLLM so that
it is tested without it. Each request of each step gets one reason:

- ``cosa``: a prefill chunk of at least ``min_prefill_tokens`` queries whose prefix (the tokens
  already in the cache) is a multiple of 128 (docs/spec.md section 1);
- ``decode``: one query token;
- ``short_prefill``: fewer than ``min_prefill_tokens`` queries;
- ``unaligned_prefix``: a long chunk whose prefix is not a multiple of 128 (chunked prefill cut at
  a token count that is not one, or a prefix-cache hit of a partial block);
- ``before_fallback``: a long chunk that sits before a request of the batch that FlashAttention
  runs (CoSA takes the batch's last requests, one contiguous run of tokens; the batch puts decodes
  first);
- ``layer_unsupported``: the KV-cache group has a layer CoSA cannot run (sliding window, ALiBi, soft
  cap, attention sinks, a quantised KV cache, a head size other than 64 or 128, or an encoder).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, fields

import torch

from cosa import defaults
from cosa.reference import BLOCK

REASONS = ("cosa", "decode", "short_prefill", "unaligned_prefix", "before_fallback", "layer_unsupported")
BACKEND_CLASS = "cosa.integrations.vllm_backend.CosaAttentionBackend"


@dataclass(frozen=True)
class Settings:
    """``additional_config={"cosa": {...}}`` of the vLLM engine; the defaults are cosa's own."""
    min_prefill_tokens: int = 4096
    stride: int = defaults.STRIDE
    top_p: float = defaults.TOP_P
    delta: float = defaults.DELTA
    vote: str = defaults.VOTE
    proxy_precision: str = defaults.PROXY_PRECISION

    @classmethod
    def from_additional_config(cls, additional_config) -> "Settings":
        """Read and check ``additional_config["cosa"]`` (absent: the defaults); a ValueError names
        any unknown key or a value of the wrong type."""
        given = (additional_config or {}).get("cosa", {}) if isinstance(additional_config, dict) else {}
        if not isinstance(given, dict):
            raise ValueError(f"additional_config['cosa'] must be a dict of CoSA settings, got {type(given).__name__}")
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(f"additional_config['cosa']: unknown setting(s) {unknown}; known: {sorted(known)}")
        kinds = {"int": int, "float": (int, float), "str": str}
        for name, value in given.items():
            kind = kinds[known[name]]
            if isinstance(value, bool) or not isinstance(value, kind):
                raise ValueError(f"additional_config['cosa']['{name}'] must be {known[name]}, got {value!r}")
        settings = cls(**{name: (float(v) if known[name] == "float" else v) for name, v in given.items()})
        if settings.min_prefill_tokens < 1:
            raise ValueError(f"additional_config['cosa']['min_prefill_tokens'] must be >= 1, "
                             f"got {settings.min_prefill_tokens}")
        return settings


@dataclass(frozen=True)
class Route:
    """Which requests of a batch CoSA runs: ``[first, stop)`` (``first == stop``: none), whose tokens
    are ``[token_start, token_stop)``; ``reasons[r]`` is request r's reason (REASONS)."""
    first: int
    stop: int
    token_start: int
    token_stop: int
    reasons: tuple[str, ...]


def route(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, min_prefill_tokens: int,
          layers_supported: bool = True) -> Route:
    """The routing rule on the batch's host-side lengths: ``query_start_loc`` ``[R + 1]`` and
    ``seq_lens`` ``[R]`` (the KV length of each request, its new tokens included)."""
    starts = [int(x) for x in query_start_loc.tolist()]
    kv_lens = [int(x) for x in seq_lens.tolist()]
    num_reqs = len(kv_lens)
    reasons = []
    for r in range(num_reqs):
        q_len = starts[r + 1] - starts[r]
        if q_len <= 1:
            reasons.append("decode")
        elif q_len < min_prefill_tokens:
            reasons.append("short_prefill")
        elif not layers_supported:
            reasons.append("layer_unsupported")
        elif (kv_lens[r] - q_len) % BLOCK != 0:
            reasons.append("unaligned_prefix")
        else:
            reasons.append("cosa")
    # CoSA takes the last run of long chunks; empty requests (padding) neither join nor break it.
    stop = num_reqs
    while stop > 0 and starts[stop] == starts[stop - 1]:
        stop -= 1
    first = stop
    while first > 0 and (reasons[first - 1] == "cosa" or starts[first] == starts[first - 1]):
        first -= 1
    while first < stop and starts[first + 1] == starts[first]:
        first += 1
    for r in range(first):
        if reasons[r] == "cosa":
            reasons[r] = "before_fallback"
    return Route(first, stop, starts[first], starts[stop], tuple(reasons))


class RoutingCounts:
    """Requests and query tokens per reason, summed over the steps of this process (one count per
    request and step, not per layer)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = collections.Counter()
        self.tokens = collections.Counter()

    def add(self, r: Route, query_start_loc: torch.Tensor) -> None:
        starts = query_start_loc.tolist()
        with self._lock:
            for i, reason in enumerate(r.reasons):
                if starts[i + 1] > starts[i]:
                    self.requests[reason] += 1
                    self.tokens[reason] += int(starts[i + 1] - starts[i])

    def snapshot(self) -> dict:
        with self._lock:
            return {"requests": dict(self.requests), "tokens": dict(self.tokens)}

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.tokens.clear()


ROUTING = RoutingCounts()


def routing_counts() -> dict:
    """``{"requests": {reason: n}, "tokens": {reason: n}}`` for the engine running in this process
    (with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; otherwise the engine's own process holds them)."""
    return ROUTING.snapshot()


def register() -> None:
    """vLLM plugin entry point: CoSA's backend in the ``CUSTOM`` slot. Safe to call more than once,
    and cheap: the backend module (and cosa's extension) load only when vLLM selects it."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_CLASS)
