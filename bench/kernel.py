#!/usr/bin/env python3
"""Kernel microbenchmark: one attention layer (batch 1, Hq 32, Hkv 8, d 128, bf16, causal,
page size 128) at several context lengths, CoSA's kernels side by side with the dense anchors
(SDPA flash and cuDNN) and the block-sparse peer (FlexAttention on identical block lists).

Rows (bench/README.md says what each one means and how the derived numbers are defined):
  dense  sdpa-flash, sdpa-cudnn, fa4                 anchors, every causal block
  flex   dense, random-<B>%                          BlockMask.from_kv_blocks on explicit lists (Triton)
  flex   flash-dense, flash-random-<B>%              the same BlockMask, FLASH backend (FA4's kernel)
  osk    dense, random-<B>%                          the same lists, skip off (delta = 0)
  osk    dense-skipon-<v>, random-<B>%-skipon-<v>    the same lists, skip on but nothing skipped
                                                     (delta 1e-30): the skip machinery's cost
  osk    skipcost-full / -first / -skip-<v>          the cost of an in-kernel skipped block
  osk    causal+skip-<v>                             every causal block, ascending, delta 2000, structured input
  kap    default                                     KAP as the vLLM backend runs it: cosa.kap's defaults, device
                                                     checks off; with FA4, its share of FA4 dense in paired rounds
  kap    stride-<s>[-fp8][-unchecked|-graph]         the whole proxy (scores, sort, top-p, lists); -fp8: e4m3 proxy
  cosa   prefill-<v>[-unchecked]                     KAP + OSK with skip, structured input
(<v>: the vote scope of the skip, tile or warpgroup; -unchecked: with cosa.set_device_checks(False),
i.e. without the ops' checks of index-tensor contents and their one host synchronisation per call;
-graph: replayed from a CUDA graph, so without any host work: the GPU time of the kernels alone.
The stride-<s>[-fp8] rows also hold stages_ms: each KAP kernel's time per call under torch.profiler;
the kap/default row holds frac_of_fa4_paired, its time over FA4 dense's in interleaved rounds on the
same inputs, when FA4 runs; the osk list rows hold skip_tax_paired (skip-on rows) and x_peer_paired
(skip-off row: FA4 dense's time over OSK's on the causal lists, Flex FLASH's on the random ones), each
from interleaved rounds.)
Every row carries "heads": "<Hq>/<Hkv>". --heads runs the sections once per head configuration (the
query and KV heads of one layer, or of one tensor-parallel rank's share of it; --heads all: the
configurations of HEAD_CONFIGS); each row's speed-ups are against the anchors of its own configuration.
The osk/kap/cosa rows appear only when torch.ops.cosa has CUDA kernels; the fa4 and flash-* rows
only where FlashAttention-4 (the flash-attn-4 package) is installed and runs. Every attention row
is checked in the same run against a float32 reference restricted to the same block lists.

    python bench/kernel.py [--n 8192 32768 65536 131072] [--budgets 0.25 0.5 0.75 1.0]
                           [--strides 4 8 16] [--only dense,flex,osk,kap,cosa] [--page-size 128]
                           [--heads 32/8 12/2 ... | all]
                           [--quick] [--plot] [--out bench/results]

--page-size sets the KV cache's page size of the CoSA rows (a power of two in [16, 256]; vLLM's
default block size is 16); the dense and FlexAttention peers read contiguous tensors either way.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (REPO_ROOT, Rotation, argument_parser, finish_report, format_table, interleaved_ms,  # noqa: E402
                    paired_ratio, paired_ratio_quartiles, progress, quartiles, record_kap_stages, relative_error,
                    save_figure, require_cuda, results_path, run_metadata, time_ms, write_json)

BLOCK = 128
CONFIG = {"batch": 1, "hq": 32, "hkv": 8, "d": 128, "dtype": "bfloat16", "page_size": 128}
DTYPE = torch.bfloat16
DEVICE = "cuda"
SECTIONS = ("dense", "flex", "osk", "kap", "cosa")
DEFAULT_N = (8192, 32768, 65536, 131072)
QUICK_N = (2048, 4096)
# Head configurations of --heads all: whole layers (Qwen2.5-Coder-1.5B 12/2, 7B 28/4, Llama-3-8B 32/8,
# Llama-3-70B 64/8) and one tensor-parallel rank's share of them (12/2 over 2 and 4 ranks: 6/1, 3/1 with
# the KV head replicated; 32/8 over 2, 4, 8: 16/4, 8/2, 4/1).
HEAD_CONFIGS = ((12, 2), (28, 4), (32, 8), (64, 8), (6, 1), (3, 1), (4, 1), (8, 2), (16, 4))
SKIP_DELTA = 2000.0  # the paper's Qwen3-8B operating point, CoSA's default
# The skip on, yet no block skipped: tau = ln(delta / N) is about -79 at 32K, far below any gap
# between a block's row maximum and the running maximum on these inputs. Rows at this delta time
# the skip machinery (the vote, its synchronisation) on blocks that are all computed.
NO_SKIP_DELTA = 1e-30
VOTES = ("tile", "warpgroup")  # who decides a skip together: all 128 rows of a tile, or each 64-row half
# Planted amplitude for the skip-cost input: a block-0 logit of about sigma * A^2 = 22.6 against
# about 5 for the best random key, a margin far past |tau| = ln(N / delta) <= 4.2 at N <= 128K,
# so every block after block 0 is skipped.
DOMINANT_AMPLITUDE = 16.0
TABLE_COLUMNS = ("kind", "impl", "n", "heads", "budget", "realised", "delta", "vote", "ms", "tflops", "x_cudnn",
                 "x_fa4", "frac_of_cudnn", "frac_of_fa4", "rel_err", "note")
FA4_COLUMNS = ("x_fa4", "frac_of_fa4")  # in the table only when the run has an fa4 row


# ---------------------------------------------------------------------------------------------
# Block lists: order [Hq, nq, nk] int32 (list, then -1), counts [Hq, nq] int32, batch 1, no prefix
# ---------------------------------------------------------------------------------------------


# Interleaved rounds of the paired KAP / FA4 share (Bench.kap_share_of_fa4).
PAIRED_ROUNDS = 7


def heads_label() -> str:
    """The head configuration being run, as rows record it: ``"<Hq>/<Hkv>"``."""
    return f"{CONFIG['hq']}/{CONFIG['hkv']}"


def parse_heads(text: str) -> list[tuple[int, int]]:
    """``--heads``: ``"12/2"`` -> ``[(12, 2)]``; ``"all"`` -> HEAD_CONFIGS."""
    if text == "all":
        return list(HEAD_CONFIGS)
    try:
        hq, hkv = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a head configuration is <query heads>/<KV heads> or all, got {text!r}") \
            from None
    if hq < 1 or hkv < 1 or hq % hkv:
        raise argparse.ArgumentTypeError(f"query heads must be a positive multiple of the KV heads, got {text!r}")
    return [(hq, hkv)]


def causal_lists(nq: int, hq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every causal block of every query block, ascending (the same lists as
    cosa.reference.causal_order for one sequence without prefix)."""
    j = torch.arange(nq, device=device, dtype=torch.int32)
    order = torch.where(j[None, :] <= j[:, None], j[None, :], -1)
    return (order.unsqueeze(0).expand(hq, nq, nq).contiguous(),
            (j + 1).unsqueeze(0).expand(hq, nq).contiguous())


