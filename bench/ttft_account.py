"""Where the time of one prefill goes: a torch.profiler trace of one request split into measured parts.

``account(trace, window, num_layers)`` reads a Chrome trace written by ``torch.profiler`` (CPU and CUDA
activities) around one request whose host-side span is the user annotation ``window``. Every GPU
activity (kernel, memcpy, memset) inside that span is put in exactly one part:

  flash_attn      FlashAttention kernels
  kap             CoSA's proxy kernels (``kap_*``)
  osk             CoSA's attention kernel (``osk_*``)
  cosa_backend    every other GPU activity launched from inside the attention op (the CoSA backend's
                  own work: the device checks, the copy of each run's output, index arithmetic)
  kv_cache_write  the kernels that write the new keys and values into the paged cache
  gemm            the model's matrix products (cuBLAS, CUTLASS, nvjet kernels)
  copies          memcpy, memset and copy kernels outside the attention op
  other_kernels   the rest of the model's kernels (norms, activations, rotary embedding, sampling)
  overlap         minus the time during which two of the above ran at once (each was counted in full)
  idle            the span's time with no GPU activity at all: host work the GPU waited for

so that the parts add up to the span exactly. A kernel counts as launched from inside the attention op
when the host call that launched it (linked by the trace's correlation id) falls inside a CPU op whose
name holds ``unified_attention`` on the same thread, as vLLM's attention layer runs; when the trace has
no such op, kernels are placed by their names alone and ``attention_op_found`` is False.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

ATTENTION_PARTS = ("flash_attn", "kap", "osk", "cosa_backend")
PARTS = (*ATTENTION_PARTS, "kv_cache_write", "gemm", "copies", "other_kernels", "overlap", "idle")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
ATTENTION_OP_MARK = "unified_attention"
GEMM_MARKS = ("gemm", "nvjet", "cublas", "cutlass", "xmma", "matmul")
TOP_KERNELS = 12


def kernel_part(name: str, category: str, in_attention_op: bool) -> str:
    """The part of one GPU activity (module docstring)."""
    lower = name.lower()
    if "kap_" in lower:
        return "kap"
    if "osk_" in lower:
        return "osk"
    if "reshape_and_cache" in lower:  # before "flash": vLLM names one of them reshape_and_cache_flash
        return "kv_cache_write"
    if "flash" in lower and category == "kernel":
        return "flash_attn"
    if in_attention_op:
        return "cosa_backend"
    if category != "kernel" or "copy" in lower:
        return "copies"
    if any(mark in lower for mark in GEMM_MARKS):
        return "gemm"
    return "other_kernels"


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``[start, end]`` intervals merged into disjoint ones, sorted."""
    out: list[tuple[float, float]] = []
    for start, stop in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``[start, end)`` intervals."""
    return sum(stop - start for start, stop in merged(intervals))


class _Ranges:
    """Host ranges per thread, merged, asked whether a time lies in one."""

    def __init__(self, ranges: dict[object, list[tuple[float, float]]]):
        self.by_thread = {tid: merged(r) for tid, r in ranges.items()}
        self.starts = {tid: [s for s, _ in r] for tid, r in self.by_thread.items()}

    def contains(self, tid, t: float) -> bool:
        i = bisect.bisect_right(self.starts.get(tid, []), t) - 1
        return i >= 0 and t <= self.by_thread[tid][i][1]


def account(trace: dict, window: str, num_layers: int) -> dict:
    """The parts of the span ``window`` in ``trace`` (a Chrome trace as a dict; times in microseconds),
    in milliseconds. Returns ``{"window_ms", "parts_ms", "attention_ms", "attention_per_layer_ms",
    "attention_calls", "attention_op_found", "gpu_activities", "top_kernels"}``."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    spans = [e for e in events if e.get("name") == window]
    if not spans:
        raise ValueError(f"the trace has no span named {window!r}")
    if len(spans) > 1:
        raise ValueError(f"the trace has {len(spans)} spans named {window!r}, not one: one request per trace")
    w0 = float(spans[0]["ts"])
    w1 = w0 + float(spans[0]["dur"])
    launches = {}
    attention_ranges: dict[object, list[tuple[float, float]]] = defaultdict(list)
    attention_calls = 0
    for e in events:
        cat = e.get("cat", "")
        if cat in LAUNCH_CATEGORIES and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = (e.get("tid"), float(e["ts"]))
        elif cat == "cpu_op" and ATTENTION_OP_MARK in e.get("name", ""):
            start = float(e["ts"])
            attention_ranges[e.get("tid")].append((start, start + float(e["dur"])))
            attention_calls += w0 <= start <= w1
    ranges = _Ranges(attention_ranges)
    parts = dict.fromkeys(PARTS, 0.0)
    intervals = []
    per_kernel: dict[str, float] = defaultdict(float)
    for e in events:
        cat = e.get("cat", "")
        if cat not in GPU_CATEGORIES:
            continue
        start, stop = max(w0, float(e["ts"])), min(w1, float(e["ts"]) + float(e["dur"]))
        if stop <= start:
            continue
        launch = launches.get(e.get("args", {}).get("correlation"))
        in_op = launch is not None and ranges.contains(*launch)
        part = kernel_part(e.get("name", ""), cat, in_op)
        parts[part] += stop - start
        per_kernel[f"{part}: {e.get('name', '')[:120]}"] += stop - start
        intervals.append((start, stop))
    busy = union_length(intervals)
    parts["overlap"] = busy - sum(parts[p] for p in PARTS if p not in ("overlap", "idle"))
    parts["idle"] = (w1 - w0) - busy
    attention = sum(parts[p] for p in ATTENTION_PARTS)
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
    return {"window_ms": (w1 - w0) / 1e3, "parts_ms": {p: v / 1e3 for p, v in parts.items()},
            "attention_ms": attention / 1e3, "attention_per_layer_ms": attention / 1e3 / num_layers,
            "attention_calls": attention_calls, "attention_op_found": bool(attention_ranges),
            "gpu_activities": len(intervals), "top_kernels": [[name, ms / 1e3] for name, ms in top]}


def account_row(backend: str, n: int, measured_ms: float, result: dict) -> dict:
    """The results-file row of one account: ``closure`` is the parts' sum over the request's time to
    first token measured without the profiler (1 when the profiled request took as long)."""
    total = sum(result["parts_ms"].values())
    return {"kind": "account", "backend": backend, "n": n, "measured_ms": measured_ms, "profiled_ms": total,
            "closure": total / measured_ms, **{k: v for k, v in result.items() if k != "window_ms"}}


def account_table(rows: list[dict]) -> list[dict]:
    """One line per part, one column per (backend, n), for format_table."""
    columns = [(r, f"{r['backend']} {r['n']}") for r in rows]
    lines = []
    for part in (*PARTS, "attention_ms", "attention_per_layer_ms", "profiled_ms", "measured_ms", "closure"):
        line = {"part": part}
        for row, label in columns:
            line[label] = row["parts_ms"][part] if part in PARTS else row[part]
        lines.append(line)
    return lines
