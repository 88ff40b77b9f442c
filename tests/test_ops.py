"""torch.ops.cosa and the Python API: schemas, fake kernels (opcheck), the CPU path, bad inputs.

The bad-input cases run on the CPU here and on the GPU (CUDA binding) with the `gpu` marker."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

import cosa
from cosa import defaults, tuning
from cosa import reference as R
from cosa.layout import kap_layout_args
from cosa.testing import random_problem

from helpers import assert_rows_close, dense_order, rel_err, run_dense, run_kap, run_osk


def small_problem(device="cpu", **kw):
    args = dict(seqlens_q=[200, 77], seqlens_k=[200 + 128, 77], num_heads_q=4, num_heads_kv=2, head_dim=64,
                page_size=16, dtype=torch.bfloat16, device=device, structure="mixed", seed=0)
    args.update(kw)
    return random_problem(args.pop("seqlens_q"), args.pop("seqlens_k"), args.pop("num_heads_q"),
                          args.pop("num_heads_kv"), args.pop("head_dim"), **args)


def prefill_args(p):
    return (p["q"], p["k_cache"], p["v_cache"], p["page_table"], p["cu_seqlens_q"], p["seqused_k"],
            p["max_seqlen_q"], p["max_seqlen_k"])


def test_the_ops_have_no_backward(ops):
    """Inputs that require grad run forward; a backward through an op is a clear error naming it."""
    p = small_problem()
    q = p["q"].clone().requires_grad_(True)
    out = ops.prefill(q, *prefill_args(p)[1:])[0]
    with pytest.raises(NotImplementedError, match="cosa.prefill has no backward"):
        out.float().sum().backward()
    order, counts = ops.kap(*kap_layout_args(p))
    out = ops.osk(q, p["k_cache"], p["v_cache"], p["page_table"], p["cu_seqlens_q"], p["seqused_k"], order, counts,
                  p["max_seqlen_q"])[0]
    with pytest.raises(NotImplementedError, match="cosa.osk has no backward"):
        out.float().sum().backward()


def test_fake_outputs_are_contiguous_for_a_strided_q(ops):
    """torch.compile traces the fakes: their outputs must have the real ones' (contiguous) strides."""
    p = small_problem()
    p["q"] = p["q"].transpose(0, 1).contiguous().transpose(0, 1)
    assert not p["q"].is_contiguous()
    torch.library.opcheck(ops.prefill.default, prefill_args(p) + (8, 0.9, None, 100.0))
    order, counts = ops.kap(*kap_layout_args(p), 8, 0.9, None)
    torch.library.opcheck(ops.osk.default, (p["q"], p["k_cache"], p["v_cache"], p["page_table"], p["cu_seqlens_q"],
                                            p["seqused_k"], order, counts, p["max_seqlen_q"], None, 100.0))


def test_opcheck_all_ops(ops):
    p = small_problem()
    order, counts = ops.kap(*kap_layout_args(p), 8, 0.9, None)
    torch.library.opcheck(ops.kap.default, kap_layout_args(p) + (8, 0.9, None))
    torch.library.opcheck(ops.osk.default, (p["q"], p["k_cache"], p["v_cache"], p["page_table"], p["cu_seqlens_q"],
                                            p["seqused_k"], order, counts, p["max_seqlen_q"], None, 100.0))
    torch.library.opcheck(ops.prefill.default, prefill_args(p) + (8, 0.9, None, 100.0))


def test_cpu_ops_are_the_reference(ops):
    p = small_problem()
    out, lse, order, counts, skipped = ops.prefill(*prefill_args(p), 8, 0.9, None, 100.0)
    ref_order, ref_counts = run_kap(p, top_p=0.9)
    assert torch.equal(order, ref_order) and torch.equal(counts, ref_counts)
    ref_out, ref_lse, ref_skipped = run_osk(p, order, counts, delta=100.0)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse) and torch.equal(skipped, ref_skipped)
    assert out.dtype == p["q"].dtype and lse.dtype == torch.float32


def test_python_api_defaults_and_stats(ops):
    p = small_problem()
    out, stats = cosa.prefill(p["q"], p["k_cache"], p["v_cache"], p["page_table"], p["cu_seqlens_q"],
                              p["seqused_k"], return_stats=True)
    expect = ops.prefill(*prefill_args(p))
    assert torch.equal(out, expect[0])
    assert 0 < stats["realised_budget"] <= stats["stage1_budget"] <= 1
    assert set(stats) >= {"lse", "order", "counts", "skipped"}
    dense_out, _ = run_dense(p)
    assert rel_err(out, dense_out) < 0.2


