#!/usr/bin/env python3
"""Kernels side by side: OSK or KAP of several source trees, built into one harness and timed on the
same inputs in one process.

Each REV is a git revision (a branch or a commit) or ``.`` for the working tree; the first is the
baseline. Its ``csrc/`` is exported under ``build-ab/<kernel>/<label>/`` and compiled with the flags
of ``csrc/build_manifest.json`` under a namespace of its own (``dev/<kernel>_ab/variant_entry.cu``),
all in parallel; ``dev/<kernel>_ab/harness.cu`` (torch-free) then runs every tree on the same
synthetic inputs, d 128, pages shuffled:

- ``--kernel osk`` (the default): the head-dim-128 bf16 OSK on one sequence of 32 query heads and 8
  KV heads: dense lists at 16K and 32K, random 50% and 25% lists, page 16, and the skip kernel with
  nothing skipped, with every block after the first skipped (a planted sink), and with about 28% of
  the blocks skipped, scattered along the lists as on a real model's (planted low blocks; the run
  prints the share skipped); and at the model's head shape (12 query / 2 KV heads) on 37% lists at 32K, with
  the skip off and on with nothing skipped (the skip's tax at that shape). With ``--inputs FILE``
  (layers of a real model captured by ``bench/layers.py --save-ab-inputs``), each layer on its own
  Q/K/V and KAP's lists, with the skip off, at the default delta, and on with nothing skipped. Each
  tree's output is compared element by element with the baseline's.
- ``--kernel kap``: the whole KAP launch chain at stride 8: the fp8 proxy at 4K to 128K tokens (32
  query / 8 KV heads), at 32K with 6 query heads per KV head (24 / 4), with 12 / 2 heads, and at
  strides 4 and 16; the native proxy at 4K, 8K and 32K. Each tree's lists (order and counts) are
  compared entry by entry with the baseline's.

A change that keeps the arithmetic must match bit for bit (a skip case's rows also carry the share of
the blocks each tree skipped, ``skipped_share``); times are medians of CUDA-event timings in
``--rounds`` interleaved rounds (each round starting at the next tree, so that no tree always runs
right after the same other one). A tree's ratio is the median over the rounds of its time over the
baseline's in the same round, printed with the quartiles of those per-round ratios: a difference
whose quartiles straddle 1 is noise.

Building needs nvcc and the CUTLASS headers (``CUTLASS_DIR`` or the nvidia-cutlass package), not a
GPU: ``--build-only`` on a machine with the repository's history, then ``--run-only`` where the GPU
is (the harness binary and the labels travel in ``build-ab/<kernel>/``). The run writes
``dev/results/<kernel>-ab-<date>-<commit>.json`` (which git ignores).

    python dev/kernel_ab.py [--kernel osk|kap] [--build-only | --run-only] [--rounds 3]
                              [--cases FILTER] [--inputs FILE] REV [REV ...]
"""

from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_ROOT = REPO_ROOT / "build-ab"
KERNELS = ("osk", "kap")


def sources(kernel: str) -> Path:
    return REPO_ROOT / "dev" / f"{kernel}_ab"


def build_dir(kernel: str) -> Path:
    return BUILD_ROOT / kernel


def harness_path(kernel: str) -> Path:
    return build_dir(kernel) / f"{kernel}_ab_harness"


def labels_path(kernel: str) -> Path:
    return build_dir(kernel) / "labels.json"


ROW = re.compile(r"^ROW case=(\S+) variant=(\S+) ms=(\S+) ratio=(\S+) q1=(\S+) q3=(\S+) mismatches=(\d+) "
                 r"rounds=(\S+)$")
# The harness's line for a skip case, printed before the case's rows: the share of the blocks after
# each list's first that a tree skipped (what the per-block cost of a skipped block is computed from).
SKIPPED = re.compile(r"^(\S+), (\S+): ([0-9.]+)% of the blocks after each list's first skipped$")


def fail(message: str) -> None:
    print(f"kernel_ab: {message}", file=sys.stderr)
    sys.exit(2)


def label_of(rev: str, taken: set[str]) -> str:
    """A C identifier naming the tree of `rev`, unique among `taken`."""
    base = "worktree" if rev == "." else re.sub(r"[^A-Za-z0-9]", "_", rev).strip("_") or "rev"
    label, suffix = base, 2
    while label in taken:
        label, suffix = f"{base}_{suffix}", suffix + 1
    taken.add(label)
    return label


