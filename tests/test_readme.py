"""The README stays true: short, two commands to start, a file tree equal to `git ls-files k3`, the room order
the import test enforces, and tolerances it states equal to those the tests allow."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from test_import_direction import LEVEL

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    """The text under `## title`, up to the next `## ` heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, flags=re.M | re.S)
    assert match, f"README.md has no section '## {title}'"
    return match.group(1)


def first_code_block(text: str) -> list[str]:
    match = re.search(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
    assert match, "no code block"
    return match.group(1).splitlines()


def tree_files(lines: list[str]) -> set[str]:
    """Paths named by an indented tree: `dir/` opens a folder (deeper lines are inside it), the names after
    it on its line and the names on other lines are files, `# ...` is a comment."""
    files: set[str] = set()
    stack: list[tuple[int, str]] = []  # (indent, folder path ending in "/")
    for line in lines:
        names = line.split("#", 1)[0]
        if not names.strip():
            continue
        indent = len(names) - len(names.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else ""
        tokens = names.split()
        if tokens[0].endswith("/"):
            parent += tokens[0]
            stack.append((indent, parent))
            tokens = tokens[1:]
        files |= {parent + name for name in tokens}
    return files


def test_at_most_150_lines():
    assert len(README.splitlines()) <= 150


def test_the_quick_start_is_the_two_commands():
    commands = [line.split("#", 1)[0].strip() for line in first_code_block(section("Quick start"))]
    assert [c for c in commands if c] == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, flags=re.M) and re.search(r"^test:", makefile, flags=re.M)


def test_the_file_tree_is_every_file_of_k3():
    tracked = subprocess.run(
        ["git", "ls-files", "k3"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    listed = {p for p in tree_files(first_code_block(section("The file tree"))) if p.startswith("k3/")}
    missing, extra = sorted(set(tracked) - listed), sorted(listed - set(tracked))
    assert not missing and not extra, (
        "README.md's file tree differs from `git ls-files k3`:\n"
        f"  in git, missing from the tree: {missing}\n  in the tree, not in git: {extra}"
    )


def test_tree_parser_on_a_planted_tree():
    lines = [
        "k3/",
        "  a.py b.py     # two files",
        "                # a continued comment",
        "  sub/ c.json   # a folder with a file on its line",
        "    d.py",
        "    deep/x/ y.txt",
        "  e.py",
        "tests/          # not listed file by file",
    ]
    assert tree_files(lines) == {
        "k3/a.py",
        "k3/b.py",
        "k3/sub/c.json",
        "k3/sub/d.py",
        "k3/sub/deep/x/y.txt",
        "k3/e.py",
    }


def test_the_room_order_is_the_one_the_import_test_enforces():
    order = re.search(r"`(ops < [^`]*)`", section("The file tree"))
    assert order, "the file tree section states the room order as `ops < ... < cli`"
    levels = [group.split("/") for group in order.group(1).split(" < ")]
    for i, group in enumerate(levels):
        for room in group:
            assert all(LEVEL[room] == LEVEL[other] for other in group), room
            for later in (r for g in levels[i + 1 :] for r in g):
                assert LEVEL[room] < LEVEL[later], (room, later)


# (what the README says, the test file, the tolerance as that test writes it)
CLAIMS = [
    ("allowed 1e-4) and a float64 reference", "tests/model/test_kimi_linear_parity.py", "<= 1e-4 * scale"),
    ("measured 2.9e-6, allowed 1e-4", "tests/model/test_k3_parity.py", "<= 1e-4 * scale"),
    ("(scores\n  within 1e-6)", "tests/model/test_record_routing.py", "rtol=0, atol=1e-6"),
    ("bit for bit", "tests/model/test_record_routing.py", "torch.equal(replayed, expected)"),
    ("full forward (1e-4 allowed)", "tests/engine/test_engine.py", "atol=1e-4, rtol=1e-4"),
    ("relative RMS <= 1e-5 allowed", "tests/ops/test_kda.py", "rel_rms(o, o_ref) <= 1e-5"),
]


@pytest.mark.parametrize("claim, test_file, tolerance", CLAIMS)
def test_stated_tolerances_are_those_the_tests_allow(claim, test_file, tolerance):
    assert claim in README
    assert tolerance in (ROOT / test_file).read_text()
