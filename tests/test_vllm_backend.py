"""The vLLM integration: the routing rule and the settings (no vLLM needed), the plugin's
registration (vLLM installed), and the attention call on vLLM's KV-cache layout against the
reference (vLLM installed, Hopper GPU)."""

import dataclasses
import math
import types

import pytest
import torch

from cosa import reference as R
from cosa.integrations import vllm_plugin
from cosa.integrations.vllm_plugin import Settings, route

from helpers import assert_rows_close


def starts(*q_lens):
    return torch.tensor([0, *q_lens]).cumsum(0)


def runs_of(r):
    return [(run.kind, run.first, run.stop, run.token_start, run.token_stop) for run in r.runs]


def test_decodes_and_short_prefills_stay_with_flash_attention():
    r = route(starts(1, 1, 300), torch.tensor([900, 40, 300]), min_prefill_tokens=256)
    assert r.reasons == ("decode", "decode", "cosa")
    assert runs_of(r) == [("flash", 0, 2, 0, 2), ("cosa", 2, 3, 2, 302)]
    r = route(starts(1, 100), torch.tensor([900, 100]), min_prefill_tokens=256)
    assert r.reasons == ("decode", "short_prefill") and not r.uses_cosa
    assert runs_of(r) == [("flash", 0, 2, 0, 101)]


def test_an_unaligned_prefix_leaves_its_first_tokens_to_flash_attention():
    # Prefix 100: FlashAttention runs the 28 tokens up to position 128, CoSA the rest.
    r = route(starts(4096, 4096), torch.tensor([4096 + 128 * 3, 4096 + 100]), min_prefill_tokens=1024)
    assert r.reasons == ("cosa", "cosa")
    assert runs_of(r) == [("cosa", 0, 1, 0, 4096), ("flash", 1, 2, 4096, 4124), ("cosa", 1, 2, 4124, 8192)]
    assert r.runs[1].last_kv_len == 128 and r.runs[1].max_query_len == 28 and r.runs[2].max_query_len == 4068
    assert dict(r.tokens) == {"cosa": 4096 + 4068, "alignment_piece": 28}
    # What is left after the piece must still be long.
    r = route(starts(1100), torch.tensor([1100 + 100]), min_prefill_tokens=1080)
    assert r.reasons == ("unaligned_prefix",) and not r.uses_cosa


def test_long_chunks_anywhere_in_the_batch_run_on_cosa():
    r = route(starts(1, 5000, 200, 5000, 6000), torch.tensor([77, 5000, 200, 5000 + 250, 6000]),
              min_prefill_tokens=4096)
    assert r.reasons == ("decode", "cosa", "short_prefill", "cosa", "cosa")
    # Request 3's prefix is 250: 6 tokens of FlashAttention join the short prefill's run.
    assert runs_of(r) == [("flash", 0, 1, 0, 1), ("cosa", 1, 2, 1, 5001), ("flash", 2, 4, 5001, 5207),
                          ("cosa", 3, 5, 5207, 16201)]
    assert r.runs[2].last_kv_len == 256 and r.runs[2].max_seq_len == 256 and r.runs[3].max_seq_len == 6000


def test_empty_padding_requests_are_left_out():
    qsl = torch.tensor([0, 1, 5001, 5001, 9001, 9001, 9001])  # requests 2, 4 and 5 are empty
    r = route(qsl, torch.tensor([10, 5000, 0, 4000, 0, 0]), min_prefill_tokens=4000)
    assert runs_of(r) == [("flash", 0, 1, 0, 1), ("cosa", 1, 4, 1, 9001)]
    assert r.reasons.count("empty") == 3


def test_unsupported_layers_send_everything_to_flash_attention():
    r = route(starts(8192), torch.tensor([8192]), 4096, layers_supported=False)
    assert r.reasons == ("layer_unsupported",) and not r.uses_cosa