def test_sparse_attention_is_prefill_on_a_contiguous_layout(ops):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 130, 4, 64, generator=gen).bfloat16()
    k = torch.randn(2, 258, 2, 64, generator=gen).bfloat16()
    v = torch.randn(2, 258, 2, 64, generator=gen).bfloat16()
    out = cosa.sparse_attention(q, k, v, top_p=1.0, delta=0.0)
    assert out.shape == q.shape
    for b in range(2):
        kk = k[b].repeat_interleave(2, 1).transpose(0, 1).float()
        vv = v[b].repeat_interleave(2, 1).transpose(0, 1).float()
        mask = torch.arange(258)[None, :] <= (128 + torch.arange(130))[:, None]
        expect = torch.nn.functional.scaled_dot_product_attention(q[b].transpose(0, 1).float(), kk, vv, attn_mask=mask)
        assert_rows_close(out[b].transpose(0, 1), expect, atol=2e-2)


def test_fake_kernels_trace_under_torch_compile(ops):
    p = small_problem()

    def f(q, k_cache, v_cache):
        return ops.prefill(q, k_cache, v_cache, p["page_table"], p["cu_seqlens_q"], p["seqused_k"],
                           p["max_seqlen_q"], p["max_seqlen_k"])[0] * 2

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(p["q"], p["k_cache"], p["v_cache"]), f(p["q"], p["k_cache"], p["v_cache"]))


# --- bad inputs --------------------------------------------------------------------------------
# Each case: (id, function that breaks the argument dict, exception type, text the message names).


def _ints(values, a):
    return torch.tensor(values, dtype=torch.int32, device=a["q"].device)


def _both(first, second):
    def mutate(a):
        first(a)
        second(a)
    return mutate


def _caches(change):
    return _both(_set("k_cache", lambda a: change(a["k_cache"])), _set("v_cache", lambda a: change(a["v_cache"])))


def _set(key, value):
    def mutate(a):
        a[key] = value(a) if callable(value) else value
    return mutate


