"""The vLLM integration: the routing rule and the settings (no vLLM needed), the plugin's
registration (vLLM installed), and the attention call on vLLM's KV-cache layout against the
reference (vLLM installed, Hopper GPU)."""

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


def test_decodes_and_short_prefills_stay_with_flash_attention():
    r = route(starts(1, 1, 300), torch.tensor([900, 40, 300]), min_prefill_tokens=256)
    assert r.reasons == ("decode", "decode", "cosa") and (r.first, r.stop) == (2, 3)
    assert (r.token_start, r.token_stop) == (2, 302)
    r = route(starts(1, 100), torch.tensor([900, 100]), min_prefill_tokens=256)
    assert r.reasons == ("decode", "short_prefill") and r.first == r.stop


def test_prefix_must_be_a_multiple_of_128():
    r = route(starts(4096, 4096), torch.tensor([4096 + 128 * 3, 4096 + 100]), min_prefill_tokens=1024)
    assert r.reasons == ("before_fallback", "unaligned_prefix") and r.first == r.stop == 2


def test_cosa_takes_the_last_run_of_long_chunks():
    r = route(starts(1, 5000, 200, 5000, 6000), torch.tensor([77, 5000, 200, 5000 + 256, 6000]),
              min_prefill_tokens=4096)
    assert r.reasons == ("decode", "before_fallback", "short_prefill", "cosa", "cosa")
    assert (r.first, r.stop, r.token_start, r.token_stop) == (3, 5, 5201, 16201)


def test_empty_padding_requests_neither_join_nor_break_the_run():
    qsl = torch.tensor([0, 1, 5001, 5001, 9001, 9001, 9001])  # requests 2, 4 and 5 are empty
    r = route(qsl, torch.tensor([10, 5000, 0, 4000, 0, 0]), min_prefill_tokens=4000)
    assert (r.first, r.stop) == (1, 4) and (r.token_start, r.token_stop) == (1, 9001)


def test_unsupported_layers_send_everything_to_flash_attention():
    r = route(starts(8192), torch.tensor([8192]), 4096, layers_supported=False)
    assert r.reasons == ("layer_unsupported",) and r.first == r.stop


def test_routing_counts_requests_and_tokens_per_reason():
    counts = vllm_plugin.RoutingCounts()
    qsl = starts(1, 300, 0)
    counts.add(route(qsl, torch.tensor([50, 300, 0]), 256), qsl)
    counts.add(route(qsl, torch.tensor([50, 300, 0]), 512), qsl)
    snap = counts.snapshot()
    assert snap["requests"] == {"decode": 2, "cosa": 1, "short_prefill": 1}
    assert snap["tokens"] == {"decode": 2, "cosa": 300, "short_prefill": 300}


def test_settings_from_additional_config():
    assert Settings.from_additional_config({}) == Settings()
    s = Settings.from_additional_config({"cosa": {"top_p": 1, "min_prefill_tokens": 512, "vote": "tile"}})
    assert s.top_p == 1.0 and isinstance(s.top_p, float) and s.min_prefill_tokens == 512 and s.vote == "tile"
    with pytest.raises(ValueError, match="unknown setting.*'topp'"):
        Settings.from_additional_config({"cosa": {"topp": 0.9}})
    with pytest.raises(ValueError, match="'min_prefill_tokens'.*int"):
        Settings.from_additional_config({"cosa": {"min_prefill_tokens": 4096.0}})
    with pytest.raises(ValueError, match="'delta'.*float.*True"):
        Settings.from_additional_config({"cosa": {"delta": True}})
    with pytest.raises(ValueError, match=">= 1"):
        Settings.from_additional_config({"cosa": {"min_prefill_tokens": 0}})
    with pytest.raises(ValueError, match="must be a dict"):
        Settings.from_additional_config({"cosa": [1]})


def test_register_puts_the_backend_in_the_custom_slot():
    pytest.importorskip("vllm")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    vllm_plugin.register()
    backend = AttentionBackendEnum.CUSTOM.get_class()
    assert backend.__name__ == "CosaAttentionBackend" and backend.get_name() == "CUSTOM"