def test_routing_counts_requests_and_tokens_per_reason():
    counts = vllm_plugin.RoutingCounts()
    qsl = starts(1, 300, 0)
    counts.add(route(qsl, torch.tensor([50, 300, 0]), 128))
    counts.add(route(qsl, torch.tensor([50, 300 + 10, 0]), 128))
    snap = counts.snapshot()
    assert snap["requests"] == {"decode": 2, "cosa": 2}
    assert snap["tokens"] == {"decode": 2, "cosa": 300 + 182, "alignment_piece": 118}


def test_settings_from_additional_config():
    assert Settings.from_additional_config({}) == Settings()
    s = Settings.from_additional_config({"cosa": {"top_p": 1, "min_prefill_tokens": 512, "vote": "tile"}})
    assert s.top_p == 1.0 and isinstance(s.top_p, float) and s.min_prefill_tokens == 512 and s.vote == "tile"
    with pytest.raises(ValueError, match="unknown setting.*'topp'"):
        Settings.from_additional_config({"cosa": {"topp": 0.9}})
    with pytest.raises(ValueError, match=r"additional_config\['cosa'\]: .*min_prefill_tokens must be an int, got float"):
        Settings.from_additional_config({"cosa": {"min_prefill_tokens": 4096.0}})
    with pytest.raises(ValueError, match=r"additional_config\['cosa'\]: .*delta must be a real number, got bool True"):
        Settings.from_additional_config({"cosa": {"delta": True}})
    with pytest.raises(ValueError, match=">= 1"):
        Settings.from_additional_config({"cosa": {"min_prefill_tokens": 0}})
    with pytest.raises(ValueError, match="must be a dict"):
        Settings.from_additional_config({"cosa": [1]})
    with pytest.raises(ValueError, match=r"unknown setting\(s\) 'topp', 1;"):  # keys of mixed types
        Settings.from_additional_config({"cosa": {1: 2, "topp": 0.9}})
    # Any mapping holds settings; vLLM's additional_config may also be a platform's object of its own.
    assert Settings.from_additional_config(types.MappingProxyType({"cosa": {"vote": "tile"}})).vote == "tile"
    with pytest.raises(ValueError, match="top_p"):
        Settings.from_additional_config(types.MappingProxyType({"cosa": {"top_p": 2.0}}))
    assert Settings.from_additional_config(object()) == Settings()
    with pytest.raises(ValueError, match="delta"):  # refused by the ops: float32's subnormals
        Settings.from_additional_config({"cosa": {"delta": 1e-40}})
    # Values the ops refuse are refused at engine start, in the ops' own words.
    for bad, name in (({"top_p": 1.5}, "top_p"), ({"stride": 5}, "stride"), ({"vote": "row"}, "vote"),
                      ({"proxy_precision": "int4"}, "proxy_precision")):
        with pytest.raises(ValueError, match=f"additional_config\\['cosa'\\]: .*{name}"):
            Settings.from_additional_config({"cosa": bad})


def test_register_puts_the_backend_in_the_custom_slot():
    pytest.importorskip("vllm")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    vllm_plugin.register()
    backend = AttentionBackendEnum.CUSTOM.get_class()
    assert backend.__name__ == "CosaAttentionBackend" and backend.get_name() == "CUSTOM"