def export_tree(rev: str, dest: Path) -> None:
    """`rev`'s csrc/ (or the working tree's, for '.') as `dest`/csrc."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    if rev == ".":
        shutil.copytree(REPO_ROOT / "csrc", dest / "csrc")
        return
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", "--format=tar", rev, "csrc"],
                             capture_output=True)
    if archive.returncode != 0:
        fail(f"cannot export csrc/ of {rev!r}: {archive.stderr.decode().strip()} "
             "(build with --build-only where the repository's history is, then --run-only)")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        # The extraction filter exists from Python 3.12 (and in later 3.10/3.11 releases).
        tar.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))


def cutlass_include() -> Path:
    """The CUTLASS/CuTe headers, found as setup.py finds them (third_party/cutlass_headers.py)."""
    sys.path.insert(0, str(REPO_ROOT / "third_party"))
    from cutlass_headers import cutlass_include as find

    found = find()
    if found is None:
        fail("the build needs the CUTLASS headers: pip install nvidia-cutlass, or set CUTLASS_DIR")
    return found


def nvcc_flags() -> list[str]:
    manifest = json.loads((REPO_ROOT / "csrc" / "build_manifest.json").read_text())
    return list(manifest["nvcc_flags"]) + [f"-I{cutlass_include()}"]


def ptxas_report(kernel: str, label: str, log: str) -> list[str]:
    """What a tree's `ptxas -v` log says about it: for OSK one line per kernel (registers, bytes
    spilled), for KAP one line over its scoring kernels and one per other kernel that spills; and
    one line per warning that ptxas serialised a kernel's wgmmas: C7513 (a wgmma's input registers
    written inside its pipeline stage), C7514 (a wgmma's accumulator possibly read in flight) or
    C7518 (a wgmma in a divergent path), and one when it inserted a wgmma wait of its own (C7517:
    registers defined by a wgmma used where it could not prove the wgmma complete; at a loop's
    latch that wait runs every iteration). Each costs the overlap the kernels are built on, and
    none stops the build."""
    entries = list(zip(re.findall(r"Compiling entry function '(\S+)'", log),
                       re.findall(r"bytes stack frame, (\d+) bytes spill stores.*?\n.*?Used (\d+) registers", log)))
    lines = []
    if kernel == "osk":
        for name, (spilled, registers) in entries:
            skip = "skip" if name.endswith("Lb1EEEvNS0_15OskKernelParamsE") else "no skip"
            lines.append(f"  {label} ({skip}): {registers} registers, {spilled} bytes spilled")
    else:
        scoring = [(int(spilled), int(registers)) for name, (spilled, registers) in entries
                   if "kap_score_" in name]
        if scoring:
            lines.append(f"  {label}: {len(scoring)} scoring kernels, {min(r for _, r in scoring)}-"
                         f"{max(r for _, r in scoring)} registers, {sum(s for s, _ in scoring)} bytes spilled")
        lines += [f"  {label}: {name} spills {spilled} bytes" for name, (spilled, _) in entries
                  if "kap_score_" not in name and int(spilled) > 0]
    for code in sorted(set(re.findall(r"\((C751[348])\)", log))):
        lines.append(f"  {label}: ptxas serialised the wgmmas ({code})")
    injected = len(re.findall(r"\(C7517\)", log))
    if injected:
        lines.append(f"  {label}: ptxas inserted {injected} wgmma waits of its own (C7517)")
    return lines


def build(kernel: str, revs: list[str]) -> list[str]:
    """Compiles every tree's `kernel` and the harness; returns the labels, baseline first."""
    if shutil.which("nvcc") is None:
        fail("nvcc is not on PATH")
    build = build_dir(kernel)
    build.mkdir(parents=True, exist_ok=True)
    taken: set[str] = set()
    labels = [label_of(rev, taken) for rev in revs]
    flags = nvcc_flags()
    jobs = []
    for rev, label in zip(revs, labels):
        tree = build / label
        export_tree(rev, tree)
        command = ["nvcc", *flags, f"-I{tree / 'csrc'}", f"-DAB_NAMESPACE=cosa_ab_{label}",
                   f"-DAB_LABEL={label}", "-Xptxas", "-v", "-c", str(sources(kernel) / "variant_entry.cu"),
                   "-o", str(build / f"{label}.o")]
        print(f"compiling {kernel} of {rev} as {label}", file=sys.stderr, flush=True)
        jobs.append((label, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    for label, job in jobs:
        log = job.communicate()[0]
        if job.returncode != 0:
            print(log, file=sys.stderr)
            fail(f"{label} did not compile")
        for line in ptxas_report(kernel, label, log):
            print(line, file=sys.stderr)
    variants = " ".join(f"X({label})" for label in labels)
    subprocess.run(["nvcc", *flags, f"-I{REPO_ROOT / 'csrc'}", f"-I{REPO_ROOT / 'dev'}",
                    f"-DAB_VARIANTS(X)={variants}", "-c", str(sources(kernel) / "harness.cu"),
                    "-o", str(build / "harness.o")], check=True)
    subprocess.run(["nvcc", flags[0], str(build / "harness.o"), *(str(build / f"{label}.o") for label in labels),
                    "-o", str(harness_path(kernel))], check=True)
    labels_path(kernel).write_text(json.dumps({"revs": revs, "labels": labels}) + "\n")
    return labels


def run(kernel: str, rounds: int, cases: str, out_dir: str, inputs: str | None = None) -> int:
    harness, labels = harness_path(kernel), labels_path(kernel)
    if not harness.exists() or not labels.exists():
        fail(f"no {kernel} harness in {build_dir(kernel)}: build it first (without --run-only)")
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    from common import require_cuda, start_run, write_json  # imports torch: only where the run is

    require_cuda("dev/kernel_ab.py")
    built = json.loads(labels.read_text())
    meta, json_path = start_run(out_dir, f"{kernel}-ab")
    rows = []
    skipped_shares = {}  # (case, label) -> fraction
    command = [str(harness), str(rounds), cases] + ([inputs] if inputs else [])
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:
            match = ROW.match(line.strip())
            if match is None:
                skip = SKIPPED.match(line.strip())
                if skip is not None:
                    skipped_shares[skip.group(1), skip.group(2)] = float(skip.group(3)) / 100
                print(line, end="", flush=True)
                continue
            case, label, ms, ratio, q1, q3, mismatches, per_round = match.groups()
            rows.append({"case": case, "variant": label, "rev": built["revs"][built["labels"].index(label)],
                         "ms": float(ms), "ratio": float(ratio), "ratio_quartiles": [float(q1), float(q3)],
                         "mismatched_elements": int(mismatches),
                         "skipped_share": skipped_shares.get((case, label)),
                         "rounds_ms": [float(x) for x in per_round.split(",")]})
    write_json(json_path, {**meta, "config": {"kernel": kernel, "revs": built["revs"], "labels": built["labels"],
                                              "rounds": rounds, "cases": cases or "all",
                                              "inputs": Path(inputs).name if inputs else None}, "rows": rows})
    print(f"\nresults: {json_path}")
    return proc.returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("revs", nargs="*", help="git revisions, or . for the working tree; the first is the baseline")
    parser.add_argument("--kernel", choices=KERNELS, default="osk", help="which kernel to compare (default osk)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--build-only", action="store_true", help="compile, do not run (no GPU needed)")
    mode.add_argument("--run-only", action="store_true", help="run the harness built before, with its revisions")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (default 3)")
    parser.add_argument("--cases", default="", help="run only the cases whose name contains this text")
    parser.add_argument("--inputs", help="OSK: captured layers of a real model (bench/layers.py --save-ab-inputs), "
                                         "each timed as three more cases")
    parser.add_argument("--out", default=str(REPO_ROOT / "dev" / "results"),
                        help="folder for the results JSON (default dev/results/)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.inputs is not None and (args.kernel != "osk" or not Path(args.inputs).is_file()):
        parser.error("--inputs needs --kernel osk and an existing file")
    if args.run_only:
        if args.revs:
            parser.error("--run-only runs the revisions it was built with; give none")
    elif not args.revs:
        parser.error("name at least one revision (or . for the working tree)")
    if not args.run_only:
        build(args.kernel, args.revs)
        if args.build_only:
            print(f"built {harness_path(args.kernel)}")
            return 0
    return run(args.kernel, args.rounds, args.cases, args.out, args.inputs)


if __name__ == "__main__":
    sys.exit(main())
