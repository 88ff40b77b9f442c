"""Sparse prefill of one long structured input, next to dense attention: ``python -m cosa.demo``.

The input comes from ``cosa.testing.random_problem(structure="mixed")``: random queries and keys
with attention sinks, a local band and a few planted needles (short key spans that every later
query of one KV head matches). The demo prints the time of CoSA and of dense attention, the
stage-1 and realised budgets (docs/spec.md section 3), the error against dense attention, and
whether KAP selected each needle's key block for the query blocks that come after it.

With a GPU and the CUDA kernels: 32K tokens, Hq 32, Hkv 8, d 128, bf16, ``cosa.prefill`` against
SDPA (cuDNN, and FlashAttention). Otherwise (a CPU, or a build without kernels): the PyTorch
reference (``cosa.reference``) at 4K tokens with Hq 8, Hkv 2, against the reference's dense
attention; this takes a few seconds on two cores.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

import cosa
from cosa import defaults, reference, testing
from cosa.reference import BLOCK

KERNEL_SHAPE = {"n": 32768, "hq": 32, "hkv": 8}
REFERENCE_SHAPE = {"n": 4096, "hq": 8, "hkv": 2}
HEAD_DIM = 128


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m cosa.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=None,
                   help="tokens (a multiple of 128; default 32768 with the CUDA kernels, 4096 otherwise)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: the CUDA kernels when a GPU and a build with them are present")
    p.add_argument("--top-p", type=float, default=defaults.TOP_P,
                   help=f"KAP's top-p, in (0, 1] (default {defaults.TOP_P})")
    p.add_argument("--delta", type=float, default=defaults.DELTA,
                   help=f"OSK's skip threshold delta, finite (<= 0 turns the skip off; default {defaults.DELTA:g})")
    p.add_argument("--stride", type=int, default=defaults.STRIDE,
                   help=f"KAP's downsampling stride, a divisor of {BLOCK} (default {defaults.STRIDE})")
    p.add_argument("--vote", choices=reference.VOTE_SCOPES, default=defaults.VOTE,
                   help=f"who decides a skip together: each 64-row half of a tile or the tile (default {defaults.VOTE})")
    p.add_argument("--proxy-precision", choices=reference.PROXY_PRECISIONS, default=defaults.PROXY_PRECISION,
                   help="what KAP's proxy GEMM multiplies: q and k as given (native), e4m3 copies (fp8), or "
                        f"fp8 from {defaults.FP8_PROXY_MIN_KEYS} keys on (auto; default {defaults.PROXY_PRECISION})")
    p.add_argument("--seed", type=int, default=0, help="seed of the random input")
    args = p.parse_args(argv)
    if args.n is not None and (args.n < BLOCK or args.n % BLOCK):
        p.error("--n must be a positive multiple of 128")
    if not 1 <= args.stride <= BLOCK or BLOCK % args.stride:
        p.error(f"--stride must divide {BLOCK} (1, 2, 4, 8, 16, 32, 64 or 128), got {args.stride}")
    if not 0.0 < args.top_p <= 1.0:  # also rejects nan
        p.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if not math.isfinite(args.delta):
        p.error(f"--delta must be finite, got {args.delta}")
    return args


def choose_mode(device_arg: str) -> tuple[str, str | None]:
    """('kernels', None) or ('reference', why the kernels are not used)."""
    if device_arg == "cpu":
        return "reference", "--device cpu"
    if not torch.cuda.is_available():
        if device_arg == "cuda":
            sys.exit("cosa.demo: --device cuda, but torch sees no CUDA GPU")
        return "reference", "no CUDA GPU"
    if not cosa.cuda_kernels_built():
        if device_arg == "cuda":
            sys.exit("cosa.demo: --device cuda, but cosa was built without its CUDA kernels "
                     "(build with TORCH_CUDA_ARCH_LIST=9.0 on a CUDA build of torch)")
        return "reference", "cosa has no CUDA kernels in this build"
    if not cosa.cuda_kernels_available():
        if device_arg == "cuda":
            sys.exit("cosa.demo: --device cuda, but the GPU is not a Hopper (the kernels are for sm_90a)")
        return "reference", "the GPU is not a Hopper (the kernels are for sm_90a)"
    return "kernels", None


def needle_selection(order: torch.Tensor, counts: torch.Tensor, span, hq: int, hkv: int, nq: int):
    """For the query heads that read the needle's KV head and the query blocks wholly after the
    needle: (lists holding every key block of the needle, lists that can see it)."""
    first, last, head = span
    group = hq // hkv
    needle_blocks = set(range(first // BLOCK, last // BLOCK + 1))
    hits = total = 0
    for h in range(head * group, (head + 1) * group):
        for i in range(last // BLOCK + 1, nq):
            listed = set(order[h, i, : int(counts[h, i])].tolist())
            hits += needle_blocks <= listed
            total += 1
    return hits, total


def cuda_median_ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


def run_kernels(problem, n, hq, hkv, args):
    """CoSA (KAP + OSK CUDA kernels) and SDPA dense attention; times in ms."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cosa_call():
        return cosa.prefill(problem["q"], problem["k_cache"], problem["v_cache"], problem["page_table"],
                            problem["cu_seqlens_q"], problem["seqused_k"], n, n, stride=args.stride,
                            top_p=args.top_p, delta=args.delta, vote=args.vote,
                            proxy_precision=args.proxy_precision)

    out, stats = cosa.prefill(problem["q"], problem["k_cache"], problem["v_cache"], problem["page_table"],
                              problem["cu_seqlens_q"], problem["seqused_k"], n, n, stride=args.stride,
                              top_p=args.top_p, delta=args.delta, vote=args.vote,
                              proxy_precision=args.proxy_precision, return_stats=True)
    cosa_ms = cuda_median_ms(cosa_call)

    # SDPA's [1, H, N, d] views of the token-major tensors; cuDNN gets repeated KV heads (no GQA path).
    q = problem["q"].transpose(0, 1).unsqueeze(0)
    k = reference.gather_kv(problem["k_cache"], problem["page_table"], 0, n)
    v = reference.gather_kv(problem["v_cache"], problem["page_table"], 0, n)
    k_rep = k.repeat_interleave(hq // hkv, dim=1).transpose(0, 1).unsqueeze(0)
    v_rep = v.repeat_interleave(hq // hkv, dim=1).transpose(0, 1).unsqueeze(0)
    dense = {}
    for name, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("FlashAttention", SDPBackend.FLASH_ATTENTION)):
        def call(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True)
        try:
            result = call()
            dense[name] = (cuda_median_ms(call), result[0].transpose(0, 1))
        except RuntimeError as error:  # a backend this torch build lacks: report, use the other
            print(f"  (SDPA {name} unavailable: {str(error).splitlines()[0]})")
    if not dense:
        sys.exit("cosa.demo: no SDPA dense backend (cuDNN or flash) ran on this GPU")
    fastest = min(dense, key=lambda name: dense[name][0])
    return out, stats, cosa_ms, {name: ms for name, (ms, _) in dense.items()}, dense[fastest][1], fastest


def run_reference(problem, n, args):
    """CoSA's reference (KAP then OSK, as the ops' CPU path) and exact dense attention; ms."""
    p = problem
    start = time.perf_counter()
    order, counts = reference.kap(p["q"], p["k_cache"], p["page_table"], p["cu_seqlens_q"], p["seqused_k"],
                                  n, n, args.stride, args.top_p, None, args.proxy_precision)
    out, lse, skipped = reference.osk(p["q"], p["k_cache"], p["v_cache"], p["page_table"], p["cu_seqlens_q"],
                                      p["seqused_k"], order, counts, n, None, args.delta, args.vote)
    cosa_ms = 1e3 * (time.perf_counter() - start)
    start = time.perf_counter()
    dense_out, _ = reference.dense_attention(p["q"], p["k_cache"], p["v_cache"], p["page_table"],
                                             p["cu_seqlens_q"], p["seqused_k"])
    dense_ms = 1e3 * (time.perf_counter() - start)
    stage1, realised = reference.budgets(counts, skipped, p["cu_seqlens_q"], p["seqused_k"])
    stats = dict(lse=lse, order=order, counts=counts, skipped=skipped, stage1_budget=stage1,
                 realised_budget=realised)
    return out, stats, cosa_ms, {"reference": dense_ms}, dense_out, "cosa.reference.dense_attention"


def proxy_text(proxy_precision: str, n: int) -> str:
    """The proxy as asked for, with what "auto" resolves to at ``n`` keys."""
    resolved = reference.resolved_proxy_precision(proxy_precision, n)
    return proxy_precision if resolved == proxy_precision else f"{proxy_precision}: {resolved} at {n} keys"


def main(argv=None) -> int:
    args = parse_args(argv)
    mode, why = choose_mode(args.device)
    shape = KERNEL_SHAPE if mode == "kernels" else REFERENCE_SHAPE
    n = args.n or shape["n"]
    hq, hkv = shape["hq"], shape["hkv"]
    device = "cuda" if mode == "kernels" else "cpu"
    where = (torch.cuda.get_device_name() + ", CUDA kernels" if mode == "kernels"
             else f"CPU, PyTorch reference ({why})")
    print(f"CoSA demo: causal prefill of {n} tokens, Hq {hq}, Hkv {hkv}, d {HEAD_DIM}, bf16 on {where}")

    problem, planted = testing.random_problem([n], [n], hq, hkv, HEAD_DIM, BLOCK, torch.bfloat16, device,
                                              structure="mixed", seed=args.seed, return_needles=True)
    needles = sorted((first, last, head) for _, first, last, head in planted)
    print(f"input: random q/k/v with attention sinks, a local band and {len(needles)} planted needles "
          f"(cosa.testing.random_problem, structure='mixed', seed {args.seed})")

    if mode == "kernels":
        out, stats, cosa_ms, dense_ms, dense_out, dense_name = run_kernels(problem, n, hq, hkv, args)
    else:
        out, stats, cosa_ms, dense_ms, dense_out, dense_name = run_reference(problem, n, args)

    dense_text = ", ".join(f"{name} {ms:.2f} ms" for name, ms in dense_ms.items())
    best_ms = min(dense_ms.values())
    if mode == "kernels":
        print(f"time:    CoSA {cosa_ms:.2f} ms (KAP + OSK) | dense: {dense_text} | "
              f"speedup {best_ms / cosa_ms:.2f}x over the fastest dense")
    else:
        print(f"time:    CoSA {cosa_ms:.0f} ms | dense {best_ms:.0f} ms (PyTorch reference code: "
              "says nothing of the kernels' speed)")
    print(f"budget:  stage 1 {100 * stats['stage1_budget']:.1f}% of the causal blocks, realised "
          f"{100 * stats['realised_budget']:.1f}% after in-kernel skipping "
          f"(stride {args.stride}, top_p {args.top_p:g}, delta {args.delta:g}, vote {args.vote}, "
          f"proxy {proxy_text(args.proxy_precision, n)})")
    err = float((out.float() - dense_out.float()).norm() / dense_out.float().norm())
    print(f"error:   ||CoSA - dense|| / ||dense|| = {err:.2e} (dense: {dense_name})")

    nq = math.ceil(n / BLOCK)
    order, counts = stats["order"].cpu(), stats["counts"].cpu()
    for span in needles:
        first, last, head = span
        hits, total = needle_selection(order, counts, span, hq, hkv, nq)
        blocks = "/".join(str(j) for j in range(first // BLOCK, last // BLOCK + 1))
        verdict = (f"selected in {hits}/{total} lists of later query blocks ({100 * hits / total:.0f}%)"
                   if total else "no query block lies wholly after it")
        print(f"needle:  tokens {first}-{last}, KV head {head}, key block {blocks}: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