def vllm_cache(k, v, seqlens_k, block_size, generator):
    """vLLM's FlashAttention cache ``[num_blocks, 2, block_size, Hkv, d]`` holding packed ``k, v``
    in shuffled blocks, and its block table (unused entries 0, as vLLM leaves them)."""
    blocks_per_seq = [math.ceil(n / block_size) for n in seqlens_k]
    num_blocks = sum(blocks_per_seq) + 3  # blocks that no sequence owns, filled with NaN
    cache = torch.full((num_blocks, 2, block_size, k.shape[1], k.shape[2]), math.nan, dtype=k.dtype, device=k.device)
    physical = torch.randperm(num_blocks, generator=generator)
    table = torch.zeros((len(seqlens_k), max(blocks_per_seq) + 2), dtype=torch.int32)
    token0, next_block = 0, 0
    for b, (n, nb) in enumerate(zip(seqlens_k, blocks_per_seq)):
        ids = physical[next_block: next_block + nb]
        table[b, :nb] = ids.to(torch.int32)
        for t0 in range(0, n, block_size):
            t1 = min(n, t0 + block_size)
            cache[ids[t0 // block_size], 0, : t1 - t0] = k[token0 + t0: token0 + t1]
            cache[ids[t0 // block_size], 1, : t1 - t0] = v[token0 + t0: token0 + t1]
        token0 += n
        next_block += nb
    return cache, table.to(k.device)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 128])
def test_forward_on_vllm_cache_layout_matches_reference(ops, block_size):
    """Decodes and a short prefill through vLLM's FlashAttention, two long chunks (one over a
    cached prefix) through CoSA, one call; every output row against the reference."""
    pytest.importorskip("vllm")
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata

    from cosa.integrations.vllm_backend import CosaAttentionImpl, CosaAttentionMetadata, CosaChunk

    hq, hkv, d = 8, 2, 128
    q_lens = [1, 1, 300, 700, 1500]
    kv_lens = [900, 45, 300, 700 + 256, 1500]
    gen = torch.Generator().manual_seed(0)
    total_k = sum(kv_lens)
    q = torch.randn((sum(q_lens) + 5, hq, d), generator=gen).to(torch.bfloat16).cuda()  # 5 padding rows
    k = torch.randn((total_k, hkv, d), generator=gen).to(torch.bfloat16).cuda()
    v = torch.randn((total_k, hkv, d), generator=gen).to(torch.bfloat16).cuda()
    kv_cache, table = vllm_cache(k, v, kv_lens, block_size, gen)
    settings = {"min_prefill_tokens": 512, "top_p": 1.0, "delta": 0.0}
    r = route(starts(*q_lens), torch.tensor(kv_lens), settings["min_prefill_tokens"])
    assert r.reasons == ("decode", "decode", "short_prefill", "cosa", "cosa")

    qsl = starts(*q_lens).to(torch.int32).cuda()
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32).cuda()
    flash = FlashAttentionMetadata(
        num_actual_tokens=r.token_start, max_query_len=max(q_lens[: r.first]), query_start_loc=qsl[: r.first + 1],
        max_seq_len=max(kv_lens[: r.first]), seq_lens=seq_lens[: r.first], block_table=table[: r.first],
        slot_mapping=torch.zeros(r.token_start, dtype=torch.int64, device="cuda"), use_cascade=False,
        common_prefix_len=0, cu_prefix_query_lens=None, prefix_kv_lens=None, suffix_kv_lens=None)
    loc = qsl[r.first: r.stop + 1]
    chunk = CosaChunk(r.token_start, r.token_stop, loc - loc[:1], seq_lens[r.first: r.stop], table[r.first: r.stop],
                      max(q_lens[r.first:]), max(kv_lens[r.first:]))
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(additional_config={"cosa": settings})):
        impl = CosaAttentionImpl(num_heads=hq, head_size=d, scale=d ** -0.5, num_kv_heads=hkv, alibi_slopes=None,
                                 sliding_window=None, kv_cache_dtype="auto")
    one = torch.ones((), dtype=torch.float32, device="cuda")
    layer = types.SimpleNamespace(_q_scale=one, _k_scale=one, _v_scale=one)
    output = torch.full_like(q, math.nan)
    impl.forward(layer, q, None, None, kv_cache, CosaAttentionMetadata(flash, chunk), output)
    torch.cuda.synchronize()

    # The reference over the same tokens in cosa's own layout (top_p 1, no skip: dense attention).
    k_cache, v_cache = kv_cache.unbind(1)
    n = sum(q_lens)
    expect = R.dense_attention(q[:n].float(), k_cache.float(), v_cache.float(), table, qsl, seq_lens)[0]
    assert_rows_close(output[:n].float(), expect.float(), atol=2e-2)
    assert output[n:].isnan().all(), "padding rows past the batch's tokens must stay untouched"
