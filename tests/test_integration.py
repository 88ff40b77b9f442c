"""cosa.integrations.transformers on tiny random Llama / Qwen2 / Qwen3 models (CPU, bf16): which
calls go sparse, that CoSA with every block kept matches SDPA, chunked prefill over a cached
prefix, padded batches, decode, statistics, block selectors and restoring the model."""

import pytest
import torch

import cosa.integrations.transformers as cosa_hf
from cosa import reference
from cosa.layout import paged_from_contiguous
from helpers import require_transformers

VOCAB = 512


def tiny_model(family="llama", layers=2, seed=0):
    require_transformers()
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=4096)
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    config_cls, model_cls = classes[family]
    extra = {"head_dim": 64} if family == "qwen3" else {}
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common, **extra)).to(torch.bfloat16).eval()
    model.config._attn_implementation = model.config._attn_implementation or "sdpa"
    return model


def ids(n, batch=1, seed=0):
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_every_block_kept_matches_sdpa(family):
    model = tiny_model(family)
    x = ids(384)
    with torch.no_grad():
        dense = model(x).logits
        with cosa_hf.enable(model, top_p=1.0, delta=0.0, min_prefill_tokens=256) as handle:
            sparse = model(x).logits
    assert handle.sparse_calls == 2 and handle.dense_calls == 0
    assert rel(sparse, dense) < 2e-2
    assert model.config._attn_implementation == "sdpa"


def test_restore_and_registry_cleanup():
    model = tiny_model()
    handle = cosa_hf.enable(model, min_prefill_tokens=256)
    assert model.config._attn_implementation == handle.name
    assert handle.name in cosa_hf._attention_registry()
    handle.restore()
    handle.restore()  # idempotent
    assert model.config._attn_implementation == "sdpa"
    assert handle.name not in cosa_hf._attention_registry()


def test_short_prompts_and_decode_stay_dense():
    model = tiny_model()
    x = ids(200)
    with torch.no_grad():
        dense = model(x).logits
        with cosa_hf.enable(model, min_prefill_tokens=256, collect_stats=True) as handle:
            same = model(x).logits
            assert torch.equal(same, dense)
            assert handle.sparse_calls == 0 and {c["reason"] for c in handle.calls} == {"short_prompt"}
            handle.reset_stats()
            prompt = ids(300)
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False,
                           pad_token_id=0)
    assert handle.sparse_calls == 2  # the prefill of both layers
    assert handle.dense_calls == 4  # two decode steps of both layers
    assert {c["reason"] for c in handle.calls if c["path"] == "dense"} == {"decode"}


def test_sparse_prefill_statistics_and_accuracy():
    model = tiny_model()
    x = ids(640)
    with torch.no_grad():
        dense = model(x).logits
        with cosa_hf.enable(model, top_p=0.9, delta=100.0, min_prefill_tokens=256, collect_stats=True) as handle:
            sparse = model(x).logits
    summary = handle.summary()
    assert 0 < summary["realised_budget"] <= summary["stage1_budget"] <= 1
    assert set(summary["per_layer"]) == {0, 1}
    assert rel(sparse, dense) < 0.1


def test_chunked_prefill_over_a_cached_prefix():
    require_transformers()
    from transformers import DynamicCache

    model = tiny_model()
    x = ids(640)
    with torch.no_grad():
        full = model(x).logits[:, 256:]
        with cosa_hf.enable(model, top_p=1.0, delta=0.0, min_prefill_tokens=256, collect_stats=True) as handle:
            cache = DynamicCache()
            model(x[:, :256], past_key_values=cache, use_cache=True)
            chunked = model(x[:, 256:], past_key_values=cache, use_cache=True).logits
    second = [c for c in handle.calls if c["q_len"] == 384]
    assert [c["path"] for c in second] == ["cosa", "cosa"] and all(c["kv_len"] == 640 for c in second)
    assert rel(chunked, full) < 2e-2


def test_unaligned_prefix_and_padded_batch_go_dense():
    require_transformers()
    from transformers import DynamicCache

    model = tiny_model()
    x = ids(600, batch=2)
    mask = torch.ones_like(x)
    mask[1, :40] = 0  # left padding of the second row
    with torch.no_grad(), cosa_hf.enable(model, min_prefill_tokens=256, collect_stats=True) as handle:
        model(x, attention_mask=mask)
        assert {c["reason"] for c in handle.calls} == {"unsupported_mask"}
        handle.reset_stats()
        cache = DynamicCache()
        model(x[:1, :100], past_key_values=cache, use_cache=True)
        model(x[:1, 100:], past_key_values=cache, use_cache=True)  # prefix 100: not a multiple of 128
        assert [c["reason"] for c in handle.calls] == ["short_prompt", "short_prompt", "unaligned_prefix",
                                                       "unaligned_prefix"]


