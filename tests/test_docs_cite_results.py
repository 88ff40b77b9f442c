"""bench/results holds the runs the reference documents cite, and only those: every result file a
document names is in the tree, and every file in the tree is named (a plot counts as named with its
JSON). docs/journal.md, the record of earlier runs, may name files that left the tree (git keeps them)."""

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "bench" / "results"
HISTORY_ONLY = {REPO_ROOT / "docs" / "journal.md"}

# A result file: <bench>-<YYYYMMDD>-<HHMMSS>-<commit>[-suffix].<json|png>. Documents shorten a second
# run of the same bench, day and commit to `-HHMMSS-` after a full name on the same line.
FULL_NAME = re.compile(r"(?P<bench>[a-z][a-z0-9_-]*?)-(?P<day>20\d{6})-(?P<time>\d{6})-(?P<commit>[0-9a-f]{7,8})"
                       r"(?P<rest>[A-Za-z0-9_.-]*?\.(?:json|png))")
SHORT_NAME = re.compile(r"`-(\d{6})-`")


def names_in(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        last = None
        for match in sorted([*FULL_NAME.finditer(line), *SHORT_NAME.finditer(line)], key=lambda m: m.start()):
            if match.re is FULL_NAME:
                last = match
                names.add(match.group(0))
            elif last is not None:
                names.add(f"{last['bench']}-{last['day']}-{match.group(1)}-{last['commit']}{last['rest']}")
    return names


def reference_documents() -> list[Path]:
    skipped = {".git", "results", "build", "third_party"}
    return [path for path in REPO_ROOT.rglob("*.md")
            if not skipped.intersection(path.relative_to(REPO_ROOT).parts[:-1])
            and not path.relative_to(REPO_ROOT).parts[0].startswith((".venv", "build"))
            and path not in HISTORY_ONLY]


def test_names_in_reads_full_and_shortened_names():
    line = "runs `layers-20261206-201413-05d8d12b.json`, `-201602-`, `-201724-`; `kernel-20261201-062403-484fdf4.json`"
    assert names_in(line) == {"layers-20261206-201413-05d8d12b.json", "layers-20261206-201602-05d8d12b.json",
                              "layers-20261206-201724-05d8d12b.json", "kernel-20261201-062403-484fdf4.json"}
    assert names_in("`-201602-` alone names nothing") == set()


def cited() -> dict[str, list[str]]:
    by_name: dict[str, list[str]] = {}
    for path in reference_documents():
        for name in names_in(path.read_text()):
            by_name.setdefault(name, []).append(str(path.relative_to(REPO_ROOT)))
    return by_name


def test_every_cited_result_file_is_in_the_tree():
    missing = {name: docs for name, docs in cited().items() if not (RESULTS / name).is_file()}
    assert not missing, f"documents cite result files that bench/results does not hold: {missing}"


def test_every_result_file_in_the_tree_is_cited():
    names = set(cited())
    uncited = [path.name for path in RESULTS.iterdir()
               if path.name not in names and not (path.suffix == ".png" and f"{path.stem}.json" in names)]
    assert not uncited, f"bench/results holds files no reference document cites: {sorted(uncited)}"
