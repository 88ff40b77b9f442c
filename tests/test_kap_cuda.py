"""torch.ops.cosa.kap (the Hopper KAP kernels, csrc/kap/) against cosa.reference (float32).

On inputs with clear margins (planted structure) the lists must be identical to the reference's:
same blocks, same order, same counts. On random inputs many scores are within float rounding of each
other, so the kernel may break such near-ties differently from the reference: there every list must be
a valid stage-1 list (spec section 2) under the reference's scores, up to a small relative tolerance.
Covers strides 4/8/16, lengths that are not multiples of 128 or of the stride, varlen batches,
prefixes of any length (aligned and not, side by side), GQA ratios 1/4/8, page sizes 16..256, head dims 64/128, both dtypes, top_p 1, padding
rows, determinism, CUDA-graph capture, and one 32K-key sequence (scoring CTAs that walk several
column tiles)."""

import math
import sys
from pathlib import Path

import pytest
import torch

from cosa import defaults
from cosa import reference as R
from cosa.layout import kap_layout_args
from cosa.testing import random_problem

import helpers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import proxies  # noqa: E402

pytestmark = pytest.mark.gpu

TOL = 1e-4  # relative slack on score comparisons: kernel and reference sum in different orders


def problem(seqlens_q, seqlens_k, hq=8, hkv=2, d=128, page_size=64, dtype=torch.bfloat16, structure=None,
            seed=0):
    return random_problem(seqlens_q, seqlens_k, hq, hkv, d, page_size=page_size, dtype=dtype, device="cuda",
                          structure=structure, seed=seed)


def kap(ops, p, stride, top_p=defaults.TOP_P, softmax_scale=None, proxy_precision=defaults.PROXY_PRECISION):
    order, counts = ops.kap(*kap_layout_args(p), stride, top_p, softmax_scale, proxy_precision)
    torch.cuda.synchronize()
    return order, counts


def valid_list(lst, scores, hrm, first, last, top_p, tol=TOL):
    """True iff ``lst`` is a stage-1 list of spec section 2 under ``scores``/``hrm`` (candidates
    0..last, diagonal blocks first and last), every score comparison allowing a relative slack
    ``tol``: the HRM blocks first, each group by decreasing score, the shortest prefix reaching
    top_p * T (every candidate when top_p >= 1), then the forced sink and diagonal blocks that the
    prefix lacks, in sort order."""
    lst = [int(x) for x in lst]
    if len(set(lst)) != len(lst) or any(j < 0 or j > last for j in lst):
        return False
    s = scores[: last + 1].double().tolist()
    h = hrm[: last + 1].tolist()
    total = sum(s)
    hrm_blocks = {j for j in range(last + 1) if h[j]}
    n_hrm = len(hrm_blocks)
    for n_forced in (0, 1, 2, 3):  # how many trailing entries are forced blocks appended past the prefix
        if n_forced >= len(lst):
            break
        prefix, tail = lst[: len(lst) - n_forced], lst[len(lst) - n_forced:]
        if any(j not in (0, first, last) or j in prefix for j in tail):
            continue
        if len(prefix) < n_hrm or set(prefix[:n_hrm]) != hrm_blocks:
            continue
        ok = all(s[prefix[k + 1]] <= s[prefix[k]] * (1 + tol)
                 for k in range(len(prefix) - 1) if k + 1 != n_hrm)
        rest = [s[j] for j in range(last + 1) if j not in prefix]
        kept = [s[j] for j in prefix[n_hrm:]]
        if rest and kept:
            ok &= max(rest) <= min(kept) * (1 + tol)
        cumulative = 0.0
        for j in prefix[:-1]:
            cumulative += s[j]
        if top_p >= 1:
            ok &= len(prefix) == last + 1  # every candidate, zero scores included
        elif len(prefix) > max(n_hrm, 1):
            ok &= cumulative < top_p * total * (1 + tol)  # no shorter prefix would do
        ok &= cumulative + s[prefix[-1]] >= top_p * total * (1 - tol)
        ok &= all(s[b] <= s[a] * (1 + tol) for a, b in zip(tail, tail[1:]))
        if ok:
            return True
    return False