def random_lists(nq: int, hq: int, budget: float, generator: torch.Generator):
    """Per (head, query block i): round(budget * (i + 1)) causal blocks, at least block 0 and the
    diagonal block i, the others drawn uniformly without replacement; ascending."""
    device = generator.device
    i = torch.arange(nq, device=device)
    keys = torch.rand((hq, nq, nq), generator=generator, device=device)
    forced = (i[None, :] == 0) | (i[None, :] == i[:, None])
    keys = torch.where(forced, -1.0, keys)               # forced blocks sort first
    keys = torch.where(i[None, :] > i[:, None], 2.0, keys)  # non-causal blocks sort last
    ranked = keys.argsort(dim=-1)
    del keys
    counts = torch.maximum(torch.round(budget * (i + 1)), torch.clamp(i + 1, max=2)).clamp(max=i + 1)
    keep = i[None, None, :] < counts[None, :, None]
    chosen = torch.where(keep, ranked, nq).sort(dim=-1).values
    order = torch.where(chosen == nq, -1, chosen).to(torch.int32)
    return order, counts.to(torch.int32).unsqueeze(0).expand(hq, nq).contiguous()


def skipped_blocks(skipped: torch.Tensor) -> float:
    """Blocks whose P V work OSK skipped: its ``skipped`` output counts 64-row halves of tiles (a
    block skipped by the whole tile counts 2), whichever the vote scope."""
    return int(skipped.sum()) / 2


def block_flops(counts: torch.Tensor, skipped: torch.Tensor | None = None) -> float:
    """FLOPs of the blocks a kernel computes: 4 * 128 * 128 * d per block (QK^T and PV), the
    diagonal block of each non-empty row counted as half (it is causal-masked), a skipped half
    block as half a block."""
    computed = int(counts.sum()) - (skipped_blocks(skipped) if skipped is not None else 0)
    diagonals = int((counts > 0).sum())
    return 4.0 * BLOCK * BLOCK * CONFIG["d"] * (computed - 0.5 * diagonals)


def causal_blocks(nq: int, hq: int) -> int:
    return hq * nq * (nq + 1) // 2


# ---------------------------------------------------------------------------------------------
# Float32 reference on sampled query blocks, restricted to a block list
# ---------------------------------------------------------------------------------------------