BAD_LAYOUT = [
    ("q_dtype", _set("q", lambda a: a["q"].float()), TypeError, "q must be bfloat16 or float16"),
    ("q_dims", _set("q", lambda a: a["q"][:, 0]), ValueError, "q must be 3-D"),
    ("head_dim", _set("q", lambda a: a["q"][..., :32]), ValueError, "head dim must be 64 or 128"),
    ("k_dtype", _set("k_cache", lambda a: a["k_cache"].half()), TypeError, "k_cache must have q's dtype"),
    ("v_shape", _set("v_cache", lambda a: a["v_cache"][:-1]), ValueError, "v_cache shape"),
    ("page_size", _caches(lambda c: c[:, :12]), ValueError, "page size"),
    ("gqa", _caches(lambda c: torch.cat([c, c[:, :, :1]], 2)), ValueError, "multiple of num_heads_kv"),
    ("page_table_dtype", _set("page_table", lambda a: a["page_table"].long()), TypeError, "page_table must be int32"),
    ("cu_seqlens_len", _set("cu_seqlens_q", lambda a: a["cu_seqlens_q"][:-1]), ValueError, "cu_seqlens_q must have"),
    ("cu_seqlens_end", _set("cu_seqlens_q", lambda a: a["cu_seqlens_q"] - 1), ValueError, "cu_seqlens_q must start at 0"),
    ("seqused_dtype", _set("seqused_k", lambda a: a["seqused_k"].long()), TypeError, "seqused_k must be int32"),
    ("length_over_max", _set("cu_seqlens_q", lambda a: _ints([0, 277, 277], a)), ValueError, "more than max_seqlen_q"),
    ("decreasing_cu_seqlens", _both(_set("cu_seqlens_q", lambda a: _ints([0, 300, 277], a)), _set("max_seqlen_q", 300)),
     ValueError, "non-decreasing"),
    ("kv_shorter_than_q", _set("seqused_k", lambda a: _ints([328, 76], a)), ValueError, "shorter than"),
    ("kv_over_page_table", _both(_set("seqused_k", lambda a: _ints([328, 77 + 256 * 16], a)), _set("max_seqlen_k", 5000)),
     ValueError, "capacity"),
    ("page_id_out_of_range", _set("page_table", lambda a: a["page_table"].masked_fill(
        a["page_table"] == 0, a["k_cache"].shape[0] + 5)), ValueError, "page_table["),
    ("max_seqlen_q", _set("max_seqlen_q", 0), ValueError, "max_seqlen_q"),
    ("max_seqlen_k", _set("max_seqlen_k", 100), ValueError, "max_seqlen_k"),
]
BAD_TUNING = [
    ("stride", dict(stride=3), ValueError, "stride"),
    ("top_p_zero", dict(top_p=0.0), ValueError, "top_p"),
    ("top_p_big", dict(top_p=1.5), ValueError, "top_p"),
    ("delta_nan", dict(delta=math.nan), ValueError, "delta"),
    ("delta_subnormal", dict(delta=1e-40), ValueError, "delta must be .* at least"),
    ("delta_past_float32", dict(delta=1e39), ValueError, "delta must be a number of magnitude at most"),
    ("delta_past_float32_negative", dict(delta=-1e39), ValueError, "delta must be a number of magnitude at most"),
    ("scale_negative", dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
    ("vote_word", dict(vote="both"), ValueError, "vote must be 'tile' or 'warpgroup', got 'both'"),
    ("proxy_precision_word", dict(proxy_precision="int8"), ValueError,
     "proxy_precision must be 'native', 'fp8' or 'auto', got 'int8'"),
]


def _devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("case", BAD_LAYOUT, ids=[c[0] for c in BAD_LAYOUT])
def test_bad_layout_is_a_clear_error(ops, device, case):
    _, mutate, exc, text = case
    p = small_problem(device=device)
    mutate(p)
    with pytest.raises(exc, match="cosa.prefill: .*" + text.replace("[", r"\[").replace("(", r"\(")):
        ops.prefill(*prefill_args(p))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("case", BAD_TUNING, ids=[c[0] for c in BAD_TUNING])
def test_bad_tuning_argument_is_a_clear_error(ops, device, case):
    _, kwargs, exc, text = case
    p = small_problem(device=device)
    args = dict(stride=defaults.STRIDE, top_p=defaults.TOP_P, softmax_scale=None, delta=defaults.DELTA,
                vote=defaults.VOTE, proxy_precision=defaults.PROXY_PRECISION)
    args.update(kwargs)
    with pytest.raises(exc, match=f"cosa.prefill: {text}"):
        ops.prefill(*prefill_args(p), *args.values())


@pytest.mark.parametrize("case", BAD_TUNING, ids=[c[0] for c in BAD_TUNING])
def test_python_and_cpp_refuse_a_tuning_argument_in_the_same_words(ops, case):
    """cosa.tuning (the wrappers' and the integrations' check) and the binding's check_scalars (the
    op's) hold the same domains and say the same thing."""
    _, kwargs, exc, _ = case
    [(name, value)] = kwargs.items()
    p = small_problem()
    with pytest.raises(exc) as cpp:
        ops.prefill(*prefill_args(p), **kwargs)
    with pytest.raises(exc) as python:
        tuning.check("prefill", name, value)
    assert str(python.value) == str(cpp.value)


@pytest.mark.gpu
def test_context_beyond_the_cuda_kap_limit_is_a_clear_error(ops):
    p = small_problem(device="cuda")
    p["max_seqlen_k"] = 16384 * 128 + 1
    with pytest.raises(ValueError, match="cosa.prefill: max_seqlen_k = 2097153 exceeds the CUDA KAP limit"):
        ops.prefill(*prefill_args(p))


@pytest.mark.parametrize("device", _devices())
def test_bad_lists_are_a_clear_error(ops, device):
    p = small_problem(device=device)
    order, counts = dense_order(p)
    base = (p["q"], p["k_cache"], p["v_cache"], p["page_table"], p["cu_seqlens_q"], p["seqused_k"])
    future = order.clone()
    future[0, 0, 0] = 5  # a key block after the query block's diagonal
    with pytest.raises(ValueError, match=r"cosa.osk: order\[0, 0, 0\] = 5"):
        ops.osk(*base, future, counts, p["max_seqlen_q"])
    too_many = counts.clone()
    too_many[1, 2] += 1
    with pytest.raises(ValueError, match=r"cosa.osk: counts\[1, 2\]"):
        ops.osk(*base, order, too_many, p["max_seqlen_q"])
    with pytest.raises(ValueError, match=r"cosa.osk: counts\[0, 0\] = 2 exceeds order's row length 1"):
        ops.osk(*base, order[:, :, :1].contiguous(), counts, p["max_seqlen_q"])
    with pytest.raises(ValueError, match="cosa.osk: counts must have shape"):
        ops.osk(*base, order, counts[:, :-1], p["max_seqlen_q"])
    with pytest.raises(TypeError, match="cosa.osk: order must be int32"):
        ops.osk(*base, order.long(), counts, p["max_seqlen_q"])


@pytest.mark.gpu
def test_kernels_enqueued_behind_failed_checks_do_nothing(ops):
    """With the device checks on, the op's kernels are enqueued before the host has read the checks'
    report, and must do nothing when a check failed: a page id far outside the cache (a kernel that
    read it would fault, and the fault would stick to the CUDA context) raises the check's error,
    and the same call with good inputs then gives the results it gave before."""
    p = small_problem(device="cuda")
    expected = ops.prefill(*prefill_args(p))
    for op_name in ("prefill", "kap"):
        bad = p["page_table"].clone()
        bad[0, 0] = 1 << 30
        args = prefill_args({**p, "page_table": bad})
        call = ops.prefill if op_name == "prefill" else lambda *a: ops.kap(*a[:2], *a[3:])
        with pytest.raises(ValueError, match=rf"cosa.{op_name}: page_table\[0, 0\]"):
            call(*args)
        torch.cuda.synchronize()
    got = ops.prefill(*prefill_args(p))
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("width", [None, 40000], ids=["one-cta", "grid"])
def test_device_checks_find_a_bad_page_id_on_both_paths(ops, width):
    """The device checks run in one CTA where the page table has at most 65536 entries and no lists
    are given, and as a grid (with the report's memset and publication as launches of their own)
    otherwise: both pass good inputs and find a bad page id among those a sequence uses."""
    p = small_problem(device="cuda")
    expected = ops.prefill(*prefill_args(p))
    if width is not None:  # the same problem with a page table too wide for the one-CTA path
        table = p["page_table"]
        unused = torch.zeros(table.shape[0], width - table.shape[1], dtype=table.dtype, device=table.device)
        p = {**p, "page_table": torch.cat([table, unused], dim=1)}
    got = ops.prefill(*prefill_args(p))
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    bad = p["page_table"].clone()
    bad[1, 2] = -5  # sequence 1 uses pages 0-4
    with pytest.raises(ValueError, match=r"cosa.prefill: page_table\[1, 2\]"):
        ops.prefill(*prefill_args({**p, "page_table": bad}))


@pytest.mark.gpu
def test_device_checks_can_be_turned_off(ops):
    """The device-data checks are the ops' one host synchronisation: on by default, and gone
    (same results, no synchronisation) with cosa.set_device_checks(False)."""
    p = small_problem(device="cuda")
    expected = ops.prefill(*prefill_args(p))
    torch.cuda.synchronize()
    assert cosa.device_checks_enabled()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            ops.prefill(*prefill_args(p))
        with cosa.set_device_checks(False):
            assert not cosa.device_checks_enabled()
            got = ops.prefill(*prefill_args(p))
            order, counts = ops.kap(*prefill_args(p)[:2], *prefill_args(p)[3:])
            ops.osk(*prefill_args(p)[:6], order, counts, p["max_seqlen_q"])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert cosa.device_checks_enabled()
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    # Back on: a bad page table entry is caught again.
    bad = p["page_table"].clone()
    bad[0, 0] = p["k_cache"].shape[0]
    with pytest.raises(ValueError, match=r"cosa.prefill: page_table\[0, 0\]"):
        ops.prefill(p["q"], p["k_cache"], p["v_cache"], bad, *prefill_args(p)[4:])


@pytest.mark.parametrize("device", _devices())
def test_sparse_attention_takes_any_prefix(ops, device):
    """A prefix that is not a multiple of 128 runs (at top_p 1 without the skip: dense attention);
    fewer keys than queries stays an error naming both shapes."""
    q = torch.randn(1, 130, 4, 64, device=device).bfloat16()
    k = torch.randn(1, 130 + 100, 2, 64, device=device).bfloat16()
    v = torch.randn(1, 130 + 100, 2, 64, device=device).bfloat16()
    out = cosa.sparse_attention(q, k, v, top_p=1.0, delta=0.0)
    expect = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(),
        attn_mask=torch.ones(130, 230, dtype=torch.bool, device=device).tril(100), enable_gqa=True).transpose(1, 2)
    assert_rows_close(out.float(), expect, atol=2e-2)
    with pytest.raises(ValueError, match=r"cosa.sparse_attention: need 1 <= Sq <= Sk, got Sq=130 \(q.shape\[1\]\), "
                                         r"Sk=129 \(k.shape\[1\]\)"):
        cosa.sparse_attention(q, k[:, :129], v[:, :129])