def assert_padding(p, order, counts):
    real = sum(1 for _ in helpers.diagonal_blocks(p))
    assert (counts[:, real:] == 0).all()
    assert (order[:, real:] == -1).all()


def assert_shapes(p, order, counts):
    total_q, hq, _ = p["q"].shape
    nqb = R.num_q_blocks_bound(total_q, p["seqused_k"].shape[0], p["max_seqlen_q"])
    assert order.shape == (hq, nqb, R.cdiv(p["max_seqlen_k"], R.BLOCK)) and order.dtype == torch.int32
    assert counts.shape == (hq, nqb) and counts.dtype == torch.int32


def assert_identical(ops, p, stride, top_p=defaults.TOP_P):
    order, counts = kap(ops, p, stride, top_p)
    ref_order, ref_counts = R.kap(*kap_layout_args(p), stride=stride, top_p=top_p)
    assert_shapes(p, order, counts)
    same = (order == ref_order).all(-1) & (counts == ref_counts)
    assert same.all(), f"{int((~same).sum())} of {same.numel()} lists differ from the reference"


def assert_valid(ops, p, stride, top_p=defaults.TOP_P, max_invalid_fraction=0.0,
                 proxy_precision=defaults.PROXY_PRECISION, tol=TOL):
    order, counts = kap(ops, p, stride, top_p, proxy_precision=proxy_precision)
    assert_shapes(p, order, counts)
    assert_padding(p, order, counts)
    scores, hrm = R.kap_scores(*kap_layout_args(p), stride=stride, proxy_precision=proxy_precision)
    order, counts, scores, hrm = order.cpu(), counts.cpu(), scores.cpu(), hrm.cpu()
    invalid = total = 0
    for g, first, last in helpers.diagonal_blocks(p):
        for h in range(order.shape[0]):
            n = int(counts[h, g])
            assert (order[h, g, n:] == -1).all()
            total += 1
            if not valid_list(order[h, g, :n], scores[h, g], hrm[h, g], first, last, top_p, tol):
                invalid += 1
    assert invalid <= max_invalid_fraction * total, f"{invalid} of {total} lists are not valid top-p lists"


# Clear margins: identical lists.
@pytest.mark.parametrize("stride", [4, 8, 16])
@pytest.mark.parametrize("structure", ["needles", "sinks", "mixed"])
def test_structured_identical(ops, stride, structure):
    p = problem([1000, 333], [1000 + 512, 333], hq=8, hkv=2, page_size=32, structure=structure, seed=stride)
    assert_identical(ops, p, stride)


