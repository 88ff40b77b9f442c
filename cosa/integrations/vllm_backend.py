"""CoSA's vLLM V1 attention backend (selected as ``attention_backend="CUSTOM"`` once
``cosa.integrations.vllm_plugin.register`` has run, which installing cosa arranges).

It extends vLLM's FlashAttention backend and keeps its KV cache (any block size vLLM allows: CoSA
reads pages of 16 to 256 tokens), its cache writes and its CUDA graphs. The metadata builder cuts the
batch into runs by ``vllm_plugin.route`` (on the batch's host-side lengths); the attention call makes
one FlashAttention call per FlashAttention run and one ``torch.ops.cosa.prefill`` per CoSA run,
straight over the paged cache and vLLM's block table. A batch without a long prefill (every decode
step) keeps FlashAttention's own metadata and call, so decode CUDA graphs (full graphs of uniform
single-token batches) stay as they are; batches that hold a CoSA run execute outside full graphs.

Tested with vLLM 0.24.0; docs/vllm.md says what differs in later versions and what this module does
about it (the KV-cache layout of 0.26 on, draft-metadata updates, R-SWA batches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from vllm.config import get_current_vllm_config, get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                                   FlashAttentionMetadata, FlashAttentionMetadataBuilder)

import cosa
from cosa.integrations import vllm_plugin

logger = init_logger(__name__)

SUPPORTED_HEAD_SIZES = (64, 128)
# vLLM up to 0.25 stacks K and V: [num_blocks, 2, block_size, Hkv, d] (the backend declares that shape);
# from 0.26 each layer's cache is a [num_blocks, Hkv, block_size, 2 * d] view, K then V in the last dim.
KV_STACKED = hasattr(FlashAttentionBackend, "get_kv_cache_shape")
SUPPORTED_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")


@dataclass
class FlashPart:
    """Tokens ``[token_start, token_stop)`` of the batch, run by FlashAttention with ``metadata``."""
    token_start: int
    token_stop: int
    metadata: FlashAttentionMetadata


@dataclass
class CosaPart:
    """Tokens ``[token_start, token_stop)`` of the batch, run by CoSA: sequences packed back to back."""
    token_start: int
    token_stop: int
    cu_seqlens_q: torch.Tensor  # int32 [n + 1], from 0
    seqused_k: torch.Tensor  # int32 [n]
    page_table: torch.Tensor  # int32 [n, max_blocks], rows of vLLM's block table
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass
class CosaAttentionMetadata:
    """``whole_batch``: FlashAttention's metadata of the whole batch, in steps without a CoSA run;
    otherwise ``parts``, the batch's runs in token order."""
    whole_batch: FlashAttentionMetadata | None
    parts: tuple[FlashPart | CosaPart, ...] = ()


def paged_kv(kv_cache: torch.Tensor, head_size: int, stacked: bool = KV_STACKED) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer's vLLM cache as cosa's ``[num_pages, page_size, Hkv, d]`` views (no copy).
    A size-1 dim (one KV head per rank under tensor parallelism) may carry any stride; cosa's
    argument contract, like TMA, wants 16-byte multiples, so such strides are made canonical, as
    FlashAttention's forward does."""
    k, v = kv_cache.unbind(1) if stacked else kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return canonicalize_singleton_dim_strides(k), canonicalize_singleton_dim_strides(v)


def layer_unsupported_reason(impl: FlashAttentionImpl) -> str | None:
    """Why CoSA cannot run this attention layer (None: it can)."""
    if impl.attn_type != AttentionType.DECODER:
        return f"attention type {impl.attn_type}"
    if impl.head_size not in SUPPORTED_HEAD_SIZES:
        return f"head size {impl.head_size}"
    if impl.kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        return f"KV cache dtype {impl.kv_cache_dtype}"
    if impl.alibi_slopes is not None:
        return "ALiBi"
    if tuple(impl.sliding_window) != (-1, -1):
        return "sliding window"
    if impl.logits_soft_cap:
        return "logit soft cap"
    if impl.sinks is not None:
        return "attention sinks"
    return None


def split_batch(r: vllm_plugin.Route, common: CommonAttentionMetadata,
                build_flash: Callable[[CommonAttentionMetadata], FlashAttentionMetadata]) -> tuple:
    """The batch's runs as parts: a CosaPart per CoSA run, and a FlashPart per FlashAttention run
    whose metadata ``build_flash`` makes from the run's own CommonAttentionMetadata. Device tensors
    come from slices of the batch's, and small kernels, never from host copies."""
    parts = []
    starts = common.query_start_loc_cpu
    for run in r.runs:
        reqs = slice(run.first, run.stop)
        # Offsets of the run's requests in its own tokens; a CoSA run's first request may start
        # after its alignment piece (clamped to 0), a FlashAttention run's last may end early.
        loc = common.query_start_loc[run.first: run.stop + 1] - run.token_start
        if run.kind == "cosa":
            parts.append(CosaPart(run.token_start, run.token_stop, loc.clamp_(min=0), common.seq_lens[reqs],
                                  common.block_table_tensor[reqs], run.max_query_len, run.max_seq_len))
            continue
        kv = common.seq_lens[reqs]
        loc_cpu = starts[run.first: run.stop + 1] - run.token_start
        if run.last_kv_len is not None:
            loc[-1:].fill_(run.token_stop - run.token_start)
            loc_cpu[-1] = run.token_stop - run.token_start
            kv = kv.clone()
            kv[-1:].fill_(run.last_kv_len)
        run_common = CommonAttentionMetadata(
            query_start_loc=loc, query_start_loc_cpu=loc_cpu, seq_lens=kv, num_reqs=run.stop - run.first,
            num_actual_tokens=run.token_stop - run.token_start, max_query_len=run.max_query_len,
            max_seq_len=run.max_seq_len, block_table_tensor=common.block_table_tensor[reqs],
            slot_mapping=common.slot_mapping[run.token_start: run.token_stop])
        parts.append(FlashPart(run.token_start, run.token_stop, build_flash(run_common)))
    return tuple(parts)


