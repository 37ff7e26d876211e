"""Every pointer into the docs resolves: where code or docs name `docs/<page>.md`, the page exists, and where
they name a section of it in quotes (`docs/native.md "Reproducibility"`), the page has a heading or a bold
paragraph lead containing those words. So a page can be split or a heading renamed without leaving readers
at a dead end. benchmarks/results/ is left out: its files are what commands printed at the time. And every
file benchmarks/results/INDEX.md names is in git (the folder's .gitignore lets through only what is named)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".h", ".cpp", ".txt", ".toml", ".sh"}
# docs/<page>.md, then optionally a quoted section name (double, curly or single quotes, over line breaks)
REFERENCE = re.compile(r"docs/([\w./-]+\.md)(?:,?\s+(?:[\"“]([^\"”]+)[\"”]|'([^'\n]+)'))?")


def normalised(text: str) -> str:
    """Lower case, backticks dropped, whitespace runs as one space (references wrap across lines)."""
    return " ".join(text.replace("`", "").split()).lower()


def section_names(page: Path) -> list[str]:
    """The page's headings and bold paragraph leads, normalised."""
    text = page.read_text()
    headings = [line.lstrip("#") for line in text.splitlines() if line.startswith("#")]
    return [normalised(name) for name in headings + re.findall(r"\*\*([^*]+)\*\*", text)]


def references() -> list[tuple[str, str, str | None]]:
    """(file, page, section or None) for every reference in the tracked text files."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    found = []
    for name in tracked.stdout.split():
        path = ROOT / name
        is_text = path.suffix in TEXT_SUFFIXES or path.name == "Makefile"
        if not is_text or not path.is_file() or name.startswith("benchmarks/results/"):
            continue
        for match in REFERENCE.finditer(path.read_text(errors="replace")):
            found.append((name, match.group(1), match.group(2) or match.group(3)))
    return found


def test_the_references_are_found():
    # the pattern itself works: the docs are referenced from code and from other docs, with sections
    refs = references()
    assert len(refs) > 100
    assert any(section for _, _, section in refs)
    assert any(name.startswith("k3/") for name, _, _ in refs)
    assert ("k3/ops/doctor.py", "native-cpus.md", "A shared machine") in refs  # in single quotes


def test_every_referenced_page_and_section_exists():
    pages: dict[str, list[str]] = {}
    broken = []
    for name, page, section in references():
        path = ROOT / "docs" / page
        if not path.is_file():
            broken.append(f"{name}: docs/{page} does not exist")
            continue
        if section is None:
            continue
        names = pages.setdefault(page, section_names(path))
        if not any(normalised(section) in heading for heading in names):
            broken.append(f'{name}: docs/{page} has no heading or bold lead containing "{section}"')
    assert not broken, "\n".join(broken)


def test_a_broken_reference_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n## MXFP4 GEMV: one kernel\n**One call a step**: text\n")
    names = section_names(page)
    assert any(normalised("MXFP4\n  GEMV") in n for n in names)
    assert any(normalised("one call a step") in n for n in names)
    assert not any(normalised("a kernel that is not there") in n for n in names)


def expanded(name: str) -> list[str]:
    """A shell brace pattern's names: `runs/{a,b}/log.csv` -> runs/a/log.csv, runs/b/log.csv."""
    match = re.search(r"\{([^{}]*)\}", name)
    if match is None:
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    return [full for part in match.group(1).split(",") for full in expanded(head + part + tail)]


def test_every_result_the_index_names_is_in_git():
    """benchmarks/results/.gitignore keeps only the files INDEX.md names: a result named there but not
    allowed through (so present here, absent from every clone) is a dead reference."""
    results = ROOT / "benchmarks" / "results"
    tracked = subprocess.run(
        ["git", "ls-files", "benchmarks/results"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    in_git = {Path(name).relative_to("benchmarks/results").as_posix() for name in tracked}
    named = re.findall(r"^\| `([^`]+)` \|", (results / "INDEX.md").read_text(), flags=re.MULTILINE)
    assert len(named) > 100 and expanded("r/{a,b}/{x,y}.csv")[1:3] == ["r/a/y.csv", "r/b/x.csv"]
    folders = {str(folder) for path in in_git for folder in Path(path).parents}  # a named folder: its files
    missing = [
        name
        for pattern in named
        for name in expanded(pattern)
        if name not in in_git and name.rstrip("/") not in folders
    ]
    assert not missing, f"named in benchmarks/results/INDEX.md but not in git: {missing}"