@pytest.mark.parametrize("page_size", [16, 128, 256])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (8, 1)])
def test_structured_layouts(ops, page_size, hq, hkv):
    p = problem([700, 129, 1], [700 + 256, 129, 1 + 1024], hq=hq, hkv=hkv, page_size=page_size,
                structure="mixed", seed=page_size + hq // hkv)
    assert_identical(ops, p, 8)


@pytest.mark.parametrize("d,dtype", [(64, torch.bfloat16), (128, torch.float16), (64, torch.float16)])
def test_structured_head_dims_dtypes(ops, d, dtype):
    p = problem([1536, 77], [1536 + 128, 77 + 384], hq=4, hkv=2, d=d, dtype=dtype, structure="mixed", seed=d)
    assert_identical(ops, p, 8)


def test_structured_top_p_one(ops):
    p = problem([900], [900 + 256], hq=4, hkv=1, structure="needles", seed=3)
    order, counts = kap(ops, p, 8, top_p=1.0)
    for g, _, last in helpers.diagonal_blocks(p):
        assert (counts[:, g] == last + 1).all()  # every candidate kept
    assert_identical(ops, p, 8, top_p=1.0)


# Any prefix (spec section 1): query blocks start at each sequence's first query, so where the prefix
# is not a multiple of 128 a query block's queries cross a key block's start. It then has two
# diagonal blocks, both forced into its list; the last one is a candidate whose first stride rows may
# see none of its keys (their maxima there are -inf), or that no row sees at all (P = 1 with a full
# query block: score 0). Prefixes 1, 100, 255 and 129 beside aligned ones in one batch, odd query
# lengths, prefixes that are not multiples of the stride, and a prefix of many column tiles.
UNALIGNED = [
    ([1], [1 + 1]),
    ([1000], [1000 + 100]),
    ([128, 333, 129, 200], [128 + 1, 333 + 255, 129 + 129, 200 + 256]),
    ([77, 641, 1], [77 + 128, 641 + 4001, 1 + 1023]),
]


def assert_lists_hold_both_diagonal_blocks(p, order, counts):
    order, counts = order.cpu(), counts.cpu()
    for g, first, last in helpers.diagonal_blocks(p):
        for h in range(order.shape[0]):
            listed = order[h, g, : int(counts[h, g])].tolist()
            assert {0, first, last} <= set(listed) and max(listed) == last, (h, g, first, last, listed)


@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("seqlens_q,seqlens_k", UNALIGNED)
@pytest.mark.parametrize("stride", [4, 8, 16])
def test_structured_identical_for_any_prefix(ops, stride, seqlens_q, seqlens_k, page_size):
    p = problem(seqlens_q, seqlens_k, hq=8, hkv=2, page_size=page_size, structure="mixed",
                seed=stride + page_size + len(seqlens_q))
    assert_identical(ops, p, stride)
    assert_lists_hold_both_diagonal_blocks(p, *kap(ops, p, stride))


@pytest.mark.parametrize("seqlens_q,seqlens_k", UNALIGNED)
def test_structured_top_p_one_for_any_prefix(ops, seqlens_q, seqlens_k):
    p = problem(seqlens_q, seqlens_k, hq=4, hkv=1, page_size=16, structure="needles", seed=len(seqlens_q))
    order, counts = kap(ops, p, 8, top_p=1.0)
    for g, _, last in helpers.diagonal_blocks(p):
        assert (counts[:, g] == last + 1).all()  # every candidate kept, the last diagonal block included
    assert_identical(ops, p, 8, top_p=1.0)


@pytest.mark.parametrize("seqlens_q,seqlens_k", UNALIGNED[1:])
@pytest.mark.parametrize("d,dtype", [(128, torch.bfloat16), (64, torch.float16)])
def test_fp8_structured_for_any_prefix(ops, d, dtype, seqlens_q, seqlens_k):
    p = problem(seqlens_q, seqlens_k, hq=8, hkv=2, d=d, dtype=dtype, page_size=16, structure="mixed", seed=d)
    assert_fp8_agrees(ops, p, 8)
    assert_lists_hold_both_diagonal_blocks(p, *kap(ops, p, 8, proxy_precision="fp8"))


# 300 queries and the most whole key blocks after them that stay below the threshold, then one more.
_BLOCKS_BELOW_THRESHOLD = (defaults.FP8_PROXY_MIN_KEYS - 300 - 1) // 128


@pytest.mark.parametrize("extra_key_blocks, resolved", [(_BLOCKS_BELOW_THRESHOLD, "native"),
                                                        (_BLOCKS_BELOW_THRESHOLD + 1, "fp8")])
def test_auto_proxy_switches_at_the_threshold(ops, extra_key_blocks, resolved):
    """The default proxy ("auto") is resolved on the device side from max_seqlen_k: its lists are
    the named proxy's, bit for bit, just below and at defaults.FP8_PROXY_MIN_KEYS keys, and not the
    other proxy's (top_p = 1 lists every candidate, so the two proxies' orders of the low scores
    tell them apart)."""
    p = problem([300], [300 + extra_key_blocks * 128], hq=2, hkv=1, page_size=128, structure="needles",
                seed=extra_key_blocks)
    assert (p["max_seqlen_k"] >= defaults.FP8_PROXY_MIN_KEYS) == (resolved == "fp8")
    order, counts = kap(ops, p, 8, top_p=1.0, proxy_precision="auto")
    named_order, named_counts = kap(ops, p, 8, top_p=1.0, proxy_precision=resolved)
    assert torch.equal(order, named_order) and torch.equal(counts, named_counts)
    other_order, _ = kap(ops, p, 8, top_p=1.0, proxy_precision={"native": "fp8", "fp8": "native"}[resolved])
    assert not torch.equal(order, other_order)


@pytest.mark.parametrize("key_blocks", [60, 100, 200, 400, 900])
def test_structured_long_lists(ops, key_blocks):
    """The warp select kernel is compiled per longest list (up to 64, 128, 256, 512 and 1024 key
    blocks): each version sorts its longest lists in full (top_p = 1) as the reference does. Among
    hundreds of low scores a few pairs differ by float rounding only (the kernel's fast exponentials
    and summation order against the reference's): there the two may list the pair either way. The
    native proxy throughout: from 200 key blocks the default would score e4m3 copies, whose coarse
    values tie far more often than rounding alone can break."""
    p = problem([300], [300 + (key_blocks - 3) * 128], hq=2, hkv=1, page_size=128, structure="needles",
                seed=key_blocks)
    order, counts = kap(ops, p, 8, top_p=1.0, proxy_precision="native")
    ref_order, ref_counts = R.kap(*kap_layout_args(p), stride=8, top_p=1.0, proxy_precision="native")
    assert_shapes(p, order, counts)
    assert int(counts.max()) == key_blocks and torch.equal(counts, ref_counts)
    scores, _ = R.kap_scores(*kap_layout_args(p), stride=8, proxy_precision="native")
    order, ref_order, scores = order.cpu(), ref_order.cpu(), scores.cpu()
    for g, _, _ in helpers.diagonal_blocks(p):
        for h in range(order.shape[0]):
            n = int(counts[h, g])
            got, want = order[h, g, :n].long(), ref_order[h, g, :n].long()
            assert sorted(got.tolist()) == sorted(want.tolist())
            differ = got != want
            assert int(differ.sum()) <= n // 100, f"{int(differ.sum())} of {n} positions differ"
            s_got, s_want = scores[h, g][got[differ]], scores[h, g][want[differ]]
            assert torch.allclose(s_got, s_want, rtol=1e-5, atol=0), "a listed position differs by more than rounding"


# Random inputs: valid lists under the reference's scores.
@pytest.mark.parametrize("stride", [4, 8, 16])
@pytest.mark.parametrize("seqlens_q,seqlens_k", [
    ([2048], [2048]),
    ([1000], [1000 + 512]),                      # not a multiple of 128 or of the stride; prefix
    ([300, 1, 129, 777], [300 + 256, 1, 129, 777 + 128]),  # varlen with a 1-token sequence
    ([200], [200 + 4096]),                       # long prefix: several column tiles per row
    ([1000, 129, 1], [1000 + 100, 129 + 255, 1 + 1]),  # prefixes that are not multiples of 128
])
def test_random_valid(ops, stride, seqlens_q, seqlens_k):
    p = problem(seqlens_q, seqlens_k, hq=8, hkv=2, page_size=16, seed=stride + len(seqlens_q))
    # HRM is exact float equality of block maxima: a row whose two largest block maxima lie within
    # float rounding of each other may flag a different block than the float32 reference does.
    assert_valid(ops, p, stride, max_invalid_fraction=0.01)


@pytest.mark.parametrize("top_p", [0.5, 0.9, 1.0])
def test_random_top_p(ops, top_p):
    p = problem([1200, 513], [1200 + 128, 513], hq=4, hkv=4, page_size=256, seed=11)
    assert_valid(ops, p, 8, top_p=top_p, max_invalid_fraction=0.01)


def test_scores_order_consistent(ops):
    """With top_p = 1 every candidate is listed in the kernel's score order: that order must agree
    with the reference scores up to the 1e-3 relative agreement the kernel promises."""
    p = problem([1500], [1500 + 640], hq=8, hkv=2, page_size=64, seed=5)
    order, counts = kap(ops, p, 8, top_p=1.0)
    scores, hrm = R.kap_scores(*kap_layout_args(p), stride=8)
    order, scores, hrm = order.cpu(), scores.cpu(), hrm.cpu()
    for g, _, last in helpers.diagonal_blocks(p):
        for h in range(order.shape[0]):
            lst = order[h, g, : last + 1].long()
            s, f = scores[h, g][lst], hrm[h, g][lst]
            same_group = f[1:] == f[:-1]
            assert (s[1:][same_group] <= s[:-1][same_group] * (1 + 1e-3)).all()


def test_padding_rows(ops):
    # 200, 100, 40 queries: 4 real query blocks, bound min(3 * 2, (340 + 3 * 127) // 128) = 5 rows.
    p = problem([200, 100, 40], [200, 100 + 128, 40], hq=4, hkv=2, page_size=16, structure="sinks", seed=2)
    order, counts = kap(ops, p, 8)
    assert order.shape[1] > 4
    assert_padding(p, order, counts)
    assert_identical(ops, p, 8)


def test_deterministic(ops):
    p = problem([3000], [3000], hq=8, hkv=1, page_size=128, seed=9)
    first = kap(ops, p, 8)
    for _ in range(3):
        again = kap(ops, p, 8)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_cuda_graph_capture(ops):
    p = problem([1000, 300], [1000 + 256, 300], hq=8, hkv=2, page_size=64, structure="mixed", seed=4)
    eager = kap(ops, p, 8)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kap(ops, p, 8)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.kap(*kap_layout_args(p), 8, defaults.TOP_P, None)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])


