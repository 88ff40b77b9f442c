"""dev/kernel_ab.py on the CPU: its arguments, the tree labels, the compiler reports, the harness's
result lines, and (where nvcc and the CUTLASS headers are) builds of two source trees into one harness
binary, for OSK and for KAP."""

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "dev"))
import kernel_ab  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
HAS_GIT_HISTORY = (REPO_ROOT / ".git").exists() and shutil.which("git") is not None
CAN_BUILD = (shutil.which("nvcc") is not None
             and (bool(os.environ.get("CUTLASS_DIR")) or importlib.util.find_spec("cutlass_library") is not None))


def test_labels_are_unique_c_identifiers():
    taken: set[str] = set()
    labels = [kernel_ab.label_of(rev, taken) for rev in (".", "main", "feature/x-1", "feature_x_1", "main")]
    assert labels == ["worktree", "main", "feature_x_1", "feature_x_1_2", "main_2"]


@pytest.mark.parametrize("argv, named", [
    (["--rounds", "0", "main"], "--rounds"),
    (["--run-only", "main"], "--run-only"),
    ([], "revision"),
    (["--build-only", "--run-only", "main"], "--run-only"),
    (["--kernel", "select", "main"], "--kernel"),
])
def test_bad_arguments_are_refused_by_name(argv, named, capsys):
    with pytest.raises(SystemExit) as stop:
        kernel_ab.main(argv)
    assert stop.value.code == 2
    assert named in capsys.readouterr().err


def test_ptxas_report_names_both_serialisation_warnings():
    log = ("ptxas info    : Compiling entry function '_ZN1p3osk14osk_fwd_kernelILb0EEEvNS0_15OskKernelParamsE' for 'sm_90a'\n"
           "ptxas info    : (C7513) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
           "non wgmma instructions defining input registers of a wgmma between start and end of the pipeline stage\n"
           "ptxas info    : Function properties for x\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 168 registers\n")
    assert kernel_ab.ptxas_report("osk", "v", log) == ["  v (no skip): 168 registers, 0 bytes spilled",
                                                       "  v: ptxas serialised the wgmmas (C7513)"]
    assert (kernel_ab.ptxas_report("osk", "v", log.replace("C7513", "C7514"))[-1]
            == "  v: ptxas serialised the wgmmas (C7514)")
    assert len(kernel_ab.ptxas_report("osk", "v", log.replace("(C7513)", ""))) == 1


def test_ptxas_report_summarises_kap_scoring_kernels_and_names_other_spills():
    def entry(name, registers, spilled):
        return (f"ptxas info    : Compiling entry function '{name}' for 'sm_90a'\n"
                "ptxas info    : Function properties for x\n"
                f"    0 bytes stack frame, {spilled} bytes spill stores, {spilled} bytes spill loads\n"
                f"ptxas info    : Used {registers} registers\n")
    log = (entry("_ZN1p3kap16kap_score_kernelILi1EEEvv", 238, 0) + entry("_ZN1p3kap25kap_score_resident_kernelILi2EEEvv", 254, 0)
           + entry("_ZN1p3kap16kap_index_kernelEv", 40, 0) + entry("_ZN1p3kap17kap_select_kernelEv", 255, 16)
           + "ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are serialized\n")
    assert kernel_ab.ptxas_report("kap", "v", log) == [
        "  v: 2 scoring kernels, 238-254 registers, 0 bytes spilled",
        "  v: _ZN1p3kap17kap_select_kernelEv spills 16 bytes",
        "  v: ptxas serialised the wgmmas (C7518)"]


def test_ptxas_report_counts_the_waits_ptxas_inserts():
    injected = ("ptxas info    : (C7517) warpgroup.wait is injected in around line 27127 by compiler to allow use "
                "of registers defined by GMMA in function '_ZN1p3kap16kap_score_kernelILi1EEEvv'\n")
    assert kernel_ab.ptxas_report("kap", "v", 2 * injected)[-1] == "  v: ptxas inserted 2 wgmma waits of its own (C7517)"
    assert kernel_ab.ptxas_report("kap", "v", "") == []


def test_row_lines_parse():
    line = ("ROW case=random-25%-16K variant=osk_tree_max ms=1.0800 ratio=0.9700 q1=0.9600 q3=0.9900 mismatches=0 "
            "rounds=1.1,1.08,1.07")
    case, label, ms, ratio, q1, q3, mismatches, rounds = kernel_ab.ROW.match(line).groups()
    assert (case, label, float(ms), float(ratio), float(q1), float(q3), int(mismatches)) == (
        "random-25%-16K", "osk_tree_max", 1.08, 0.97, 0.96, 0.99, 0)
    assert [float(x) for x in rounds.split(",")] == [1.1, 1.08, 1.07]



def test_skipped_share_lines_parse():
    line = "real-L12-32K, osk_vote_early_out: 36.5% of the blocks after each list's first skipped"
    case, label, percent = kernel_ab.SKIPPED.match(line).groups()
    assert (case, label, float(percent)) == ("real-L12-32K", "osk_vote_early_out", 36.5)
    assert kernel_ab.SKIPPED.match("ROW case=x variant=y ms=1 ratio=1 q1=1 q3=1 mismatches=0 rounds=1") is None

@pytest.mark.skipif(not HAS_GIT_HISTORY, reason="needs the repository's git history")
def test_unknown_revision_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        kernel_ab.export_tree("no-such-revision-anywhere", tmp_path / "tree")
    assert stop.value.code == 2
    assert "no-such-revision-anywhere" in capsys.readouterr().err


def test_run_without_a_build_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(kernel_ab, "BUILD_ROOT", tmp_path)
    with pytest.raises(SystemExit) as stop:
        kernel_ab.main(["--kernel", "kap", "--run-only"])
    assert stop.value.code == 2
    assert "no kap harness" in capsys.readouterr().err


@pytest.mark.skipif(not (CAN_BUILD and HAS_GIT_HISTORY), reason="needs nvcc, the CUTLASS headers and git history")
@pytest.mark.parametrize("kernel", kernel_ab.KERNELS)
def test_two_trees_build_into_one_harness(tmp_path, monkeypatch, kernel):
    monkeypatch.setattr(kernel_ab, "BUILD_ROOT", tmp_path)
    assert kernel_ab.build(kernel, [".", "HEAD"]) == ["worktree", "HEAD"]
    harness = tmp_path / kernel / f"{kernel}_ab_harness"
    assert harness.exists()
    binary = harness.read_bytes()
    for label in (b"worktree", b"HEAD"):  # each tree's entry point and kernels, in its own namespace
        assert f"run_{kernel}_".encode() + label in binary and b"cosa_ab_" + label in binary