def test_split_batch_builds_each_runs_metadata_from_the_batchs():
    pytest.importorskip("vllm")
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from cosa.integrations.vllm_backend import CosaPart, FlashPart, split_batch

    q_lens, kv_lens = [1, 5000, 200, 5000, 6000], [77, 5000, 200, 5000 + 250, 6000]
    qsl = starts(*q_lens).to(torch.int32)
    table = torch.arange(5 * 4, dtype=torch.int32).reshape(5, 4)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
        num_reqs=5, num_actual_tokens=int(qsl[-1]), max_query_len=6000, max_seq_len=6000, block_table_tensor=table,
        slot_mapping=torch.arange(int(qsl[-1])))
    parts = split_batch(route(qsl, torch.tensor(kv_lens), 4096), common, lambda c: c)
    assert [type(p) for p in parts] == [FlashPart, CosaPart, FlashPart, CosaPart]
    decode, first, middle, last = parts
    assert decode.metadata.query_start_loc.tolist() == [0, 1] and decode.metadata.seq_lens.tolist() == [77]
    assert first.cu_seqlens_q.tolist() == [0, 5000] and first.seqused_k.tolist() == [5000]
    # The short prefill, then the 6 tokens that bring request 3's prefix (250) to 256.
    assert (middle.token_start, middle.token_stop) == (5001, 5207)
    assert middle.metadata.query_start_loc.tolist() == [0, 200, 206]
    assert middle.metadata.query_start_loc_cpu.tolist() == [0, 200, 206]
    assert middle.metadata.seq_lens.tolist() == [200, 256] and middle.metadata.max_seq_len == 256
    assert middle.metadata.block_table_tensor.tolist() == table[2:4].tolist()
    assert middle.metadata.slot_mapping.tolist() == list(range(5001, 5207))
    assert common.seq_lens.tolist() == kv_lens, "the batch's own tensors must stay unchanged"
    assert (last.token_start, last.token_stop) == (5207, 16201)
    assert last.cu_seqlens_q.tolist() == [0, 4994, 10994] and last.seqused_k.tolist() == [5250, 6000]
    assert last.page_table.tolist() == table[3:5].tolist() and (last.max_seqlen_q, last.max_seqlen_k) == (6000, 6000)
    assert common.query_start_loc.tolist() == qsl.tolist()


def vllm_layout(stacked_cache, stacked: bool):
    """A ``[num_blocks, 2, block_size, Hkv, d]`` cache in the layout of vLLM up to 0.25 (``stacked``)
    or in that of 0.26 on: ``[num_blocks, Hkv, block_size, 2 * d]``, K then V in the last dim."""
    if stacked:
        return stacked_cache
    nb, _, bs, hkv, d = stacked_cache.shape
    return stacked_cache.permute(0, 3, 2, 1, 4).reshape(nb, hkv, bs, 2 * d)


@pytest.mark.parametrize("stacked", [True, False])
def test_paged_kv_views_both_cache_layouts_as_cosas_pages(stacked):
    pytest.importorskip("vllm")
    import cosa
    from cosa.integrations.vllm_backend import paged_kv

    gen = torch.Generator().manual_seed(1)
    nb, bs, hkv, d = 12, 16, 2, 64
    k, v = torch.randn((2, nb, bs, hkv, d), generator=gen).to(torch.bfloat16)
    k_view, v_view = paged_kv(vllm_layout(torch.stack([k, v], 1), stacked), d, stacked)
    assert torch.equal(k_view, k) and torch.equal(v_view, v)
    # The ops take the strided views as they are (their argument contract runs on the CPU too).
    q = torch.randn((40, 4, d), generator=gen).to(torch.bfloat16)
    table = torch.randperm(nb, generator=gen)[None, :11].to(torch.int32)  # 168 keys: a prefix of 128
    args = (torch.tensor([0, 40], dtype=torch.int32), torch.tensor([168], dtype=torch.int32), 40, 168)
    got = cosa.prefill(q, k_view, v_view, table, *args, top_p=1.0, delta=0.0)
    assert torch.equal(got, cosa.prefill(q, k.contiguous(), v.contiguous(), table, *args, top_p=1.0, delta=0.0))