# Any prefix (spec section 1): the lists given to OSK may hold the blocks up to each query block's
# last diagonal block, and no further. Sequence 0 (200 queries after 100 keys) has query blocks at
# positions 100-227 and 228-299: diagonal blocks 0 and 1, then 1 and 2; sequence 1 (77 queries after
# 1 key) one block, diagonal block 0.
@pytest.mark.parametrize("device", _devices())
def test_lists_reach_the_last_diagonal_block_for_any_prefix(ops, device):
    p = small_problem(device=device, seqlens_k=[200 + 100, 77 + 1])
    order, counts = dense_order(p)
    assert counts[0, :3].tolist() == [2, 3, 1]  # then a padding row
    base = (p["q"], p["k_cache"], p["v_cache"], p["page_table"], p["cu_seqlens_q"], p["seqused_k"])
    out, lse, _ = ops.osk(*base, order, counts, p["max_seqlen_q"], None, 0.0)
    ref_out, ref_lse = run_dense(p)
    assert_rows_close(out.float().cpu(), ref_out.float().cpu(), atol=2e-2)
    assert_rows_close(lse.cpu()[..., None], ref_lse.cpu()[..., None], atol=1e-3, what="lse")
    past = order.clone()
    past[0, 0, 1] = 2  # query block 0's last diagonal block is 1
    with pytest.raises(ValueError, match=r"cosa.osk: order\[0, 0, 1\] = 2 is not a causal block of its query "
                                         r"block \(0..1\)"):
        ops.osk(*base, past, counts, p["max_seqlen_q"])
    too_many = counts.clone()
    too_many[0, 1] = 4
    with pytest.raises(ValueError, match=r"cosa.osk: counts\[0, 1\] = 4 is outside \[0, 3\]"):
        ops.osk(*base, order, too_many, p["max_seqlen_q"])