# The e4m3 proxy (spec section 2, proxy precision). Hopper's e4m3 wgmma adds its products in an
# accumulator narrower than fp32 (DeepSeek-V3's report measures about 14 mantissa bits), so kernel
# and reference scores differ by up to about 1e-3 relative, not by fp32 rounding: near-ties and
# borderline top-p cuts may differ on any input. The lists must be valid stage-1 lists under the
# reference's e4m3 scores within that slack, and keep nearly the same blocks.
FP8_TOL = 3e-3


def kept_set_iou(order, counts, ref_order, ref_counts):
    a, b = proxies.lists_to_mask(order, counts), proxies.lists_to_mask(ref_order, ref_counts)
    return float((a & b).sum() / (a | b).sum())


def assert_fp8_agrees(ops, p, stride, min_iou=0.99, tol=FP8_TOL, max_invalid_fraction=0.03):
    assert_valid(ops, p, stride, max_invalid_fraction=max_invalid_fraction, proxy_precision="fp8", tol=tol)
    order, counts = kap(ops, p, stride, proxy_precision="fp8")
    ref_order, ref_counts = R.kap(*kap_layout_args(p), stride=stride, proxy_precision="fp8")
    assert kept_set_iou(order, counts, ref_order, ref_counts) >= min_iou


@pytest.mark.parametrize("stride", [4, 8, 16])
@pytest.mark.parametrize("d,dtype", [(128, torch.bfloat16), (64, torch.bfloat16), (128, torch.float16)])
def test_fp8_structured(ops, stride, d, dtype):
    p = problem([1000, 333, 1], [1000 + 512, 333, 1 + 256], hq=8, hkv=2, d=d, dtype=dtype, page_size=32,
                structure="mixed", seed=stride + d)
    assert_fp8_agrees(ops, p, stride)