class CosaMetadataBuilder(FlashAttentionMetadataBuilder):
    # Full CUDA graphs only for batches of single-token decodes, which are FlashAttention's alone.
    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    supports_update_block_table = False

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Decodes first: together they make one FlashAttention run, not one between every two prefills.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=False)
        # vLLM 0.28 on updates draft-decode metadata in place, FlashAttention's form only.
        self.supports_draft_decode_metadata_update = False
        self.settings = vllm_plugin.Settings.from_additional_config(vllm_config.additional_config)
        self._layers_supported: bool | None = None

    def _layers_are_supported(self) -> bool:
        # The layers exist only after the model is built, later than this builder.
        if self._layers_supported is None:
            layers = get_layers_from_vllm_config(self.vllm_config, Attention, self.layer_names)
            why = {name: layer_unsupported_reason(layer.impl) for name, layer in layers.items()}
            why = {name: reason for name, reason in why.items() if reason is not None}
            if self.vllm_config.parallel_config.decode_context_parallel_size > 1:
                why["all"] = "decode context parallelism"
            if why:
                logger.warning("CoSA: every request of these layers goes to FlashAttention: %s", why)
            self._layers_supported = not why
        return self._layers_supported

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> CosaAttentionMetadata:
        common = common_attn_metadata
        num_reqs = common.num_reqs
        starts = common.query_start_loc_cpu[: num_reqs + 1]
        # Host copies of the KV lengths: exact for prefill rows, the only ones routed to CoSA.
        seq_lens = common.seq_lens_cpu_upper_bound
        if seq_lens is None:
            seq_lens = common.seq_lens.cpu()
        seq_lens = seq_lens[:num_reqs]
        # Per-request causal flags, bidirectional multimodal ranges and (vLLM 0.25 on) R-SWA prefixes
        # change the mask: FlashAttention runs such batches.
        plain_causal = (not isinstance(common.causal, torch.Tensor) and common.causal and not common.mm_req_doc_ranges
                        and getattr(common, "rswa_prefix_lens", None) is None)
        r = vllm_plugin.route(starts, seq_lens, self.settings.min_prefill_tokens,
                              layers_supported=plain_causal and self._layers_are_supported())
        vllm_plugin.ROUTING.add(r)
        if not r.uses_cosa:
            return CosaAttentionMetadata(super().build(common_prefix_len, common, fast_build))
        parts = split_batch(r, common, lambda run_common: self._build_flash_run(run_common, fast_build))
        return CosaAttentionMetadata(None, parts)

    def _build_flash_run(self, run_common: CommonAttentionMetadata, fast_build: bool) -> FlashAttentionMetadata:
        metadata = super().build(0, run_common, fast_build)
        if metadata.scheduler_metadata is not None:
            # With full CUDA graphs on, FlashAttention's builder returns a view of one persistent
            # buffer, which the next run's build would overwrite.
            metadata.scheduler_metadata = metadata.scheduler_metadata.clone()
        return metadata

    def use_cascade_attention(self, *args, **kwargs) -> bool:
        return False


class CosaAttentionImpl(FlashAttentionImpl):

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not cosa.cuda_kernels_built():
            raise RuntimeError("the CoSA vLLM backend needs cosa's CUDA kernels, which this install lacks "
                               f"({cosa._C_IMPORT_ERROR or 'built without them'}); reinstall cosa with "
                               "TORCH_CUDA_ARCH_LIST=9.0 on a machine with nvcc")
        if not cosa.cuda_kernels_available():
            raise RuntimeError("the CoSA vLLM backend needs a Hopper GPU (compute capability 9.0): cosa's "
                               "kernels are built for sm_90a")
        self.settings = vllm_plugin.Settings.from_additional_config(get_current_vllm_config().additional_config)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if attn_metadata is None or attn_metadata.whole_batch is not None:
            # vLLM's profiling run (None), or a step without a CoSA run: FlashAttention as it is.
            return super().forward(layer, query, key, value, kv_cache, attn_metadata and attn_metadata.whole_batch,
                                   output, output_scale, output_block_scale)
        k_cache, v_cache = paged_kv(kv_cache, self.head_size)
        s = self.settings
        for part in attn_metadata.parts:
            rows = slice(part.token_start, part.token_stop)
            if isinstance(part, FlashPart):
                super().forward(layer, query[rows], key, value, kv_cache, part.metadata, output[rows],
                                output_scale, output_block_scale)
                continue
            # vLLM's metadata is right by construction: no content checks, so no host synchronisation.
            with cosa.set_device_checks(False):
                out = torch.ops.cosa.prefill(
                    query[rows], k_cache, v_cache, part.page_table, part.cu_seqlens_q, part.seqused_k,
                    part.max_seqlen_q, part.max_seqlen_k, stride=s.stride, top_p=s.top_p, softmax_scale=self.scale,
                    delta=s.delta, vote=s.vote, proxy_precision=s.proxy_precision)[0]
            output[rows].copy_(out)
        return output


class CosaAttentionBackend(FlashAttentionBackend):

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # The routing reads the host-side query lengths, which must be exact (vLLM 0.33's adaptive
        # verification asks backends whether they may not be).
        return False

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[CosaAttentionImpl]:
        return CosaAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[CosaMetadataBuilder]:
        return CosaMetadataBuilder