def test_sparse_attention_names_the_layout_when_given_sdpa_layout(ops):
    """SDPA's [B, H, S, d] with fewer KV than query heads reads as Sq > Sk; the error says which
    layout sparse_attention takes and how to get it from SDPA's."""
    q = torch.randn(1, 4, 256, 64).bfloat16()  # [B, Hq, S, d]
    k = torch.randn(1, 2, 256, 64).bfloat16()  # [B, Hkv, S, d]
    with pytest.raises(ValueError, match=r"Sq=4 \(q.shape\[1\]\), Sk=2 \(k.shape\[1\]\).*takes \[B, S, H, d\].*"
                                         r"q.transpose\(1, 2\)"):
        cosa.sparse_attention(q, k, k)
    # Query heads that are not a multiple of the KV heads, in the right layout, name the layout too.
    with pytest.raises(ValueError, match=r"Hq=3 \(q.shape\[2\]\) must be a multiple of the KV heads Hkv=2.*\[B, S, H, d\]"):
        cosa.sparse_attention(torch.randn(1, 128, 3, 64).bfloat16(), torch.randn(1, 128, 2, 64).bfloat16(),
                              torch.randn(1, 128, 2, 64).bfloat16())
    # Transposed as the error says, the same tensors run.
    out = cosa.sparse_attention(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2))
    assert out.shape == (1, 256, 4, 64)


@pytest.mark.parametrize("function, args", [
    ("kap", ("q", "k_cache", "v_cache", "page_table", "cu_seqlens_q", "seqused_k")),
    ("prefill", ("q", "k_cache", "v_cache", "v_cache", "page_table", "cu_seqlens_q", "seqused_k")),
    ("osk", ("q", "k_cache", "v_cache", "v_cache", "page_table", "cu_seqlens_q", "seqused_k", "order", "counts")),
])
def test_one_tensor_argument_too_many_names_the_signature(ops, function, args):
    """A tensor where a length goes is one tensor argument too many (kap takes no v_cache): the error
    says so and spells out the function's arguments, instead of only blaming max_seqlen_q."""
    p = small_problem()
    p["order"], p["counts"] = run_kap(p)
    with pytest.raises(TypeError, match=rf"cosa.{function}: max_seqlen_q must be an int or None, got a tensor: one "
                                        rf"tensor argument too many\? The arguments are cosa.{function}\(q, k_cache, "):
        getattr(cosa, function)(*(p[name] for name in args))


# --- one argument contract: every path, the same errors ------------------------------------------


@pytest.mark.parametrize("case", BAD_LAYOUT, ids=[c[0] for c in BAD_LAYOUT])
def test_the_wrapper_raises_the_ops_error(ops, case):
    """cosa.prefill (max lengths given) raises what torch.ops.cosa.prefill raises: one contract."""
    _, mutate, exc, text = case
    p = small_problem()
    mutate(p)
    with pytest.raises(exc, match="cosa.prefill: .*" + text.replace("[", r"\[").replace("(", r"\(")):
        cosa.prefill(*prefill_args(p))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("name", ["k_cache", "v_cache", "page_table", "cu_seqlens_q", "seqused_k"])