def sampled_blocks(nq: int) -> list[int]:
    """Query blocks checked against the float32 reference: first, two inner, last (all heads).
    The last one sees every key, so an error anywhere along the sequence shows up."""
    return sorted({0, nq // 3, (2 * nq) // 3, nq - 1})


def reference_rows(q, k, v, order, counts, blocks, scale):
    """Float32 attention of query blocks `blocks` (every head) over the key blocks listed in
    order/counts, causal inside the diagonal block. q [N, Hq, d]; k, v [N, Hkv, d] (contiguous,
    batch 1, no prefix). Returns [len(blocks) * 128, Hq, d] float32 (rows past N dropped)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    outs = []
    for i in blocks:
        r0, r1 = i * BLOCK, min(n, (i + 1) * BLOCK)
        end = r1  # causal: no key past the last query of the block
        qi = q[r0:r1].float().permute(1, 0, 2).reshape(hkv, group, r1 - r0, d)
        ki = k[:end].float().permute(1, 2, 0)  # [Hkv, d, end]
        vi = v[:end].float().permute(1, 0, 2)  # [Hkv, end, d]
        s = scale * torch.matmul(qi, ki.unsqueeze(1))  # [Hkv, G, rows, end]
        listed = order[:, i, :].long()
        hits = torch.zeros((hq, i + 1), dtype=torch.int32, device=q.device)
        hits.scatter_add_(1, listed.clamp(min=0)[:, : i + 1],
                          (listed[:, : i + 1] >= 0).to(torch.int32))
        allowed = (hits > 0).repeat_interleave(BLOCK, dim=1)[:, :end].reshape(hkv, group, 1, end)
        key_pos = torch.arange(end, device=q.device)
        causal = key_pos[None, :] <= torch.arange(r0, r1, device=q.device)[:, None]
        s = s.masked_fill(~(allowed & causal), -math.inf)
        p = torch.softmax(s, dim=-1)
        del s
        o = torch.matmul(p, vi.unsqueeze(1))  # [Hkv, G, rows, d]
        outs.append(o.reshape(hq, r1 - r0, d).permute(1, 0, 2))
        del p
    return torch.cat(outs)


def rows_of(out: torch.Tensor, blocks, n: int) -> torch.Tensor:
    """The rows of `out [N, Hq, d]` that reference_rows computes."""
    return torch.cat([out[i * BLOCK:min(n, (i + 1) * BLOCK)] for i in blocks])


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


@dataclass
class InputSet:
    """One input of one size in every layout a row needs (views share storage)."""
    q: torch.Tensor                    # [N, Hq, d]
    k: torch.Tensor                    # [N, Hkv, d]
    v: torch.Tensor
    k_rep: torch.Tensor | None = None  # [N, Hq, d]: cuDNN has no GQA path in SDPA
    v_rep: torch.Tensor | None = None
    flex_qkv: tuple | None = None      # contiguous [1, H, N, d] copies, FlexAttention's own layout
    k_cache: torch.Tensor | None = None  # [pages, 128, Hkv, d], pages shuffled
    v_cache: torch.Tensor | None = None
    page_table: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    seqused_k: torch.Tensor | None = None

    @staticmethod
    def bhsd_view(t: torch.Tensor) -> torch.Tensor:
        """[N, H, d] viewed as SDPA's [1, H, N, d]; the token-major storage is what FlashAttention
        and cuDNN read natively."""
        return t.transpose(0, 1).unsqueeze(0)


def random_set(n: int, seed: int, want_repeated: bool, want_flex: bool, want_paged: bool,
               cosa_mod) -> InputSet:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    hq, hkv, d = CONFIG["hq"], CONFIG["hkv"], CONFIG["d"]
    s = InputSet(q=torch.randn((n, hq, d), generator=gen, device=DEVICE, dtype=DTYPE),
                 k=torch.randn((n, hkv, d), generator=gen, device=DEVICE, dtype=DTYPE),
                 v=torch.randn((n, hkv, d), generator=gen, device=DEVICE, dtype=DTYPE))
    if want_repeated:
        s.k_rep = s.k.repeat_interleave(hq // hkv, dim=1)
        s.v_rep = s.v.repeat_interleave(hq // hkv, dim=1)
    if want_flex:
        s.flex_qkv = tuple(s.bhsd_view(t).contiguous() for t in (s.q, s.k, s.v))
    if want_paged:
        attach_paged(s, n, seed, cosa_mod)
    return s


def attach_paged(s: InputSet, n: int, seed: int, cosa_mod) -> None:
    """The paged layout of one sequence of ``n`` tokens, on the tensors' device, pages shuffled."""
    s.k_cache, s.v_cache, s.page_table = cosa_mod.testing.paged_kv(
        s.k, s.v, [n], CONFIG["page_size"], shuffle=True,
        generator=torch.Generator().manual_seed(seed))
    s.cu_seqlens_q = torch.tensor([0, n], dtype=torch.int32, device=s.q.device)
    s.seqused_k = torch.tensor([n], dtype=torch.int32, device=s.q.device)


def structured_set(n: int, seed: int, cosa_mod) -> InputSet:
    """cosa.testing.random_problem(structure="mixed"): sinks, a local band and needles."""
    p = cosa_mod.testing.random_problem([n], [n], CONFIG["hq"], CONFIG["hkv"], CONFIG["d"],
                                        CONFIG["page_size"], DTYPE, DEVICE, structure="mixed",
                                        seed=seed)
    gather = cosa_mod.reference.gather_kv
    return InputSet(q=p["q"], k=gather(p["k_cache"], p["page_table"], 0, n),
                    v=gather(p["v_cache"], p["page_table"], 0, n), k_cache=p["k_cache"],
                    v_cache=p["v_cache"], page_table=p["page_table"],
                    cu_seqlens_q=p["cu_seqlens_q"], seqused_k=p["seqused_k"])


def dominant_first_block_set(base: InputSet, n: int, seed: int, cosa_mod) -> InputSet:
    """Random q, k, v with key block 0 planted so that its logits dominate every query's: each
    query gets +A*u_g (u_g a unit vector per KV head g), keys lose their u_g component except
    block 0, which becomes A*u_g plus a little noise. OSK with skip on then skips every block
    that follows block 0 in an ascending list."""
    hq, hkv, d = CONFIG["hq"], CONFIG["hkv"], CONFIG["d"]
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 7919)
    u = torch.nn.functional.normalize(torch.randn((hkv, d), generator=gen, device=DEVICE), dim=-1)
    q = base.q.float() + DOMINANT_AMPLITUDE * u.repeat_interleave(hq // hkv, dim=0)
    k = base.k.float()
    k = k - (k * u).sum(-1, keepdim=True) * u
    k[:BLOCK] = DOMINANT_AMPLITUDE * u + 0.1 * k[:BLOCK]
    s = InputSet(q=q.to(DTYPE), k=k.to(DTYPE), v=base.v)
    attach_paged(s, n, seed, cosa_mod)
    return s


def set_bytes(n: int, repeated: bool, flex: bool, paged: bool) -> int:
    hq, hkv, d = CONFIG["hq"], CONFIG["hkv"], CONFIG["d"]
    per_token = (hq * d + 2 * hkv * d) * (2 if flex else 1) + (2 * hq * d if repeated else 0) \
        + (2 * hkv * d if paged else 0)
    return 2 * n * per_token


# ---------------------------------------------------------------------------------------------
# Implementations
# ---------------------------------------------------------------------------------------------


def sdpa(backend, q4, k4, v4, gqa: bool, scale: float | None = None):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=gqa, scale=scale)


def one_line(error: BaseException) -> str:
    """An exception as one short line (compiler errors run to pages)."""
    return f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"


def guarded(failures: list[str], label: str, fn, *args) -> None:
    """Run one group of rows; a failure (an out-of-memory, a kernel error) is reported on stderr and
    listed in ``failures``, and the run goes on with the next group."""
    try:
        fn(*args)
    except Exception as error:  # noqa: BLE001  (report and continue: one bad row must not end a long run)
        message = f"{label}: {one_line(error)}"
        failures.append(message)
        progress("  FAILED " + message)
        traceback.print_exc(file=sys.stderr)


def load_fa4():
    """``(flash_attn_func, None)`` of FlashAttention-4 (package flash-attn-4, CuTe DSL), or
    ``(None, why not)``: an optional peer, never needed by the project."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as error:  # noqa: BLE001  (ImportError, or a CuTe DSL that fails to load: same verdict)
        return None, f"flash_attn.cute (package flash-attn-4) is not importable: {one_line(error)}"
    return flash_attn_func, None


def fa4_dense(fa4, q, k, v, softmax_scale: float | None = None) -> torch.Tensor:
    """Causal FA4 on token-major ``q [N, Hq, d]``, ``k, v [N, Hkv, d]`` (GQA native): ``[N, Hq, d]``.
    Its first call of a shape compiles the kernel (seconds)."""
    result = fa4(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), softmax_scale=softmax_scale, causal=True)
    out = result[0] if isinstance(result, tuple) else result  # some versions also return the LSE
    return out[0]


_FLEX = None


def causal_mask_mod(b, h, q_idx, kv_idx):
    """Flex mask of the partial (diagonal) blocks; one module-level function so that every
    BlockMask carries the same mask_mod and the compiled kernel is reused."""
    return q_idx >= kv_idx


def flex_attention_compiled():
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention
        # Static shapes: one compile per context length (a few seconds each), each kernel
        # specialised to its length, as a serving engine that compiles per bucket would run it.
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def flex_block_mask(order: torch.Tensor, counts: torch.Tensor):
    """BlockMask with the diagonal block as the one partial (causal-masked) block of each row and
    the rest of the list as full blocks. Needs ascending lists ending with the diagonal."""
    from torch.nn.attention.flex_attention import BlockMask
    hq, nq, nk = order.shape
    diagonal = torch.arange(nq, device=order.device, dtype=torch.int32)
    last = order.gather(2, (counts - 1).clamp(min=0).long().unsqueeze(-1)).squeeze(-1)
    if not torch.equal(last, diagonal.expand(hq, nq)):
        raise ValueError("flex_block_mask needs ascending lists that end with the diagonal block")
    partial_idx = torch.zeros((1, hq, nq, nk), dtype=torch.int32, device=order.device)
    partial_idx[..., 0] = diagonal
    return BlockMask.from_kv_blocks(
        torch.ones((1, hq, nq), dtype=torch.int32, device=order.device), partial_idx,
        (counts - 1).unsqueeze(0).contiguous(), order.clamp(min=0).unsqueeze(0).contiguous(),
        BLOCK_SIZE=BLOCK, mask_mod=causal_mask_mod)


def graph_of(fn):
    """``fn`` captured in a CUDA graph (after a warm-up call on a side stream, as capture needs);
    returns the replay. The ops skip their device-data checks while captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


FLASH_BACKEND = {"BACKEND": "FLASH"}  # FlexAttention's kernel_options for FA4's CuTe kernel


def osk_call(cosa_mod, s: InputSet, order, counts, n: int, delta: float, vote: str | None = None):
    """``cosa.osk`` on one input set. ``vote=None`` keeps the op's default scope: the rows with the
    skip off (delta 0), where no vote is taken."""
    scope = {} if vote is None else {"vote": vote}
    return cosa_mod.osk(s.q, s.k_cache, s.v_cache, s.page_table, s.cu_seqlens_q, s.seqused_k, order, counts,
                        n, delta=delta, **scope)


def load_cosa():
    """(cosa module or None, {op: None if it has a working CUDA kernel else the reason})."""
    reasons = {op: "cosa is not importable" for op in ("osk", "kap", "prefill")}
    sys.path.insert(0, str(REPO_ROOT))
    try:
        import cosa
    except (ImportError, OSError, RuntimeError) as error:
        return None, {op: f"import cosa failed: {error}" for op in reasons}
    if not getattr(cosa, "_C_AVAILABLE", False):
        return cosa, {op: f"cosa._C not built ({cosa._C_IMPORT_ERROR})" for op in reasons}
    probe = cosa.testing.random_problem([256], [256], 4, 1, CONFIG["d"], CONFIG["page_size"], DTYPE,
                                        DEVICE, seed=1)
    args = (probe["q"], probe["k_cache"], probe["v_cache"], probe["page_table"],
            probe["cu_seqlens_q"], probe["seqused_k"])
    order, counts = cosa.reference.causal_order(probe["cu_seqlens_q"], probe["seqused_k"], 4, 256, 256, 256)
    calls = {
        "osk": lambda: cosa.osk(*args, order, counts, 256, delta=0.0),
        "kap": lambda: cosa.kap(args[0], args[1], args[3], args[4], args[5], 256, 256),
        "prefill": lambda: cosa.prefill(*args, 256, 256, delta=SKIP_DELTA),
    }
    for op, call in calls.items():
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"cosa::{op}", "CUDA"):
            reasons[op] = f"cosa::{op} has no CUDA kernel registered"
            continue
        try:
            call()
            torch.cuda.synchronize()
            reasons[op] = None
        except (NotImplementedError, RuntimeError, AttributeError) as error:
            reasons[op] = f"cosa::{op} probe failed: {str(error).splitlines()[0]}"
    return cosa, reasons


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