def test_summary_says_why_calls_stayed_dense():
    require_transformers()
    from transformers import DynamicCache

    model = tiny_model()
    x = ids(600, batch=2)
    mask = torch.ones_like(x)
    mask[1, :40] = 0  # left padding of the second row
    with torch.no_grad(), cosa_hf.enable(model, top_p=1.0, delta=0.0, min_prefill_tokens=256) as handle:
        model(x, attention_mask=mask)
        cache = DynamicCache()
        model(x[:1, :100], past_key_values=cache, use_cache=True)
        model(x[:1, 100:], past_key_values=cache, use_cache=True)  # prefix 100: not a multiple of 128
        model(x[:1, :1], past_key_values=cache, use_cache=True)
        model(x[:1, :384])
    # Counted with statistics off too (two layers per forward).
    assert handle.calls == []
    assert handle.summary() == {"sparse_calls": 2, "dense_calls": 8,
                                "dense_reasons": {"unsupported_mask": 2, "short_prompt": 2,
                                                  "unaligned_prefix": 2, "decode": 2}}
    handle.reset_stats()
    assert handle.summary() == {"sparse_calls": 0, "dense_calls": 0, "dense_reasons": {}}


def test_batch_without_padding_runs_sparse():
    model = tiny_model()
    x = ids(384, batch=2)
    with torch.no_grad():
        dense = model(x).logits
        with cosa_hf.enable(model, top_p=1.0, delta=0.0, min_prefill_tokens=256) as handle:
            sparse = model(x, attention_mask=torch.ones_like(x)).logits
    assert handle.sparse_calls == 2
    assert rel(sparse, dense) < 2e-2


def test_block_selector_replaces_kap():
    model = tiny_model()
    x = ids(384)
    seen = []

    def every_block(module, q, k):
        seen.append((module.layer_idx, tuple(q.shape), tuple(k.shape)))
        layout = paged_from_contiguous(q, k)
        return reference.causal_order(layout["cu_seqlens_q"], layout["seqused_k"], q.shape[1], q.shape[0],
                                      k.shape[0], q.shape[0])

    with torch.no_grad():
        dense = model(x).logits
        with cosa_hf.enable(model, delta=0.0, min_prefill_tokens=256, block_selector=every_block,
                            collect_stats=True) as handle:
            sparse = model(x).logits
    assert seen == [(0, (384, 4, 64), (384, 2, 64)), (1, (384, 4, 64), (384, 2, 64))]
    assert handle.summary()["stage1_budget"] == pytest.approx(1.0)
    assert rel(sparse, dense) < 2e-2


def test_sparse_conditions():
    module = torch.nn.Module()
    settings = cosa_hf.Settings(min_prefill_tokens=256)
    q = torch.zeros((1, 4, 384, 64), dtype=torch.bfloat16)
    k = torch.zeros((1, 2, 384, 64), dtype=torch.bfloat16)

    def reason(query=q, key=k, mask=None, **kwargs):
        return cosa_hf._sparse_prefix(module, query, key, key, mask, 0.0, settings, kwargs)[1]

    assert reason() is None
    assert reason(query=q[:, :, :1]) == "decode"
    assert reason(query=q[:, :, :255]) == "short_prompt"
    assert reason(query=q.clone().requires_grad_(True)) == "grad"
    with torch.no_grad():
        assert reason(query=q.clone().requires_grad_(True)) is None
    assert reason(sliding_window=128) == "sliding_window"
    assert reason(output_attentions=True) == "output_attentions"
    assert reason(query=q.float(), key=k.float()) == "dtype"
    assert reason(query=torch.zeros((1, 4, 384, 96), dtype=torch.bfloat16),
                  key=torch.zeros((1, 2, 384, 96), dtype=torch.bfloat16)) == "head_dim"
    assert reason(is_causal=False) == "not_causal"
    causal = torch.ones((384, 384), dtype=torch.bool).tril()[None, None]
    assert reason(mask=causal) is None
    assert reason(mask=torch.where(causal, 0.0, float("-inf"))) is None
    assert reason(mask=~causal) == "unsupported_mask"