@pytest.mark.parametrize("other", ["meta", "cpu"])
def test_mixed_devices_are_refused_naming_both(ops, device, name, other):
    """A tensor on another device than q, 'meta' included (the dispatcher sends such a call to the
    fake kernel, which used to return uninitialised memory), through the op and the wrapper."""
    if other == device:
        pytest.skip("same device")
    p = small_problem(device=device)
    p[name] = p[name].to(other)
    message = f"cosa.prefill: {name} must be on {p['q'].device} like q, got {other}"
    with pytest.raises(ValueError, match=message):
        ops.prefill(*prefill_args(p))
    with pytest.raises(ValueError, match=message):
        cosa.prefill(*prefill_args(p)[:6])  # max lengths derived: refused before any is read


def test_mixed_devices_are_refused_by_osk_and_kap(ops):
    p = small_problem()
    order, counts = dense_order(p)
    base = (p["q"], p["k_cache"], p["v_cache"], p["page_table"], p["cu_seqlens_q"], p["seqused_k"])
    with pytest.raises(ValueError, match="cosa.osk: order must be on cpu like q, got meta"):
        ops.osk(*base, order.to("meta"), counts, p["max_seqlen_q"])
    with pytest.raises(ValueError, match="cosa.osk: counts must be on cpu like q, got meta"):
        cosa.osk(*base, order, counts.to("meta"))
    with pytest.raises(ValueError, match="cosa.kap: k_cache must be on meta like q, got cpu"):
        ops.kap(p["q"].to("meta"), *kap_layout_args(p)[1:])
    with pytest.raises(ValueError, match="cosa.sparse_attention: v must be on cpu like q, got meta"):
        q = torch.zeros(1, 128, 2, 64, dtype=torch.bfloat16)
        cosa.sparse_attention(q, q, q.to("meta"))


def test_all_meta_tensors_still_give_shapes(ops):
    """The fake kernels' checks refuse mixed devices, not 'meta' itself."""
    p = small_problem()
    meta = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in prefill_args(p)]
    out, lse, order, counts, skipped = ops.prefill(*meta)
    assert out.device.type == "meta" and out.shape == p["q"].shape and counts.shape == skipped.shape


def _wrapper_calls(p):
    """Each wrapper of the API with the problem's arguments, max lengths derived."""
    order, counts = dense_order(p)
    layout = dict(q=p["q"], k_cache=p["k_cache"], page_table=p["page_table"], cu_seqlens_q=p["cu_seqlens_q"],
                  seqused_k=p["seqused_k"])
    return {
        "kap": lambda **kw: cosa.kap(**{**layout, **kw}),
        "osk": lambda **kw: cosa.osk(**{**layout, "v_cache": p["v_cache"], "order": order, "counts": counts, **kw}),
        "prefill": lambda **kw: cosa.prefill(**{**layout, "v_cache": p["v_cache"], **kw}),
    }


WRONG_TYPES = [  # (argument, value, wrappers that take it, expected type's words)
    ("stride", 8.0, ("kap", "prefill"), "an int"),
    ("stride", True, ("kap", "prefill"), "an int"),
    ("top_p", "0.9", ("kap", "prefill"), "a real number"),
    ("top_p", True, ("kap", "prefill"), "a real number"),
    ("softmax_scale", "0.1", ("kap", "osk", "prefill"), "a real number or None"),
    ("delta", "2000", ("osk", "prefill"), "a real number"),
    ("vote", 1, ("osk", "prefill"), "a str"),
    ("proxy_precision", 8, ("kap", "prefill"), "a str"),
    ("max_seqlen_q", 300.0, ("kap", "osk", "prefill"), "an int or None"),
    ("max_seqlen_k", "328", ("kap", "prefill"), "an int or None"),
    ("page_table", [[0, 1]], ("kap", "osk", "prefill"), "a torch.Tensor"),
    ("cu_seqlens_q", None, ("kap", "osk", "prefill"), "a torch.Tensor"),
    ("seqused_k", [328, 77], ("kap", "osk", "prefill"), "a torch.Tensor"),
]


@pytest.mark.parametrize("case", WRONG_TYPES, ids=[f"{c[0]}={c[1]!r}" for c in WRONG_TYPES])
def test_wrong_python_types_are_a_type_error_naming_the_argument(ops, case):
    name, value, wrappers, expected = case
    calls = _wrapper_calls(small_problem())
    for op in wrappers:
        with pytest.raises(TypeError, match=f"cosa.{op}: {name} must be {expected}, got "):
            calls[op](**{name: value})


def test_numpy_and_int_values_of_the_right_kind_are_accepted(ops):
    np = pytest.importorskip("numpy")
    p = small_problem()
    expected = cosa.prefill(*prefill_args(p)[:6], stride=8, top_p=0.9, delta=100.0)
    got = cosa.prefill(*prefill_args(p)[:6], stride=np.int64(8), top_p=np.float32(0.9), delta=100)
    assert torch.equal(got, expected)