@pytest.mark.parametrize("seqlens_q,seqlens_k", [([2048], [2048]), ([300, 129, 777], [300 + 256, 129, 777 + 128]),
                                               ([300, 129, 777], [300 + 100, 129 + 1, 777 + 129])])
def test_fp8_random(ops, seqlens_q, seqlens_k):
    p = problem(seqlens_q, seqlens_k, hq=8, hkv=2, page_size=16, seed=len(seqlens_q))
    assert_fp8_agrees(ops, p, 8, min_iou=0.97)


def test_fp8_long_prefix_many_heads(ops):
    # Several column tiles per row, a KV head per query head, page 256.
    p = problem([200], [200 + 4096], hq=4, hkv=4, page_size=256, structure="needles", seed=12)
    assert_fp8_agrees(ops, p, 8)


# At 32K keys and 8 query heads KAP's launch gives each scoring CTA a unit of several column tiles
# (256 columns wide), so that a CTA's pipeline runs on from one column tile's epilogue into the next
# tile's loads: the production path, which the short problems above never take. The fp8 lists are
# held to a wider score slack here: rows of up to 256 candidates with planted needles carry proxy
# logits large enough that the e4m3 accumulator's relative error moves block scores by percents
# (H200: 258 of 2048 lists break the 0.3% slack, 61 a 1% one, 7 a 3% one, while every list's
# leading HRM blocks equal the reference's, the counts differ by at most one block and the kept
# sets overlap at IoU 0.992). A column tile read from the wrong stage or the wrong columns would
# move whole blocks' scores, not percents.
LONG_FP8_TOL = 3e-2