def vllm_cache(k, v, seqlens_k, block_size, generator):
    """vLLM's FlashAttention cache (``[num_blocks, 2, block_size, Hkv, d]``, as ``vllm_layout`` puts it
    for the installed vLLM) holding packed ``k, v``
    in shuffled blocks, and its block table (unused entries 0, as vLLM leaves them). Blocks that no
    sequence owns hold NaN (never read); the unused rows of a sequence's last block hold large finite
    values, as stale entries of a reused block would (FlashAttention reads them and masks them)."""
    blocks_per_seq = [math.ceil(n / block_size) for n in seqlens_k]
    num_blocks = sum(blocks_per_seq) + 3
    cache = torch.full((num_blocks, 2, block_size, k.shape[1], k.shape[2]), math.nan, dtype=k.dtype, device=k.device)
    physical = torch.randperm(num_blocks, generator=generator)
    table = torch.zeros((len(seqlens_k), max(blocks_per_seq) + 2), dtype=torch.int32)
    token0, next_block = 0, 0
    for b, (n, nb) in enumerate(zip(seqlens_k, blocks_per_seq)):
        ids = physical[next_block: next_block + nb]
        table[b, :nb] = ids.to(torch.int32)
        cache[ids] = 1e4
        for t0 in range(0, n, block_size):
            t1 = min(n, t0 + block_size)
            cache[ids[t0 // block_size], 0, : t1 - t0] = k[token0 + t0: token0 + t1]
            cache[ids[t0 // block_size], 1, : t1 - t0] = v[token0 + t0: token0 + t1]
        token0 += n
        next_block += nb
    from cosa.integrations.vllm_backend import KV_STACKED

    return vllm_layout(cache, KV_STACKED), table.to(k.device)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", [(8, 2), (12, 2), (6, 1), (3, 1), (16, 4), (4, 1)],
                         ids=["8/2", "12/2", "12/2-tp2", "12/2-tp4", "32/8-tp2", "32/8-tp8"])
@pytest.mark.parametrize("block_size", [16, 128])
def test_forward_on_vllm_cache_layout_matches_reference(ops, block_size, hq, hkv):
    """Decodes and a short prefill through vLLM's FlashAttention, three long chunks through CoSA (one
    over an aligned prefix, one over a prefix of 100 tokens, whose first 28 tokens FlashAttention
    runs), in one call; every output row against the reference. Over the head shapes of one rank
    under tensor parallelism too (vLLM hands a rank Hq / TP query heads and max(1, Hkv / TP) KV heads)."""
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata

    from cosa.integrations.vllm_backend import CosaAttentionImpl, CosaAttentionMetadata, paged_kv, split_batch

    d = 128
    q_lens = [1, 1, 300, 700, 1500, 900]
    kv_lens = [900, 45, 300, 700 + 256, 1500 + 100, 900]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn((sum(q_lens) + 5, hq, d), generator=gen).to(torch.bfloat16).cuda()  # 5 padding rows
    k = torch.randn((sum(kv_lens), hkv, d), generator=gen).to(torch.bfloat16).cuda()
    v = torch.randn((sum(kv_lens), hkv, d), generator=gen).to(torch.bfloat16).cuda()
    kv_cache, table = vllm_cache(k, v, kv_lens, block_size, gen)
    settings = {"min_prefill_tokens": 512, "top_p": 1.0, "delta": 0.0}
    qsl_cpu = starts(*q_lens).to(torch.int32)
    r = route(qsl_cpu, torch.tensor(kv_lens), settings["min_prefill_tokens"])
    assert [run.kind for run in r.runs] == ["flash", "cosa", "flash", "cosa"]

    n = sum(q_lens)
    qsl, seq_lens = qsl_cpu.cuda(), torch.tensor(kv_lens, dtype=torch.int32).cuda()
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl_cpu, seq_lens=seq_lens, num_reqs=len(q_lens),
        num_actual_tokens=n, max_query_len=max(q_lens), max_seq_len=max(kv_lens), block_table_tensor=table,
        slot_mapping=torch.zeros(n, dtype=torch.int64, device="cuda"))

    def build_flash(c):
        given = dict(num_actual_tokens=c.num_actual_tokens, max_query_len=c.max_query_len,
                     query_start_loc=c.query_start_loc, max_seq_len=c.max_seq_len, seq_lens=c.seq_lens,
                     block_table=c.block_table_tensor, slot_mapping=c.slot_mapping, use_cascade=False,
                     common_prefix_len=0, cu_prefix_query_lens=None, prefix_kv_lens=None, suffix_kv_lens=None)
        names = {f.name for f in dataclasses.fields(FlashAttentionMetadata)}  # the cascade fields left in 0.26
        return FlashAttentionMetadata(**{name: value for name, value in given.items() if name in names})

    metadata = CosaAttentionMetadata(None, split_batch(r, common, build_flash))
    with set_current_vllm_config(VllmConfig(additional_config={"cosa": settings})):
        impl = CosaAttentionImpl(num_heads=hq, head_size=d, scale=d ** -0.5, num_kv_heads=hkv, alibi_slopes=None,
                                 sliding_window=None, kv_cache_dtype="auto")
    one = torch.ones((), dtype=torch.float32, device="cuda")
    layer = types.SimpleNamespace(_q_scale=one, _k_scale=one, _v_scale=one)
    output = torch.full_like(q, math.nan)
    impl.forward(layer, q, None, None, kv_cache, metadata, output)
    torch.cuda.synchronize()

    # The reference over the same tokens in cosa's own layout (top_p 1, no skip: dense attention).
    k_cache, v_cache = paged_kv(kv_cache, d)
    expect = R.dense_attention(q[:n].float(), k_cache.float(), v_cache.float(), table, qsl, seq_lens)[0]
    assert_rows_close(output[:n].float(), expect.float(), atol=2e-2)
    assert output[n:].isnan().all(), "padding rows past the batch's tokens must stay untouched"


def test_builder_keeps_flash_attentions_metadata_without_a_long_prefill(monkeypatch):
    """CosaMetadataBuilder.build with FlashAttention's builder stubbed: a decode step is FlashAttention's
    metadata of the whole batch, a step with a long chunk becomes runs, a per-request causal tensor
    sends everything to FlashAttention, and each step is counted once."""
    pytest.importorskip("vllm")
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder

    from cosa.integrations.vllm_backend import CosaMetadataBuilder, CosaPart, FlashPart

    built = []

    def flash_build(self, common_prefix_len, common, fast_build=False):
        built.append(common)
        return types.SimpleNamespace(scheduler_metadata=None, num_actual_tokens=common.num_actual_tokens)

    monkeypatch.setattr(FlashAttentionMetadataBuilder, "build", flash_build)
    builder = object.__new__(CosaMetadataBuilder)
    builder.settings = Settings(min_prefill_tokens=256)
    builder._layers_supported = True

    def common(q_lens, kv_lens, **extra):
        qsl = starts(*q_lens).to(torch.int32)
        kv = torch.tensor(kv_lens, dtype=torch.int32)
        return CommonAttentionMetadata(
            query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=kv.clone(), num_reqs=len(q_lens),
            num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens), max_seq_len=max(kv_lens),
            block_table_tensor=torch.zeros((len(q_lens), 8), dtype=torch.int32),
            slot_mapping=torch.arange(int(qsl[-1])), seq_lens_cpu_upper_bound=kv, **extra)

    vllm_plugin.ROUTING.reset()
    decode = builder.build(0, common([1, 1], [50, 60]))
    assert decode.whole_batch is not None and decode.parts == () and built[-1].num_reqs == 2
    mixed = builder.build(0, common([1, 500], [50, 500 + 10]))
    assert mixed.whole_batch is None and [type(p) for p in mixed.parts] == [FlashPart, CosaPart]
    assert built[-1].query_start_loc_cpu.tolist() == [0, 1, 119]  # the decode, then the alignment piece
    flagged = builder.build(0, common([1, 300], [50, 300], causal=torch.tensor([1, 1], dtype=torch.int32)))
    assert flagged.whole_batch is not None
    assert vllm_plugin.routing_counts()["requests"] == {"decode": 4, "cosa": 1, "layer_unsupported": 1}
    vllm_plugin.ROUTING.reset()