@dataclass
class Lists:
    """One set of block lists and what every row timed on it shares."""
    impl: str              # "dense" (every causal block) or "random-<B>%"
    order: torch.Tensor    # [Hq, nq, nk] int32, ascending, -1 after the list
    counts: torch.Tensor   # [Hq, nq] int32
    ref: torch.Tensor      # float32 reference rows (reference_rows) over exactly these lists
    budget: float          # sum(counts) / causal blocks
    flops: float           # block_flops(counts)


class Bench:
    def __init__(self, args, meta, cosa_mod, reasons, json_path, fa4=None, peer_reasons=None):
        self.args = args
        self.meta = meta
        self.cosa = cosa_mod
        self.reasons = reasons
        self.json_path = json_path
        self.fa4 = fa4
        # Optional peers ("fa4", "flex-flash"): None while they run, else why their rows are left out.
        self.peer_reasons = dict(peer_reasons or {})
        self.rows: list[dict] = []
        self.failures: list[str] = []
        self.scale = 1.0 / math.sqrt(CONFIG["d"])

    def want(self, section: str) -> bool:
        return section in self.args.only

    def has(self, op: str) -> bool:
        return self.reasons.get(op) is None

    def peer_runs(self, peer: str) -> bool:
        return self.peer_reasons.get(peer) is None

    def drop_peer(self, peer: str, error: BaseException) -> None:
        """An optional peer's call failed: one line on stderr, its rows left out from here on."""
        self.peer_reasons[peer] = one_line(error)
        progress(f"{peer}: rows left out ({self.peer_reasons[peer]})")

    def add(self, kind, impl, n, ms, flops=None, budget=None, delta=None, rel_err=None, **extra):
        row = {"kind": kind, "impl": impl, "n": n, "heads": heads_label(), "budget": budget, "delta": delta,
               "ms": ms, "tflops": (flops / (ms * 1e-3) / 1e12) if flops is not None else None,
               "rel_err": rel_err, **extra}
        self.rows.append(row)
        parts = [f"{kind}/{impl} n={n} heads {row['heads']}", f"{ms:.3f} ms"]
        if row["tflops"] is not None:
            parts.append(f"{row['tflops']:.0f} TFLOP/s")
        if rel_err is not None:
            parts.append(f"rel_err {rel_err:.2e}")
        progress("  " + ", ".join(parts))
        return row

    def guarded(self, label: str, fn, *a):
        guarded(self.failures, label, fn, *a)

    def save(self):
        left_out = {peer: why for peer, why in self.peer_reasons.items() if why is not None}
        write_json(self.json_path, {**self.meta, "config": CONFIG, "rows": self.rows,
                                    "failures": self.failures, "peers_left_out": left_out})

    # -- one context length -------------------------------------------------------------------

    def run_size(self, n: int):
        hq = CONFIG["hq"]
        nq = -(-n // BLOCK)
        progress(f"n={n}: inputs")
        paged = self.cosa is not None and any(self.want(op) and self.has(op) for op in ("osk", "kap"))
        repeated = self.want("dense")
        sets = Rotation(lambda i: random_set(n, 1000 * i + n, repeated, self.want("flex"), paged, self.cosa),
                        set_bytes(n, repeated, self.want("flex"), paged))
        ctx = {"sets": sets, "blocks": sampled_blocks(nq), "nq": nq, "n": n}
        ctx["causal"] = causal_lists(nq, hq, DEVICE)
        ctx["ref_dense"] = reference_rows(sets.first.q, sets.first.k, sets.first.v, *ctx["causal"],
                                          ctx["blocks"], self.scale)
        if self.want("dense"):
            self.guarded(f"dense n={n}", self.dense_rows, ctx)
        if self.want("flex") or (paged and self.want("osk")):
            for budget in self.args.budgets:
                self.guarded(f"lists {budget:g} n={n}", self.list_rows, ctx, budget)
        if paged and self.want("osk") and self.has("osk"):
            self.guarded(f"osk skip cost n={n}", self.skip_cost_rows, ctx)
        ctx.pop("dense_out", None)
        if self.cosa is not None and ((self.want("osk") and self.has("osk"))
                                      or (self.want("cosa") and self.has("prefill"))):
            self.guarded(f"structured n={n}", self.structured_rows, ctx)
        if self.want("kap") and self.cosa is not None and self.has("kap"):
            self.guarded(f"kap n={n}", self.kap_rows, ctx)
        del ctx, sets
        gc.collect()
        torch.cuda.empty_cache()

    def dense_rows(self, ctx):
        n, sets, blocks = ctx["n"], ctx["sets"], ctx["blocks"]
        flops = 4.0 * CONFIG["hq"] * CONFIG["d"] * n * n / 2
        first = sets.first
        # Flash: native GQA when this torch's flash backend takes enable_gqa, else repeated heads.
        try:
            flash_args = lambda s: (s.bhsd_view(s.q), s.bhsd_view(s.k), s.bhsd_view(s.v), True)  # noqa: E731
            out = sdpa(SDPBackend.FLASH_ATTENTION, *flash_args(first))
            flash_note = "enable_gqa"
        except RuntimeError:
            flash_args = lambda s: (s.bhsd_view(s.q), s.bhsd_view(s.k_rep), s.bhsd_view(s.v_rep), False)  # noqa: E731
            flash_note = "repeated kv heads"
            out = sdpa(SDPBackend.FLASH_ATTENTION, *flash_args(first))
        err = relative_error(rows_of(out[0].transpose(0, 1), blocks, n), ctx["ref_dense"])
        del out
        ms = time_ms(lambda: sdpa(SDPBackend.FLASH_ATTENTION, *flash_args(sets.take())))
        self.add("dense", "sdpa-flash", n, ms, flops, budget=1.0, rel_err=err, note=flash_note)

        cudnn_args = lambda s: (s.bhsd_view(s.q), s.bhsd_view(s.k_rep), s.bhsd_view(s.v_rep), False)  # noqa: E731
        out = sdpa(SDPBackend.CUDNN_ATTENTION, *cudnn_args(first))
        ctx["dense_out"] = out[0].transpose(0, 1)  # [N, Hq, d] view, kept for OSK dense mode
        err = relative_error(rows_of(ctx["dense_out"], blocks, n), ctx["ref_dense"])
        ms = time_ms(lambda: sdpa(SDPBackend.CUDNN_ATTENTION, *cudnn_args(sets.take())))
        self.add("dense", "sdpa-cudnn", n, ms, flops, budget=1.0, rel_err=err, note="repeated kv heads")
        if self.fa4 is not None and self.peer_runs("fa4"):
            self.fa4_row(ctx, flops)

    def fa4_row(self, ctx, flops: float):
        """FlashAttention-4 dense on the token-major tensors (native GQA). An optional peer: when its
        first call (which also compiles the kernel for this shape, untimed) fails, its rows are left
        out."""
        n, sets, blocks = ctx["n"], ctx["sets"], ctx["blocks"]
        run = lambda s: fa4_dense(self.fa4, s.q, s.k, s.v)  # noqa: E731
        progress(f"  fa4 n={n}: first call (compiles this shape)")
        out = self.peer_first_call("fa4", run, sets.first)
        if out is None:
            return
        err = relative_error(rows_of(out, blocks, n), ctx["ref_dense"])
        del out
        ms = time_ms(lambda: run(sets.take()))
        self.add("dense", "fa4", n, ms, flops, budget=1.0, rel_err=err, note="flash_attn.cute, native GQA")

    def peer_first_call(self, peer: str, run, first):
        """The first call of an optional peer (it compiles the shape; untimed), or None when it
        fails: the peer's rows are then left out, and the run goes on."""
        try:
            out = run(first)
            torch.cuda.synchronize()
            return out
        except Exception as error:  # noqa: BLE001  (an optional peer must not fail the run)
            self.drop_peer(peer, error)
            return None

    def list_rows(self, ctx, budget: float):
        """Flex and OSK on one set of lists: the causal lists at budget 1, else random lists."""
        lists = self.lists_at(ctx, budget)
        flex_out, flex_flash_run = self.flex_rows(ctx, lists) if self.want("flex") else (None, None)
        if self.want("osk") and self.has("osk") and ctx["sets"].first.k_cache is not None:
            # The peer OSK's targets are stated against: FA4 dense for every causal block, FlexAttention's
            # FLASH backend (FA4's kernel) on the same BlockMask for the random lists.
            if lists.impl == "dense":
                peer = ("fa4", self.fa4_run(ctx)) if self.fa4 is not None and self.peer_runs("fa4") else None
            else:
                peer = ("flex-flash", flex_flash_run) if flex_flash_run is not None else None
            self.osk_list_rows(ctx, lists, flex_out, peer)

    def lists_at(self, ctx, budget: float) -> Lists:
        n, nq, blocks = ctx["n"], ctx["nq"], ctx["blocks"]
        hq = CONFIG["hq"]
        if budget >= 1.0:
            order, counts = ctx["causal"]
            impl, ref = "dense", ctx["ref_dense"]
        else:
            gen = torch.Generator(device=DEVICE).manual_seed(int(budget * 1e6) + n)
            order, counts = random_lists(nq, hq, budget, gen)
            impl = f"random-{budget * 100:g}%"
            first = ctx["sets"].first
            ref = reference_rows(first.q, first.k, first.v, order, counts, blocks, self.scale)
        return Lists(impl, order, counts, ref, int(counts.sum()) / causal_blocks(nq, hq), block_flops(counts))

    def flex_rows(self, ctx, lists: Lists):
        """FlexAttention on the lists with its Triton kernel, then with the FLASH backend (FA4's CuTe
        kernel, an optional peer) on the same BlockMask. Returns the Triton output [N, Hq, d] and the
        FLASH backend's call on an input set (None where it does not run)."""
        n, sets, blocks = ctx["n"], ctx["sets"], ctx["blocks"]
        mask = flex_block_mask(lists.order, lists.counts)
        flex = flex_attention_compiled()
        run = lambda s: flex(*s.flex_qkv, block_mask=mask, enable_gqa=True)  # noqa: E731
        if "flex_compiled" not in ctx:
            progress(f"  flex n={n}: first call (torch.compile traces and compiles this shape)")
            ctx["flex_compiled"] = True
        out = run(sets.first)[0].transpose(0, 1)
        err = relative_error(rows_of(out, blocks, n), lists.ref)
        ms = time_ms(lambda: run(sets.take()))
        self.add("flex", lists.impl, n, ms, lists.flops, budget=lists.budget, rel_err=err)
        flash_run = self.flex_flash_row(ctx, lists, flex, mask) if self.peer_runs("flex-flash") else None
        return out, flash_run

    def flex_flash_row(self, ctx, lists: Lists, flex, mask):
        n, sets, blocks = ctx["n"], ctx["sets"], ctx["blocks"]
        run = lambda s: flex(*s.flex_qkv, block_mask=mask, enable_gqa=True, kernel_options=FLASH_BACKEND)  # noqa: E731
        if "flex_flash_compiled" not in ctx:
            progress(f"  flex FLASH n={n}: first call (compiles this shape)")
            ctx["flex_flash_compiled"] = True
        out = self.peer_first_call("flex-flash", run, sets.first)
        if out is None:
            return None
        err = relative_error(rows_of(out[0].transpose(0, 1), blocks, n), lists.ref)
        del out
        ms = time_ms(lambda: run(sets.take()))
        self.add("flex", f"flash-{lists.impl}", n, ms, lists.flops, budget=lists.budget, rel_err=err,
                 note="kernel_options BACKEND FLASH")
        return run

    def osk_list_rows(self, ctx, lists: Lists, flex_out: torch.Tensor | None, paired_peer=None):
        """OSK on the lists with the skip off (delta 0), then, per vote scope, with the skip on at a
        delta so small that no block is skipped (NO_SKIP_DELTA): what the skip machinery costs the
        blocks that are computed (skip_tax: time over the skip-off time). Then the same ratios in
        paired rounds (osk_paired), against ``paired_peer`` too: ``(name, call on an input set)`` or None."""
        n, sets, blocks = ctx["n"], ctx["sets"], ctx["blocks"]
        order, counts = lists.order, lists.counts
        if lists.impl == "dense":
            # OSK's dense mode runs on the contract's causal lists; they must equal ours.
            first = sets.first
            ref_order, ref_counts = self.cosa.reference.causal_order(
                first.cu_seqlens_q, first.seqused_k, CONFIG["hq"], n, n, n)
            if not (torch.equal(ref_order, order) and torch.equal(ref_counts, counts)):
                raise AssertionError("causal lists differ from cosa.reference.causal_order")
        out, _, skipped = osk_call(self.cosa, sets.first, order, counts, n, 0.0)
        err = relative_error(rows_of(out, blocks, n), lists.ref)
        peer, peer_name = (ctx.get("dense_out"), "sdpa-cudnn") if lists.impl == "dense" else (flex_out, "flex")
        peer_err = relative_error(out, peer) if peer is not None else None
        del out
        ms_off = time_ms(lambda: osk_call(self.cosa, sets.take(), order, counts, n, 0.0))
        off_row = self.add("osk", lists.impl, n, ms_off, lists.flops, budget=lists.budget, delta=0.0, rel_err=err,
                           rel_err_peer=peer_err, peer=peer_name if peer is not None else None,
                           skipped=int(skipped.sum()), note="")
        on_rows = {}
        for vote in VOTES:
            out, _, skipped = osk_call(self.cosa, sets.first, order, counts, n, NO_SKIP_DELTA, vote)
            err = relative_error(rows_of(out, blocks, n), lists.ref)
            del out
            ms = time_ms(lambda vote=vote: osk_call(self.cosa, sets.take(), order, counts, n, NO_SKIP_DELTA, vote))
            halves = int(skipped.sum())
            on_rows[vote] = self.add(
                "osk", f"{lists.impl}-skipon-{vote}", n, ms, block_flops(counts, skipped),
                budget=lists.budget, delta=NO_SKIP_DELTA, vote=vote, rel_err=err, skipped=halves,
                skip_tax=ms / ms_off, note=f"skip on, {halves} halves skipped: {ms / ms_off:.3f}x the skip-off time")
        self.osk_paired(ctx, lists, off_row, on_rows, paired_peer)

    def osk_paired(self, ctx, lists: Lists, off_row: dict, on_rows: dict, peer):
        """The ratios OSK's targets are stated in, from PAIRED_ROUNDS interleaved rounds on the same
        inputs (common.interleaved_ms): each skip-on time over the skip-off time (``skip_tax_paired``
        on the skip-on rows) and, with a ``peer`` ``(name, call)``, the peer's time over OSK's with the
        skip off (``x_peer_paired`` on the skip-off row, ``peer_paired`` naming the peer); each with
        the quartiles of the per-round ratios. Rows timed one after another differ by a few percent
        from run to run, as much as the margins these ratios are read for."""
        n, sets, order, counts = ctx["n"], ctx["sets"], lists.order, lists.counts
        fns = {"off": lambda: osk_call(self.cosa, sets.take(), order, counts, n, 0.0)}
        for vote in on_rows:
            fns[vote] = lambda vote=vote: osk_call(self.cosa, sets.take(), order, counts, n, NO_SKIP_DELTA, vote)
        if peer is not None:
            fns["peer"] = lambda: peer[1](sets.take())
        times = interleaved_ms(fns, rounds=PAIRED_ROUNDS)
        if peer is not None:
            off_row.update(x_peer_paired=paired_ratio(times["peer"], times["off"]),
                           x_peer_paired_quartiles=list(paired_ratio_quartiles(times["peer"], times["off"])),
                           peer_paired=peer[0])
            off_row["note"] = (f"{off_row['x_peer_paired']:.3f}x {peer[0]} in {PAIRED_ROUNDS} paired rounds "
                               f"[{off_row['x_peer_paired_quartiles'][0]:.3f} {off_row['x_peer_paired_quartiles'][1]:.3f}]")
        for vote, row in on_rows.items():
            row["skip_tax_paired"] = paired_ratio(times[vote], times["off"])
            row["skip_tax_paired_quartiles"] = list(paired_ratio_quartiles(times[vote], times["off"]))
            row["note"] += f"; paired {row['skip_tax_paired']:.3f}x"
        progress(f"  osk/{lists.impl} n={n}: paired rounds done")

    def skip_cost_rows(self, ctx):
        """Cost of an in-kernel skipped block against a computed one, per vote scope, on one input
        where every block after block 0 is skipped (dominant_first_block_set):
            t_full  = OSK, every causal block, skip off (delta = 0)
            t_skip  = the same lists, skip on (delta = 2000): block 0 computed, the rest skipped
            t_first = lists holding block 0 only, skip off
            skip_cost = (t_skip - t_first) / (t_full - t_first)
        i.e. the time of the skipped blocks over the time of the same blocks computed."""
        n, nq, sets = ctx["n"], ctx["nq"], ctx["sets"]
        hq = CONFIG["hq"]
        if not 0 < SKIP_DELTA < n:
            progress(f"  osk/skipcost n={n}: skipped (delta {SKIP_DELTA:g} >= N turns the skip off)")
            return
        s = dominant_first_block_set(sets.first, n, n, self.cosa)
        order, counts = ctx["causal"]
        first_order = torch.full_like(order, -1)
        first_order[..., 0] = 0
        first_counts = torch.ones_like(counts)
        run = lambda o, c, delta, vote=None: osk_call(self.cosa, s, o, c, n, delta, vote)  # noqa: E731
        out_full, _, _ = run(order, counts, 0.0)
        t_full = time_ms(lambda: run(order, counts, 0.0))
        t_first = time_ms(lambda: run(first_order, first_counts, 0.0))
        self.add("osk", "skipcost-full", n, t_full, block_flops(counts), budget=1.0, delta=0.0)
        self.add("osk", "skipcost-first", n, t_first, block_flops(first_counts),
                 budget=int(first_counts.sum()) / causal_blocks(nq, hq), delta=0.0)
        after_first = max(1, int((counts - 1).sum()))  # the blocks that should all be skipped
        skip_rows = {}
        for vote in VOTES:
            out_skip, _, skipped = run(order, counts, SKIP_DELTA, vote)
            err = relative_error(out_skip, out_full)
            del out_skip
            t_skip = time_ms(lambda vote=vote: run(order, counts, SKIP_DELTA, vote))
            cost = (t_skip - t_first) / (t_full - t_first) if t_full > t_first else None
            skip_rows[vote] = self.add(
                "osk", f"skipcost-skip-{vote}", n, t_skip, block_flops(counts, skipped), budget=1.0,
                delta=SKIP_DELTA, vote=vote, rel_err=err, realised=1.0 - skipped_blocks(skipped) / int(counts.sum()),
                skipped_fraction=skipped_blocks(skipped) / after_first, skip_cost=cost,
                note=f"skip cost {cost:.2f} of a computed block" if cost is not None else "")
        times = interleaved_ms({"full": lambda: run(order, counts, 0.0), "first": lambda: run(first_order, first_counts, 0.0),
                                **{vote: lambda vote=vote: run(order, counts, SKIP_DELTA, vote) for vote in VOTES}},
                               rounds=PAIRED_ROUNDS)
        add_paired_skip_costs(skip_rows, times)

    def structured_rows(self, ctx):
        """OSK with skip over every causal block (ascending order), and CoSA end to end, per vote
        scope, on the structured input; errors are against exact dense attention."""
        n, nq, blocks = ctx["n"], ctx["nq"], ctx["blocks"]
        progress(f"n={n}: structured inputs")
        sets = Rotation(lambda i: structured_set(n, 31 * i + 5, self.cosa), set_bytes(n, False, False, True))
        first = sets.first
        ref = reference_rows(first.q, first.k, first.v, *ctx["causal"], blocks, self.scale)
        total = causal_blocks(nq, CONFIG["hq"])
        if self.want("osk") and self.has("osk"):
            order, counts = ctx["causal"]
            for vote in VOTES:
                out, _, skipped = osk_call(self.cosa, first, order, counts, n, SKIP_DELTA, vote)
                err = relative_error(rows_of(out, blocks, n), ref)
                del out
                ms = time_ms(lambda vote=vote: osk_call(self.cosa, sets.take(), order, counts, n, SKIP_DELTA, vote))
                self.add("osk", f"causal+skip-{vote}", n, ms, block_flops(counts, skipped), budget=1.0,
                         delta=SKIP_DELTA, vote=vote, rel_err=err,
                         realised=(int(counts.sum()) - skipped_blocks(skipped)) / total, note="structured input")
        if self.want("cosa") and self.has("prefill"):
            for vote in VOTES:
                self.prefill_rows(sets, ref, blocks, n, vote)

    def prefill_rows(self, sets: Rotation, ref, blocks, n: int, vote: str):
        """cosa.prefill (stride 8, top_p 0.95, delta 2000, the default proxy) with the device checks on and off."""
        run = lambda s, **stats: self.cosa.prefill(  # noqa: E731
            s.q, s.k_cache, s.v_cache, s.page_table, s.cu_seqlens_q, s.seqused_k, n, n, stride=8, top_p=0.95,
            delta=SKIP_DELTA, vote=vote, **stats)
        out, stats = run(sets.first, return_stats=True)
        proxy = self.cosa.reference.resolved_proxy_precision(self.cosa.defaults.PROXY_PRECISION, n)
        err = relative_error(rows_of(out, blocks, n), ref)
        del out
        for suffix, checks in (("", True), ("-unchecked", False)):
            with self.cosa.set_device_checks(checks):
                ms = time_ms(lambda: run(sets.take()))
            self.add("cosa", f"prefill-{vote}{suffix}", n, ms, block_flops(stats["counts"], stats["skipped"]),
                     budget=stats["stage1_budget"], delta=SKIP_DELTA, vote=vote, rel_err=err,
                     realised=stats["realised_budget"],
                     note=f"stride 8, top_p 0.95, proxy {proxy}, structured input"
                          + ("" if checks else ", device checks off"))

    def kap_rows(self, ctx):
        """KAP alone per stride (top_p 0.95) and proxy precision (``stride-<s>``: native,
        ``stride-<s>-fp8``: the e4m3 proxy) on the random input; at N <= 16K its lists are compared
        with cosa.reference.kap at the same precision (fraction of (head, query block) rows that match)."""
        n, sets = ctx["n"], ctx["sets"]
        first = sets.first
        self.guarded(f"kap default at {n}", self.kap_default_row, ctx)
        for stride in self.args.strides:
            for precision in ("native", "fp8"):
                run = lambda s: torch.ops.cosa.kap(s.q, s.k_cache, s.page_table, s.cu_seqlens_q,  # noqa: E731
                                                   s.seqused_k, n, n, stride, 0.95, None, precision)
                order, counts = run(first)
                match = None
                if n <= 16384:
                    ref_order, ref_counts = self.cosa.reference.kap(
                        first.q, first.k_cache, first.page_table, first.cu_seqlens_q, first.seqused_k,
                        n, n, stride, 0.95, None, precision)
                    same = (ref_counts == counts) & (ref_order == order).all(-1)
                    match = float(same.float().mean())
                note = f"lists match reference {match:.3f}" if match is not None else "top_p 0.95"
                budget = int(counts.sum()) / causal_blocks(ctx["nq"], CONFIG["hq"])
                name = f"stride-{stride}" + ("" if precision == "native" else f"-{precision}")
                for suffix, checks in (("", True), ("-unchecked", False)):
                    with self.cosa.set_device_checks(checks):
                        ms = time_ms(lambda: run(sets.take()))
                    self.add("kap", f"{name}{suffix}", n, ms, budget=budget, list_match=match,
                             note=note + ("" if checks else ", device checks off"))
                self.guarded(f"{name} stages at {n}", record_kap_stages, self.rows[-2], lambda: run(sets.take()),
                             f"{name} at {n}:")
                replay = graph_of(lambda: run(first))
                self.add("kap", f"{name}-graph", n, time_ms(replay), budget=budget, list_match=match,
                         note=note + ", CUDA graph replay (no host work, no checks), one input set")

    def kap_default_row(self, ctx):
        """``kap/default``: cosa.kap at its defaults (stride, top_p, the proxy precision "auto" resolves
        to at this length) with the device checks off, as the vLLM backend calls it; with FA4, its share
        of FA4 dense in paired rounds (kap_share_of_fa4)."""
        n, sets = ctx["n"], ctx["sets"]
        run = lambda s: self.cosa.kap(s.q, s.k_cache, s.page_table, s.cu_seqlens_q, s.seqused_k, n, n)  # noqa: E731
        proxy = self.cosa.reference.resolved_proxy_precision(self.cosa.defaults.PROXY_PRECISION, n)
        with self.cosa.set_device_checks(False):
            _, counts = run(sets.first)
            ms = time_ms(lambda: run(sets.take()))
        row = self.add("kap", "default", n, ms, budget=int(counts.sum()) / causal_blocks(ctx["nq"], CONFIG["hq"]),
                       note=f"stride {self.cosa.defaults.STRIDE}, top_p {self.cosa.defaults.TOP_P}, proxy {proxy}, "
                            "device checks off")
        self.kap_share_of_fa4(ctx, run, row)

    def fa4_run(self, ctx):
        """FA4 dense as a call on an input set, after its first (compiling, untimed) call; None where
        FA4 fails, its rows then left out."""
        run = lambda s: fa4_dense(self.fa4, s.q, s.k, s.v)  # noqa: E731
        return run if self.peer_first_call("fa4", run, ctx["sets"].first) is not None else None

    def kap_share_of_fa4(self, ctx, run_kap, row: dict):
        """KAP's share of FA4 dense, the number its target is stated in, from KAP as the backend runs it
        (device checks off) and FA4 timed in PAIRED_ROUNDS interleaved rounds on the same inputs
        (common.interleaved_ms): the median of the per-round ratios and its quartiles go into
        ``row`` (``frac_of_fa4_paired``, ``frac_of_fa4_paired_quartiles``, and FA4's median round
        ``fa4_ms_paired``, so that a run without the dense section still says FA4's time). Rows timed one after
        another differ by a few percent from run to run, as much as the margins this share is read
        for."""
        if self.fa4 is None or not self.peer_runs("fa4"):
            return
        fa4_run = self.fa4_run(ctx)
        if fa4_run is None:
            return
        sets = ctx["sets"]
        with self.cosa.set_device_checks(False):
            times = interleaved_ms({"kap": lambda: run_kap(sets.take()), "fa4": lambda: fa4_run(sets.take())},
                                   rounds=PAIRED_ROUNDS)
        share = paired_ratio(times["kap"], times["fa4"])
        q1, q3 = paired_ratio_quartiles(times["kap"], times["fa4"])
        row["frac_of_fa4_paired"] = share
        row["frac_of_fa4_paired_quartiles"] = [q1, q3]
        row["fa4_ms_paired"] = statistics.median(times["fa4"])
        row["note"] += (f"; {100 * share:.2f}% of FA4 dense in {PAIRED_ROUNDS} paired rounds "
                        f"[{100 * q1:.2f} {100 * q3:.2f}]")
        progress(f"  kap/{row['impl']} n={ctx['n']}: {100 * share:.2f}% of FA4 dense, paired")

    # -- derived columns, table, plot ---------------------------------------------------------

    def finish(self):
        add_speedups(self.rows)
        self.save()


def add_paired_skip_costs(skip_rows: dict, times: dict) -> None:
    """``skip_cost_paired`` (and its quartiles) on each skipcost-skip row: the skip cost of
    Bench.skip_cost_rows computed round by round from interleaved rounds of the full, first-block
    and skip runs (``times``: per-round times by "full", "first" and vote), then the median."""
    for vote, row in skip_rows.items():
        costs = [(skip - first) / (full - first)
                 for full, first, skip in zip(times["full"], times["first"], times[vote]) if full > first]
        if not costs:
            continue
        row["skip_cost_paired"] = statistics.median(costs)
        q1, q3 = quartiles(costs)
        row["skip_cost_paired_quartiles"] = [q1, q3]
        row["note"] += f"; paired {row['skip_cost_paired']:.2f} [{q1:.2f} {q3:.2f}]"


def add_speedups(rows: list[dict]) -> None:
    """Per row, each dense anchor's time at the same N and heads over the row's: ``x_cudnn`` (SDPA cuDNN) and
    ``x_fa4`` (FlashAttention-4), above 1 when the row is faster; kap rows also get their share of
    the anchor's time (``frac_of_cudnn``, ``frac_of_fa4``). None where the anchor has no row at N."""
    for anchor, speedup, share in (("sdpa-cudnn", "x_cudnn", "frac_of_cudnn"), ("fa4", "x_fa4", "frac_of_fa4")):
        base = {(r["n"], r.get("heads")): r["ms"] for r in rows if r["kind"] == "dense" and r["impl"] == anchor}
        for r in rows:
            anchor_ms = base.get((r["n"], r.get("heads")))
            r[speedup] = anchor_ms / r["ms"] if anchor_ms else None
            if r["kind"] == "kap":
                r[share] = r["ms"] / anchor_ms if anchor_ms else None


def table_columns(rows: list[dict]) -> list[str]:
    """TABLE_COLUMNS, less the FA4 columns when the run has no fa4 row."""
    has_fa4 = any(r["kind"] == "dense" and r["impl"] == "fa4" for r in rows)
    return [c for c in TABLE_COLUMNS if has_fa4 or c not in FA4_COLUMNS]


# Line style per row kind, so that 15+ series stay tellable apart; skip-cost and skip-on rows are
# measuring devices, not implementations, and stay out of the picture.
_PLOT_STYLE = {"dense": "-", "flex": "--", "osk": "-", "kap": ":", "cosa": "-"}


def plot(rows, path: Path) -> bool:
    """Left: time vs N per (kind, impl), log-log. Right: speedup over cuDNN at the same N.
    False when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    series: dict[str, list[tuple[int, float, float | None]]] = {}
    several_heads = len({r.get("heads") for r in rows}) > 1
    for r in rows:
        if not r["impl"].startswith("skipcost") and "-skipon-" not in r["impl"]:
            label = f"{r['kind']}/{r['impl']}" + (f" {r['heads']}" if several_heads else "")
            series.setdefault(label, []).append((r["n"], r["ms"], r.get("x_cudnn")))
    colors = plt.get_cmap("tab20").colors
    fig, (ax_time, ax_speed) = plt.subplots(1, 2, figsize=(14, 6))
    for i, (label, points) in enumerate(sorted(series.items())):
        points.sort()
        style = dict(marker="o", markersize=4, color=colors[i % len(colors)],
                     linestyle=_PLOT_STYLE.get(label.split("/")[0], "-"), label=label)
        ax_time.plot([p[0] for p in points], [p[1] for p in points], **style)
        speed = [(p[0], p[2]) for p in points if p[2] is not None]
        if speed and not label.startswith("kap/"):
            ax_speed.plot([p[0] for p in speed], [p[1] for p in speed], **style)
    for ax in (ax_time, ax_speed):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length N (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    ax_time.set_yscale("log")
    ax_time.set_ylabel("median time (ms)")
    heads = "heads as labelled" if several_heads else f"Hq={rows[0]['heads'].replace('/', ', Hkv=')}"
    ax_time.set_title(f"one attention layer, B=1, {heads}, d=128, bf16, causal")
    ax_time.legend(fontsize=7, ncol=2)
    ax_speed.axhline(1.0, color="black", linewidth=0.8)
    ax_speed.set_ylabel("cuDNN time / time (above 1: faster than cuDNN)")
    ax_speed.set_title("speedup over cuDNN dense attention")
    return save_figure(fig, path)


def parse_args(argv=None):
    p = argument_parser(__doc__)
    p.add_argument("--n", type=int, nargs="+", default=None,
                   help=f"context lengths, multiples of 128 (default {' '.join(map(str, DEFAULT_N))})")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5, 0.75, 1.0],
                   help="stage-1 budgets of the random lists (1.0 = every causal block)")
    p.add_argument("--strides", type=int, nargs="+", default=[4, 8, 16], help="KAP strides")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test at N = {' '.join(map(str, QUICK_N))} (unless --n is given)")
    p.add_argument("--only", default=",".join(SECTIONS),
                   help=f"comma-separated sections to run, of {','.join(SECTIONS)}")
    p.add_argument("--page-size", type=int, default=CONFIG["page_size"],
                   help=f"page size of the paged KV cache the CoSA rows read (default {CONFIG['page_size']})")
    p.add_argument("--heads", type=parse_heads, nargs="+", default=None,
                   help=f"head configurations <Hq>/<Hkv> to run every section on (default {CONFIG['hq']}/"
                        f"{CONFIG['hkv']}; all: {' '.join(f'{q}/{k}' for q, k in HEAD_CONFIGS)})")
    p.add_argument("--plot", action="store_true", help="also save a PNG of time vs N next to the JSON")
    p.add_argument("--out", default=str(REPO_ROOT / "bench" / "results"), help="folder for the JSON")
    args = p.parse_args(argv)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(args.only) - set(SECTIONS))
    if unknown:
        p.error(f"--only: unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.n is None:
        args.n = list(QUICK_N if args.quick else DEFAULT_N)
    args.heads = list(dict.fromkeys(h for group in (args.heads or [[(CONFIG["hq"], CONFIG["hkv"])]]) for h in group))
    if any(n <= 0 or n % BLOCK for n in args.n):
        p.error("--n: every context length must be a positive multiple of 128")
    if any(not 0 < b <= 1 for b in args.budgets):
        p.error("--budgets: each budget must be in (0, 1]")
    if any(s <= 0 or BLOCK % s for s in args.strides):
        p.error("--strides: each stride must divide 128")
    if not (16 <= args.page_size <= 256 and args.page_size & (args.page_size - 1) == 0):
        p.error(f"--page-size: must be a power of two in [16, 256], got {args.page_size}")
    return args


def load_peers(sections):
    """``(flash_attn_func or None, {peer: None while it runs, else why its rows are left out})`` for
    the optional FA4 peers of the sections run: FA4 dense (dense, and kap for KAP's share of it) and
    FlexAttention's FLASH backend (flex), which runs FA4's kernel and so needs the same package. One
    stderr line per absent peer."""
    fa4, why = load_fa4() if set(sections) & {"dense", "flex", "kap"} else (None, None)
    reasons = {"fa4": why, "flex-flash": why}
    for peer, section in (("fa4", "dense"), ("flex-flash", "flex")):
        if section in sections and why is not None:
            progress(f"{peer}: rows left out ({why})")
    return fa4, reasons


def main(argv=None) -> int:
    args = parse_args(argv)
    CONFIG["page_size"] = args.page_size  # recorded in the JSON's config
    require_cuda("bench/kernel.py")
    meta = run_metadata()
    json_path = results_path(args.out, "kernel", meta)
    progress(f"{meta['device']}, torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}, "
             f"commit {meta['commit']}; results -> {json_path}")
    cosa_mod, reasons = load_cosa() if set(args.only) & {"osk", "kap", "cosa"} else (None, {})
    for op, why in reasons.items():
        progress(f"cosa::{op}: " + ("CUDA kernel found" if why is None else f"rows left out ({why})"))
    fa4, peer_reasons = load_peers(args.only)
    bench = Bench(args, meta, cosa_mod, reasons, json_path, fa4, peer_reasons)
    CONFIG["heads"] = [f"{hq}/{hkv}" for hq, hkv in args.heads]
    for hq, hkv in args.heads:
        CONFIG["hq"], CONFIG["hkv"] = hq, hkv
        for n in args.n:
            bench.guarded(f"n={n} heads {hq}/{hkv}", bench.run_size, n)
            bench.finish()
    CONFIG["hq"], CONFIG["hkv"] = args.heads[0]
    if args.plot and bench.rows:
        png = json_path.with_suffix(".png")
        progress(f"plot -> {png}" if plot(bench.rows, png) else "no plot: matplotlib is not installed")
    print(format_table(bench.rows, table_columns(bench.rows)))
    return finish_report(json_path, bench.failures)


if __name__ == "__main__":
    sys.exit(main())