@pytest.mark.parametrize("prefix", [0, 1000])
@pytest.mark.parametrize("proxy_precision", ["native", "fp8"])
def test_long_sequence_units_of_several_column_tiles(ops, proxy_precision, prefix):
    p = problem([32768 - 37 - prefix], [32768 - 37], hq=8, hkv=2, page_size=128, structure="mixed", seed=32)
    if proxy_precision == "fp8":
        assert_fp8_agrees(ops, p, 8, tol=LONG_FP8_TOL, max_invalid_fraction=0.01)
    else:
        assert_valid(ops, p, 8, proxy_precision="native")


@pytest.mark.parametrize("proxy_precision", ["native", "fp8"])
def test_lists_of_a_head_do_not_depend_on_its_head_chunk(ops, proxy_precision):
    """Past 512 MB of block maxima the query heads are scored and selected in chunks, and each list
    is selected as soon as the scoring CTAs of its own row tile are done (one counter per query
    head and row tile, zeroed once per call). At 64K tokens and stride 4, 32 query heads make two
    chunks of 16: the second chunk's lists must be bitwise those of a call with its 16 heads alone
    (one chunk), for both scoring kernels (native: row-split; fp8: the query tile resident)."""
    p = problem([65536 - 45], [65536 - 45], hq=32, hkv=8, page_size=128, structure="mixed", seed=51)
    order, counts = kap(ops, p, 4, proxy_precision=proxy_precision)
    second = {**p, "q": p["q"][:, 16:].contiguous(), "k_cache": p["k_cache"][:, :, 4:].contiguous(),
              "v_cache": p["v_cache"][:, :, 4:].contiguous()}
    alone_order, alone_counts = kap(ops, second, 4, proxy_precision=proxy_precision)
    assert torch.equal(counts[16:], alone_counts)
    assert torch.equal(order[16:], alone_order)
    assert (counts > 0).all()  # one sequence, no padding rows: every list was written