def _ints_on(p, values):
    return torch.tensor(values, dtype=torch.int32, device=p["q"].device)


BAD_DERIVED = [  # max lengths left to the wrapper: the contract refuses these before any is derived
    ("empty_batch", dict(seqused_k=lambda p: _ints_on(p, []), cu_seqlens_q=lambda p: _ints_on(p, [0])),
     "seqused_k must hold at least one sequence"),
    ("cu_seqlens_short", dict(cu_seqlens_q=lambda p: _ints_on(p, [0, 277])), "cu_seqlens_q must have batch + 1 = 3"),
    ("cu_seqlens_2d", dict(cu_seqlens_q=lambda p: _ints_on(p, [[0, 200, 277]])), "cu_seqlens_q must be 1-D"),
    ("cu_seqlens_int64", dict(cu_seqlens_q=lambda p: p["cu_seqlens_q"].long()), "cu_seqlens_q must be int32"),
    ("cu_seqlens_decreasing", dict(cu_seqlens_q=lambda p: _ints_on(p, [0, 300, 277])),
     "cu_seqlens_q must be non-decreasing, got 300 then 277 at index 1"),
    ("cu_seqlens_start", dict(cu_seqlens_q=lambda p: _ints_on(p, [5, 200, 277])),
     "cu_seqlens_q must start at 0 and end at total_q = 277, got 5 .. 277"),
    ("kv_shorter", dict(seqused_k=lambda p: _ints_on(p, [328, 10])), "seqused_k[1] = 10 is shorter"),
]


@pytest.mark.parametrize("case", BAD_DERIVED, ids=[c[0] for c in BAD_DERIVED])
def test_wrappers_check_the_lengths_before_deriving_max_lengths(ops, case):
    _, changes, text = case
    p = small_problem()
    for name, make in changes.items():
        p[name] = make(p)
    for op, call in _wrapper_calls(small_problem()).items():
        with pytest.raises((ValueError, TypeError), match=f"cosa.{op}: " + re.escape(text)):
            call(**{name: p[name] for name in changes})


def test_a_batch_without_queries_or_heads_is_refused(ops):
    """total_q = 0 or no query head: refused on every path, whether the max lengths are given or derived
    (given, an empty batch used to pass and return_stats then divided by zero)."""
    cache = torch.zeros(8, 16, 2, 64, dtype=torch.bfloat16)
    page_table = torch.arange(8, dtype=torch.int32)[None]
    lengths = (torch.tensor([0, 0], dtype=torch.int32), torch.tensor([128], dtype=torch.int32))
    for max_lengths in ((), (1, 128)):
        with pytest.raises(ValueError, match=re.escape("cosa.prefill: q must hold at least one query token")):
            cosa.prefill(torch.zeros(0, 4, 64, dtype=torch.bfloat16), cache, cache, page_table, *lengths, *max_lengths)
    lengths = (torch.tensor([0, 4], dtype=torch.int32), torch.tensor([128], dtype=torch.int32))
    for op in (cosa.prefill, cosa.kap):
        v_cache = (cache,) if op is cosa.prefill else ()
        with pytest.raises(ValueError, match=r"cosa\.(prefill|kap): q must have at least one head"):
            op(torch.zeros(4, 0, 64, dtype=torch.bfloat16), cache, *v_cache, page_table, *lengths)


def test_scalars_the_kernels_cannot_hold_are_refused(ops):
    """The kernels hold softmax_scale in float32 (inf past its range, 0 below it) and the schemas' ints
    are int64."""
    p = small_problem()
    for scale in (1e39, 1e-46, 1e-40):
        with pytest.raises(ValueError, match="softmax_scale must be a positive number in float32's normal range"):
            cosa.prefill(*prefill_args(p)[:6], softmax_scale=scale)
    with pytest.raises(ValueError, match="max_seqlen_k must fit in int64"):
        cosa.prefill(*prefill_args(p)[:7], 2**70)


def test_check_args_derives_the_max_lengths(ops):
    p = small_problem()
    layout = (p["q"], p["k_cache"], p["page_table"], p["cu_seqlens_q"], p["seqused_k"])
    assert ops.check_args("prefill", *layout, v_cache=p["v_cache"]) == (200, 328)
    assert ops.check_args("kap", *layout, max_seqlen_q=300) == (300, 328)  # max_seqlen_k >= max_seqlen_q
    assert ops.check_args("kap", *layout, max_seqlen_q=300, max_seqlen_k=400) == (300, 400)


