"""CoSA's vLLM V1 attention backend (selected as ``attention_backend="CUSTOM"`` once
``cosa.integrations.vllm_plugin.register`` has run, which installing cosa arranges).

It extends vLLM's FlashAttention backend and keeps its KV cache (``[num_blocks, 2, block_size,
Hkv, d]``, any block size vLLM allows: CoSA reads pages of 16 to 256 tokens), its cache writes and
its CUDA graphs. The metadata builder moves decodes to the front of the batch, applies
``vllm_plugin.route`` to the batch's host-side lengths, and builds FlashAttention's metadata for
the requests before CoSA's run only; the attention call runs FlashAttention on those tokens and
``torch.ops.cosa.prefill`` on the rest, straight over the paged cache and vLLM's block table.
Batches without a long prefill (every decode step) are FlashAttention's metadata and call
unchanged, so decode CUDA graphs (full graphs of uniform single-token batches) stay as they are;
batches that hold a CoSA chunk run outside full graphs.

Written against vLLM 0.24.0; README, "vLLM", lists what differs in later versions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.config import get_current_vllm_config, get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                                   FlashAttentionMetadata, FlashAttentionMetadataBuilder)

import cosa
from cosa.integrations import vllm_plugin

logger = init_logger(__name__)

SUPPORTED_HEAD_SIZES = (64, 128)
SUPPORTED_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")


@dataclass
class CosaChunk:
    """The requests CoSA runs in one step: tokens ``[token_start, token_stop)`` of the batch."""
    token_start: int
    token_stop: int
    cu_seqlens_q: torch.Tensor  # int32 [n + 1], from 0
    seqused_k: torch.Tensor  # int32 [n]
    page_table: torch.Tensor  # int32 [n, max_blocks], rows of vLLM's block table
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass
class CosaAttentionMetadata:
    """FlashAttention's metadata for the requests it runs (None when CoSA runs all of them), and
    CoSA's chunk (None in steps without a long prefill)."""
    flash: FlashAttentionMetadata | None
    cosa: CosaChunk | None


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


class CosaMetadataBuilder(FlashAttentionMetadataBuilder):
    # Full CUDA graphs only for batches of single-token decodes, which are FlashAttention's alone.
    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    supports_update_block_table = False

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Decodes first, so that the long prefills CoSA takes end the batch.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=False)
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
        if isinstance(common.causal, torch.Tensor) or not common.causal or common.mm_req_doc_ranges:
            r = vllm_plugin.route(starts, seq_lens, self.settings.min_prefill_tokens, layers_supported=False)
        else:
            r = vllm_plugin.route(starts, seq_lens, self.settings.min_prefill_tokens, self._layers_are_supported())
        vllm_plugin.ROUTING.add(r, starts)
        if r.first == r.stop:
            return CosaAttentionMetadata(super().build(common_prefix_len, common, fast_build), None)

        q_lens = starts[1:] - starts[:-1]
        flash = None
        if r.first > 0:
            head = common.unpadded(r.token_start, r.first).replace(
                max_query_len=int(q_lens[: r.first].max()), max_seq_len=int(seq_lens[: r.first].max()),
                seq_lens_cpu_upper_bound=seq_lens[: r.first])
            flash = super().build(0, head, fast_build)
        tail = slice(r.first, r.stop)
        loc = common.query_start_loc[r.first: r.stop + 1]
        chunk = CosaChunk(
            token_start=r.token_start, token_stop=r.token_stop, cu_seqlens_q=loc - loc[:1],
            seqused_k=common.seq_lens[tail], page_table=common.block_table_tensor[tail],
            max_seqlen_q=int(q_lens[tail].max()), max_seqlen_k=int(seq_lens[tail].max()))
        return CosaAttentionMetadata(flash, chunk)

    def use_cascade_attention(self, *args, **kwargs) -> bool:
        return False


class CosaAttentionImpl(FlashAttentionImpl):

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not cosa.cuda_kernels_available():
            raise RuntimeError("the CoSA vLLM backend needs cosa's CUDA kernels, which this install lacks "
                               f"({cosa._C_IMPORT_ERROR or 'built without them'}); reinstall cosa with "
                               "TORCH_CUDA_ARCH_LIST=9.0 on a machine with nvcc")
        self.settings = vllm_plugin.Settings.from_additional_config(get_current_vllm_config().additional_config)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if attn_metadata is None:  # vLLM's profiling run
            return super().forward(layer, query, key, value, kv_cache, None, output, output_scale,
                                   output_block_scale)
        if attn_metadata.flash is not None:
            super().forward(layer, query, key, value, kv_cache, attn_metadata.flash, output, output_scale,
                            output_block_scale)
        chunk = attn_metadata.cosa
        if chunk is None:
            return output
        s = self.settings
        k_cache, v_cache = kv_cache.unbind(1)
        rows = slice(chunk.token_start, chunk.token_stop)
        # vLLM's metadata is right by construction: no content checks, so no host synchronisation.
        with cosa.set_device_checks(False):
            out = torch.ops.cosa.prefill(
                query[rows], k_cache, v_cache, chunk.page_table, chunk.cu_seqlens_q, chunk.seqused_k,
                chunk.max_seqlen_q, chunk.max_seqlen_k, stride=s.stride, top_p=s.top_p, softmax_scale=self.scale,
                delta=s.delta, vote=s.vote, proxy_precision=s.proxy_precision)[0]
        output[rows].copy_(out)
        return output


class CosaAttentionBackend(FlashAttentionBackend):

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[CosaAttentionImpl]:
        return CosaAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[CosaMetadataBuilder]:
        return CosaMetadataBuilder