def test_fp8_nan_poisons_its_block(ops):
    # A NaN in one key makes its whole 128-key block's proxy logits NaN on both paths.
    p = problem([640], [640], hq=4, hkv=2, page_size=64, structure="mixed", seed=13)
    page = int(p["page_table"][0, 300 // 64])
    p["k_cache"][page, 300 % 64, 1, 5] = float("nan")
    order, counts = kap(ops, p, 8, proxy_precision="fp8")
    ref_order, ref_counts = R.kap(*kap_layout_args(p), stride=8, proxy_precision="fp8")
    assert kept_set_iou(order, counts, ref_order, ref_counts) >= 0.99


@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_fp8_infinite_key_poisons_its_block(ops, value):
    """An infinite key makes its block's amax infinite: the whole block NaN, as in the reference (x * 448
    / inf is 0, times the infinite scale NaN). Taken as 0 times an infinite scale, its proxy maxima were
    NaN, and every later query block's list kept every candidate."""
    p = problem([640], [640], hq=4, hkv=2, page_size=64, structure="mixed", seed=13)
    page = int(p["page_table"][0, 300 // 64])
    p["k_cache"][page, 300 % 64, 1, 5] = value
    order, counts = kap(ops, p, 8, proxy_precision="fp8")
    ref_order, ref_counts = R.kap(*kap_layout_args(p), stride=8, proxy_precision="fp8")
    assert kept_set_iou(order, counts, ref_order, ref_counts) >= 0.99


# A key-range CTA folds 128 sampled keys, 1024 tokens (kap_quantize_kernel.cuh): the 4- and 34-block
# prefixes give sequence 0 two and five CTAs per KV head, whose ranges the atomics merge.
@pytest.mark.parametrize("d,page_size,hkv,prefix_blocks",
                         [(128, 16, 2, 4), (64, 128, 2, 4), (128, 128, 2, 34), (128, 128, 8, 34),
                          (128, 64, 16, 34)])
def test_fp8_lists_do_not_move_with_a_key_offset_per_channel(ops, d, page_size, hkv, prefix_blocks):
    """The kernel centres each sequence's keys per KV head and channel before the e4m3 quantisation
    (spec section 2), so an offset per (sequence, KV head, channel) leaves its lists bitwise as they
    were: values on a grid of 1/8 in float16, where adding the offset, the channel midpoints and the
    centring are all exact. Uncentred, or centred with another sequence's or head's range (or with a
    range that missed some of the sequence's sampled keys), the offset would change the e4m3 values."""
    # The cached prefix is a whole number of blocks.
    lens_q, lens_k = [700, 300], [700 + prefix_blocks * 128, 300]
    p = problem(lens_q, lens_k, hq=2 * hkv, hkv=hkv, d=d, page_size=page_size, dtype=torch.float16,
                structure="needles", seed=31)
    p["q"] = (p["q"] * 8).round() / 8
    p["k_cache"] = ((p["k_cache"] * 8).round() / 8).clamp(-100, 100)
    offset = torch.zeros(2, hkv, d, device="cuda", dtype=torch.float16)  # (sequence, KV head, channel)
    for b in range(2):
        for h in range(hkv):
            # A different set of channels and value for every (sequence, KV head).
            offset[b, h, (b + h) % 3::2 + (b + 2 * h) % 4] = (64.0, -96.0, -48.0, 80.0)[(2 * b + h) % 4]
    shifted_cache = p["k_cache"].clone()
    for b in range(2):
        pages = p["page_table"][b, : (lens_k[b] + page_size - 1) // page_size].long()
        shifted_cache[pages] += offset[b]
    shifted = {**p, "k_cache": shifted_cache}
    order, counts = kap(ops, p, 8, proxy_precision="fp8")
    shifted_order, shifted_counts = kap(ops, shifted, 8, proxy_precision="fp8")
    assert torch.equal(counts, shifted_counts)
    assert torch.equal(order, shifted_order)


@pytest.mark.parametrize("d,page_size", [(128, 16), (64, 64)])
def test_fp8_keys_centred_on_the_sampled_keys(ops, d, page_size, monkeypatch):
    """The centre comes from keys 0, 8, 16, ... alone (spec section 2). Here a key between two sampled
    ones, in key block 1, holds 2^24 in a channel that every query zeroes: centred on the sample,
    only block 1's amax is that large (its keys round to zero in e4m3); a centre from every key
    would shift that channel by 2^23 in every block and leave no block's scores. The kernel's lists
    must be the reference's, and far from those of the full-range centre (which shows that the case
    tells the two apart)."""
    p = problem([1900, 300], [1900 + 256, 300], hq=4, hkv=2, d=d, page_size=page_size, structure="needles", seed=3)
    p["q"][..., 5] = 0
    key = R.BLOCK + defaults.KEY_CENTRE_STRIDE // 2  # between two sampled keys
    for b in range(2):
        page = int(p["page_table"][b, key // page_size])
        p["k_cache"][page, key % page_size, :, 5] = 2.0**24
    assert_fp8_agrees(ops, p, 8)
    order, counts = kap(ops, p, 8, proxy_precision="fp8")
    monkeypatch.setattr(R, "key_centres", R.channel_midpoints)  # the range of every key
    full_order, full_counts = R.kap(*kap_layout_args(p), stride=8, proxy_precision="fp8")
    assert kept_set_iou(order, counts, full_order, full_counts) < 0.8


def first_sequence(p):
    """The problem made of the first sequence of ``p`` alone (the same queries, pages and keys)."""
    len_q, len_k = int(p["cu_seqlens_q"][1]), int(p["seqused_k"][0])
    return {**p, "q": p["q"][:len_q], "page_table": p["page_table"][:1].contiguous(),
            "cu_seqlens_q": p["cu_seqlens_q"][:2].clone(), "seqused_k": p["seqused_k"][:1].clone(),
            "max_seqlen_q": len_q, "max_seqlen_k": len_k}


@pytest.mark.parametrize("d", [128, 64])
def test_fp8_lists_of_a_sequence_do_not_depend_on_its_neighbours(ops, d):
    """The e4m3 copies hold each sequence's query and key blocks with zeros written past Lq and Lk,
    and at d = 128 the scoring kernel reads whole groups of s tokens of them as TMA boxes: a group
    that crosses Lq or Lk must see those zeros, not the next sequence's tokens nor what an earlier
    call left in the workspace. So a sequence's fp8 lists are bitwise the same alone, first in a
    batch, and after a call whose large values filled the rows that its padding occupies (the
    caching allocator hands the same workspace back). Lengths are multiples of neither 128 nor s."""
    both = problem([1001, 645], [1001 + 256, 645], hq=4, hkv=2, d=d, page_size=64, structure="mixed", seed=41)
    alone = first_sequence(both)
    order, counts = kap(ops, alone, 8, proxy_precision="fp8")
    blocks_q, blocks_k = counts.shape[1], order.shape[2]
    batch_order, batch_counts = kap(ops, both, 8, proxy_precision="fp8")
    assert torch.equal(batch_counts[:, :blocks_q], counts)
    assert torch.equal(batch_order[:, :blocks_q, :blocks_k], order)
    # Whole blocks of large keys and queries where `alone` has its padding, same workspace size.
    loud = problem([1024], [1280], hq=4, hkv=2, d=d, page_size=64, seed=42)
    loud = {**loud, "q": loud["q"] * 300, "k_cache": loud["k_cache"] * 300}
    kap(ops, loud, 8, proxy_precision="fp8")
    again_order, again_counts = kap(ops, alone, 8, proxy_precision="fp8")
    assert torch.equal(again_counts, counts)
    assert torch.equal(again_order, order)


def test_fp8_native_kept_sets_close(ops):
    """The fp8 proxy keeps nearly the blocks that the native one keeps (the bench measures this on
    real activations)."""
    p = problem([3000], [3000 + 1024], hq=8, hkv=2, page_size=64, structure="mixed", seed=14)
    native = kap(ops, p, 8)
    fp8 = kap(ops, p, 8, proxy_precision="fp8")
    assert kept_set_iou(*fp8, *native) >= 0.95


def test_explicit_softmax_scale(ops):
    p = problem([800], [800 + 128], hq=4, hkv=2, structure="needles", seed=6)
    scale = 0.5 / math.sqrt(128)
    order, counts = kap(ops, p, 8, softmax_scale=scale)
    ref_order, ref_counts = R.kap(*kap_layout_args(p), stride=8, softmax_scale=scale)
    assert torch.equal(order, ref_order) and torch.equal(counts, ref_counts)


def one_token_sequences(n):
    """`n` sequences of one query and one key each (d 64, one KV head, a 16-token page each)."""
    cuda = {"device": "cuda"}
    return {"q": torch.randn(n, 1, 64, dtype=torch.bfloat16, **cuda),
            "k_cache": torch.randn(n, 16, 1, 64, dtype=torch.bfloat16, **cuda),
            "page_table": torch.arange(n, dtype=torch.int32, **cuda)[:, None],
            "cu_seqlens_q": torch.arange(n + 1, dtype=torch.int32, **cuda),
            "seqused_k": torch.ones(n, dtype=torch.int32, **cuda),
            "max_seqlen_q": 1, "max_seqlen_k": 1}


def test_the_scoring_grid_bound_is_an_argument_error(ops):
    """KAP launches one scoring tile per sequence at least, along a grid dimension that CUDA caps at
    65535: 65535 sequences run (each list holds its one causal block), 65536 are refused naming the
    batch, where the launch failed with an invalid configuration."""
    order, counts = kap(ops, one_token_sequences(65535), 8)
    assert bool((counts == 1).all()) and bool((order[:, :, 0] == 0).all())
    with pytest.raises(ValueError, match=r"cosa\.kap: the batch of 65536 sequences \(cu_seqlens_q\) needs 65536 KAP "
                                         r"scoring tiles of 128 rows at stride 8, more than CUDA's 65535"):
        kap(ops, one_token_sequences(65536), 8)
