"""bench/osk_ab.py on the CPU: its arguments, the tree labels, the harness's result lines, and (where
nvcc and the CUTLASS headers are) a build of two source trees into one harness binary."""

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import osk_ab  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
HAS_GIT_HISTORY = (REPO_ROOT / ".git").exists() and shutil.which("git") is not None
CAN_BUILD = (shutil.which("nvcc") is not None
             and (bool(os.environ.get("CUTLASS_DIR")) or importlib.util.find_spec("cutlass_library") is not None))


def test_labels_are_unique_c_identifiers():
    taken: set[str] = set()
    labels = [osk_ab.label_of(rev, taken) for rev in (".", "main", "feature/x-1", "feature_x_1", "main")]
    assert labels == ["worktree", "main", "feature_x_1", "feature_x_1_2", "main_2"]


@pytest.mark.parametrize("argv, named", [
    (["--rounds", "0", "main"], "--rounds"),
    (["--run-only", "main"], "--run-only"),
    ([], "revision"),
    (["--build-only", "--run-only", "main"], "--run-only"),
])
def test_bad_arguments_are_refused_by_name(argv, named, capsys):
    with pytest.raises(SystemExit) as stop:
        osk_ab.main(argv)
    assert stop.value.code == 2
    assert named in capsys.readouterr().err


def test_ptxas_report_names_both_serialisation_warnings():
    log = ("ptxas info    : Compiling entry function '_ZN1p3osk14osk_fwd_kernelILb0EEEvNS0_15OskKernelParamsE' for 'sm_90a'\n"
           "ptxas info    : (C7513) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
           "non wgmma instructions defining input registers of a wgmma between start and end of the pipeline stage\n"
           "ptxas info    : Function properties for x\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 168 registers\n")
    assert osk_ab.ptxas_report("v", log) == ["  v (no skip): 168 registers, 0 bytes spilled",
                                             "  v: ptxas serialised the wgmmas (C7513)"]
    assert osk_ab.ptxas_report("v", log.replace("C7513", "C7514"))[-1] == "  v: ptxas serialised the wgmmas (C7514)"
    assert len(osk_ab.ptxas_report("v", log.replace("(C7513)", ""))) == 1


def test_row_lines_parse():
    line = "ROW case=random-25%-16K variant=osk_tree_max ms=1.0800 ratio=0.9700 mismatches=0 rounds=1.1,1.08,1.07"
    case, label, ms, ratio, mismatches, rounds = osk_ab.ROW.match(line).groups()
    assert (case, label, float(ms), float(ratio), int(mismatches)) == ("random-25%-16K", "osk_tree_max", 1.08, 0.97, 0)
    assert [float(x) for x in rounds.split(",")] == [1.1, 1.08, 1.07]


@pytest.mark.skipif(not HAS_GIT_HISTORY, reason="needs the repository's git history")
def test_unknown_revision_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        osk_ab.export_tree("no-such-revision-anywhere", tmp_path / "tree")
    assert stop.value.code == 2
    assert "no-such-revision-anywhere" in capsys.readouterr().err


def test_run_without_a_build_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(osk_ab, "HARNESS", tmp_path / "osk_ab_harness")
    monkeypatch.setattr(osk_ab, "LABELS", tmp_path / "labels.json")
    with pytest.raises(SystemExit) as stop:
        osk_ab.main(["--run-only"])
    assert stop.value.code == 2
    assert "build it first" in capsys.readouterr().err


@pytest.mark.skipif(not (CAN_BUILD and HAS_GIT_HISTORY), reason="needs nvcc, the CUTLASS headers and git history")
def test_two_trees_build_into_one_harness(tmp_path, monkeypatch):
    monkeypatch.setattr(osk_ab, "BUILD", tmp_path)
    monkeypatch.setattr(osk_ab, "HARNESS", tmp_path / "osk_ab_harness")
    monkeypatch.setattr(osk_ab, "LABELS", tmp_path / "labels.json")
    assert osk_ab.build([".", "HEAD"]) == ["worktree", "HEAD"]
    assert (tmp_path / "osk_ab_harness").exists()
    binary = (tmp_path / "osk_ab_harness").read_bytes()
    for label in (b"worktree", b"HEAD"):  # each tree's entry point and kernels, in its own namespace
        assert b"run_osk_" + label in binary and b"cosa_ab_" + label in binary
