"""Helpers shared by the benchmarks: run metadata, timing, progress lines, tables, JSON. KAP's kernel
times per stage under torch.profiler (bench/kernel.py, bench/layers.py). The accuracy benches'
statistics are in bench/stats.py.

Nothing here imports `cosa`: the dense and FlexAttention rows must run on a machine where the
extension is not built.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent

_START = time.monotonic()


def progress(message: str) -> None:
    """One progress line on stderr, prefixed with the seconds since the script started."""
    print(f"[{time.monotonic() - _START:7.1f}s] {message}", file=sys.stderr, flush=True)


def require_cuda(what: str) -> None:
    """Exit with status 2 and a one-line reason when no CUDA device is visible."""
    if not torch.cuda.is_available():
        print(f"{what} needs a CUDA GPU (an NVIDIA H200 for the published numbers); "
              "torch.cuda.is_available() is False on this machine.", file=sys.stderr)
        sys.exit(2)


def git_commit() -> str:
    """$COSA_COMMIT when set (for a run on a copy of the working tree whose .git, if any, is not
    this checkout's), else the checkout's commit (with '-dirty' when tracked files
    changed), else 'unknown'."""
    if os.environ.get("COSA_COMMIT"):
        return os.environ["COSA_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO_ROOT, capture_output=True, text=True,
                               check=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


SOURCE_DIRS = ("csrc", "cosa")
SOURCE_SUFFIXES = (".py", ".h", ".cuh", ".cu", ".cpp", ".json")


def source_digest(root: str | os.PathLike = REPO_ROOT) -> str:
    """The first 12 hex digits of the SHA-1 over the files of csrc/ and cosa/ with SOURCE_SUFFIXES
    (their paths relative to `root`, sorted, each path and its bytes fed in turn): it names the code
    behind a result when the commit field reads -dirty or a copy of the tree has no git metadata.
    The same digest of any commit comes from its `git archive` unpacked as `root`."""
    root = Path(root)
    digest = hashlib.sha1()
    files = sorted(path for folder in SOURCE_DIRS for path in (root / folder).rglob("*")
                   if path.is_file() and path.suffix in SOURCE_SUFFIXES)
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def run_metadata() -> dict:
    """Device, library versions, commit and date of this run (the head of every results file)."""
    meta = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "commit": git_commit(),
        "sources": source_digest(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    return meta


def results_path(out_dir: str | os.PathLike, prefix: str, meta: dict) -> Path:
    """`<out_dir>/<prefix>-<UTC date and time>-<short sha>.json`."""
    stamp = _dt.datetime.fromisoformat(meta["date"]).strftime("%Y%m%d-%H%M%S")
    short = meta["commit"][:8] if meta["commit"] != "unknown" else "nocommit"
    return Path(out_dir) / f"{prefix}-{stamp}-{short}.json"


def write_json(path: Path, payload: dict) -> None:
    """Write atomically, so that a run killed mid-write leaves the previous complete file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    tmp.replace(path)


def cuda_event_median_ms(fn: Callable[[], object], warmup: int, reps: int) -> float:
    """Median of ``reps`` calls timed with CUDA events, after ``warmup`` untimed calls; no call's
    result outlives it, so that each call allocates into the same free memory."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def time_ms(fn: Callable[[], object], warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median time of `fn` in milliseconds: `triton.testing.do_bench` (which also flushes the L2
    cache between calls), or CUDA events when Triton is missing."""
    try:
        from triton.testing import do_bench
    except ImportError:
        once = max(cuda_event_median_ms(fn, warmup=1, reps=1), 1e-3)
        return cuda_event_median_ms(fn, warmup=max(1, int(warmup_ms / once)),
                                     reps=max(3, int(rep_ms / once)))
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def interleaved_ms(fns: dict[str, Callable[[], object]], rounds: int = 5, warmup_ms: float = 10.0,
                   rep_ms: float = 40.0) -> dict[str, list[float]]:
    """Each function's :func:`time_ms` in ``rounds`` interleaved rounds, each round starting at the
    next function, so that implementations compared with each other see the same clocks and
    temperature (timed one after another, whole rows differ by a few percent between runs, the size
    of the differences they are compared for). Returns the per-round times of each function."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        for offset in range(len(names)):
            name = names[(round_index + offset) % len(names)]
            times[name].append(time_ms(fns[name], warmup_ms, rep_ms))
    return times


def round_ratios(numerator: list[float], denominator: list[float]) -> list[float]:
    """One round's time over the other's in the same round, round by round."""
    return [a / b for a, b in zip(numerator, denominator)]


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """The median over the rounds of one round's time over the other's in the same round."""
    return statistics.median(round_ratios(numerator, denominator))


def quartiles(values: list[float]) -> tuple[float, float]:
    """The first and third quartiles of per-round values (both the value itself for one round)."""
    if len(values) == 1:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def paired_ratio_quartiles(numerator: list[float], denominator: list[float]) -> tuple[float, float]:
    """The first and third quartiles of the same per-round ratios as paired_ratio."""
    return quartiles(round_ratios(numerator, denominator))


class Rotation:
    """Cycles through several input sets so that repeated calls do not find their inputs in
    L2; one set when a set is already well over the cache."""

    def __init__(self, make_set: Callable[[int], object], set_bytes: int, max_sets: int = 4):
        l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
        count = 1 if set_bytes >= 2 * l2 else min(max_sets, -(-2 * l2 // max(set_bytes, 1)))
        self.sets = [make_set(i) for i in range(count)]
        self._next = 0

    def __len__(self) -> int:
        return len(self.sets)

    @property
    def first(self):
        return self.sets[0]

    def take(self):
        item = self.sets[self._next % len(self.sets)]
        self._next += 1
        return item


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float32; NaN anywhere gives NaN (it never passes a check)."""
    out = out.float()
    ref = ref.float()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value == 0.0:
            return "0"
        if abs(value) >= 100:
            return f"{value:.1f}"
        if abs(value) >= 0.01:
            return f"{value:.3g}"
        return f"{value:.2e}"
    return str(value)


def format_table(rows: Iterable[dict], columns: Sequence[str]) -> str:
    """A plain fixed-width table of `columns` (missing keys print as '-')."""
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def argument_parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose description is the first paragraph of the script's docstring."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def save_figure(fig, path) -> bool:
    """Write a matplotlib figure as a PNG and release it; returns True for the callers' "plotted"."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    # "tight" grows the image to hold a legend placed beside the axes.
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """--device, --seed, --plot and --out, which every model-level bench takes."""
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                        help="where the model runs (auto, the default: the GPU when torch sees one; on "
                             "the CPU the ops run as the PyTorch reference)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated inputs (default 0)")
    parser.add_argument("--plot", action="store_true", help="also save a PNG next to the JSON")
    parser.add_argument("--out", default=str(REPO_ROOT / "bench" / "results"),
                        help="folder for the results JSON (default bench/results/)")


def resolve_device(args) -> None:
    """--device auto: the GPU when torch sees one."""
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"


def start_run(out_dir: str | os.PathLike, prefix: str) -> tuple[dict, Path]:
    """The run's metadata and the path of its results file, announced on the progress stream."""
    meta = run_metadata()
    json_path = results_path(out_dir, prefix, meta)
    progress(f"{meta['device']}, torch {meta['torch']}, commit {meta['commit']}; results -> {json_path}")
    return meta, json_path


def finish_report(json_path, failures: Sequence[str]) -> int:
    """The last lines of a bench run: where the JSON went and what failed; the exit status."""
    print(f"\nresults: {json_path}")
    if failures:
        print("failures:\n  " + "\n  ".join(failures))
    return 1 if failures else 0


# KAP's kernels by stage, matched by name in the profiler's trace (csrc/kap, csrc/checks).
KAP_STAGES = {"checks": ("check_lengths_and_pages", "check_lists"), "index": ("kap_index_kernel",),
              "key_range": ("kap_key_range_kernel",), "quantize": ("kap_quantize_kernel",),
              "score": ("kap_score_",), "select": ("kap_select_",)}
PROFILED_CALLS = 5


def stage_times(kernels: list[tuple[str, float]], calls: int) -> dict[str, float]:
    """Milliseconds per call of each KAP stage (:data:`KAP_STAGES`; ``other`` for the rest) from
    ``(kernel name, total device microseconds)`` pairs of ``calls`` profiled calls."""
    out = dict.fromkeys([*KAP_STAGES, "other"], 0.0)
    for name, total_us in kernels:
        stage = next((st for st, marks in KAP_STAGES.items() if any(m in name for m in marks)), "other")
        out[stage] += total_us / 1000 / calls
    return out


def kap_stage_times(run, calls: int = PROFILED_CALLS) -> dict[str, float]:
    """Each KAP stage's kernel time per call under torch.profiler. The chain's kernels are dependent
    launches that overlap, so the stages sum to more than the row's time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    # Only the device's own events (kernels, memsets): a host-side op's device time is its kernels' again.
    kernels = [(e.key, e.device_time_total) for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    return stage_times(kernels, calls)


def record_kap_stages(row: dict, run, label: str) -> None:
    """``row["stages_ms"]`` from :func:`kap_stage_times` of ``run``, and a progress line under ``label``."""
    row["stages_ms"] = kap_stage_times(run)
    progress(f"  {label} KAP kernels (ms per call): "
             + ", ".join(f"{stage} {ms:.3f}" for stage, ms in row["stages_ms"].items() if ms))