def test_the_c_header_of_the_tuning_table_is_current():
    """csrc/cosa_tuning.h is what cosa.tuning writes (`python3 -c 'from cosa import tuning;
    print(tuning.c_header(), end="")' > csrc/cosa_tuning.h` after a change of the table or a default)."""
    header = Path(__file__).resolve().parent.parent / "csrc" / "cosa_tuning.h"
    assert header.read_text() == tuning.c_header(), "csrc/cosa_tuning.h is stale: regenerate it"


def test_the_version_is_the_manifests():
    """cosa.__version__ (what Python reports) is the version that setup.py and CMakeLists.txt read from
    csrc/build_manifest.json (what pip and the C library report)."""
    manifest = Path(__file__).resolve().parent.parent / "csrc" / "build_manifest.json"
    assert cosa.__version__ == json.loads(manifest.read_text())["version"]


def test_the_defaults_have_one_source(ops):
    """The schemas (compiled from cosa/defaults.py through csrc/cosa_tuning.h), the wrappers and the reference
    all hold cosa.defaults' values: a stale build or a second copy fails here."""
    import inspect

    expected = dict(stride=defaults.STRIDE, top_p=defaults.TOP_P, softmax_scale=defaults.SOFTMAX_SCALE,
                    delta=defaults.DELTA, vote=defaults.VOTE, proxy_precision=defaults.PROXY_PRECISION)
    for op in (ops.kap, ops.osk, ops.prefill):
        for argument in op.default._schema.arguments:
            if argument.name in expected:
                assert argument.default_value == pytest.approx(expected[argument.name]), (op, argument.name)
    for fn in (cosa.kap, cosa.osk, cosa.prefill, cosa.sparse_attention, R.kap, R.osk, R.kap_scores):
        for name, parameter in inspect.signature(fn).parameters.items():
            if name in expected:
                assert parameter.default == expected[name], (fn.__name__, name)


# --- the device checks setting -------------------------------------------------------------------


def test_device_checks_setting_is_per_thread(ops):
    """Turning the checks off in one thread leaves another thread's calls checked; the context
    manager restores the previous setting."""
    import threading

    assert cosa.device_checks_enabled()
    seen = {}
    entered, release = threading.Event(), threading.Event()

    def other_thread():
        entered.wait()
        seen["other"] = cosa.device_checks_enabled()
        release.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with cosa.set_device_checks(False):
        assert not cosa.device_checks_enabled()
        entered.set()
        release.wait()
    thread.join()
    assert seen["other"] is True
    assert cosa.device_checks_enabled()
    with pytest.raises(TypeError, match="cosa.set_device_checks: enabled must be a bool"):
        cosa.set_device_checks(0)


def test_the_environment_sets_the_process_default_at_start_up(tmp_path):
    """COSA_DEVICE_CHECKS=0 at start-up turns the checks off for every thread; changing the
    environment later does nothing (the setting is no longer read per call)."""
    import os
    import subprocess
    import sys

    script = ("import os, threading, cosa\n"
              "t = []\n"
              "th = threading.Thread(target=lambda: t.append(cosa.device_checks_enabled())); th.start(); th.join()\n"
              "os.environ['COSA_DEVICE_CHECKS'] = '1'\n"
              "print(cosa.device_checks_enabled(), t[0])\n")
    env = dict(os.environ, COSA_DEVICE_CHECKS="0")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]


@pytest.mark.gpu
def test_sparse_attention_does_not_synchronise(ops):
    """Its index tensors are right by construction: it turns this thread's device checks off for its
    own call (and back on after), so the transformers integration costs no host synchronisation."""
    q = torch.randn(1, 256, 4, 64, device="cuda").bfloat16()
    k = torch.randn(1, 384, 2, 64, device="cuda").bfloat16()
    cosa.sparse_attention(q, k, k)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cosa.sparse_attention(q, k, k)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert cosa.device_checks_enabled()


def test_an_extension_built_from_other_sources_is_named(ops, monkeypatch):
    """cosa refuses a compiled extension whose schemas differ from what these sources call (a stale
    install serving a newer tree), naming the op and both argument lists."""
    from cosa import ops as cosa_ops

    assert cosa_ops.schema_mismatch() is None

    def newer_kap(q, k_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, stride, top_p,
                  softmax_scale, proxy_precision, an_argument_from_the_future):
        raise AssertionError("never called")

    monkeypatch.setattr(cosa_ops, "_KERNELS", ((("kap", newer_kap, None)),))
    message = cosa_ops.schema_mismatch()
    assert message is not None and message.startswith("its cosa::kap takes (q, k_cache,")
    assert "an_argument_from_the_future" in message