def test_bottom_right_causal_check():
    keys = torch.arange(640)
    rows = 256 + torch.arange(384)
    causal = (keys[None, :] <= rows[:, None])[None, None]
    assert cosa_hf._is_bottom_right_causal(causal, 384, 640)
    assert cosa_hf._is_bottom_right_causal(torch.where(causal, 0.0, -1e30), 384, 640)
    assert not cosa_hf._is_bottom_right_causal(causal, 384, 639)
    no_sink = causal.clone()
    no_sink[..., 0] = False
    assert not cosa_hf._is_bottom_right_causal(no_sink, 384, 640)


def test_enable_validates_arguments():
    """In the ops' own words, naming the argument, at enable() rather than at the first long prefill."""
    model = tiny_model()
    for kwargs, error, name in ((dict(top_p=0.0), ValueError, "top_p"), (dict(top_p=1.5), ValueError, "top_p"),
                                (dict(stride=3), ValueError, "stride"), (dict(stride=8.0), TypeError, "stride"),
                                (dict(stride=True), TypeError, "stride"), (dict(delta=float("nan")), ValueError, "delta"),
                                (dict(delta=1e-40), ValueError, "delta"), (dict(delta="2000"), TypeError, "delta"),
                                (dict(vote="row"), ValueError, "vote"), (dict(min_prefill_tokens=0), ValueError,
                                                                         "min_prefill_tokens"),
                                (dict(min_prefill_tokens=256.0), TypeError, "min_prefill_tokens")):
        with pytest.raises(error, match=name):
            cosa_hf.enable(model, **kwargs)
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(TypeError):
        cosa_hf.enable(torch.nn.Linear(2, 2))


def test_decode_stays_dense_whatever_min_prefill_tokens():
    """A decode step's mask is dropped (every cached key attends): with min_prefill_tokens=1 it must
    still run dense over all the keys, not CoSA over the first one."""
    model = tiny_model()
    prompt = ids(300)
    generate = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False, pad_token_id=0,
                    output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        dense = model.generate(prompt, **generate)
        with cosa_hf.enable(model, top_p=1.0, delta=0.0, min_prefill_tokens=1) as handle:
            sparse = model.generate(prompt, **generate)
    assert handle.sparse_calls == 2 and handle.dense_reasons == {"decode": 6}
    assert torch.equal(sparse.sequences, dense.sequences)
    # The decode steps' logits as dense's (up to the prefill's rounding, which the cache carries into
    # layer 1); attention over the first key alone was off by more than their norm.
    for got, want in zip(sparse.scores, dense.scores):
        assert rel(got, want) < 2e-2


def test_inference_mode():
    """Tensors made under torch.inference_mode() have no version counter; the mask check must not
    need one."""
    require_transformers()
    from transformers import DynamicCache

    model = tiny_model()
    x = ids(600, batch=2)
    mask = torch.ones_like(x)
    mask[1, :40] = 0
    with torch.inference_mode(), cosa_hf.enable(model, top_p=1.0, delta=0.0, min_prefill_tokens=256,
                                                 collect_stats=True) as handle:
        model(x, attention_mask=mask)
        assert [c["reason"] for c in handle.calls] == ["unsupported_mask"] * 2
        handle.reset_stats()
        cache = DynamicCache()
        model(x[:1, :256], past_key_values=cache, use_cache=True)
        model(x[:1, 256:], past_key_values=cache, use_cache=True)  # prefix 256 over a 4-D causal mask
        assert [c["path"] for c in handle.calls] == ["cosa"] * 4


def test_calls_that_need_gradients_stay_dense():
    """The ops have no backward: training through an enabled model gets SDPA's gradients."""
    model = tiny_model().float()
    model.to(torch.bfloat16).train()
    x = ids(300)
    with cosa_hf.enable(model, min_prefill_tokens=256) as handle:
        loss = model(x, labels=x).loss
    loss.backward()
    assert handle.sparse_calls == 0 and handle.dense_reasons == {"grad": 2}
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_handles_restored_in_any_order():
    model = tiny_model()
    first = cosa_hf.enable(model, min_prefill_tokens=256)
    second = cosa_hf.enable(model, min_prefill_tokens=256)
    first.restore()  # under `second`, which stays in charge
    assert model.config._attn_implementation == second.name
    assert first.name not in cosa_hf._attention_registry() and second.name in cosa_hf._attention_registry()
    with torch.no_grad():
        model(ids(300))
    assert second.sparse_calls == 2 and first.sparse_calls == 0
    second.restore()
    assert model.config._attn_implementation == "sdpa"
    assert second.name not in cosa_hf._attention_registry()
