"""The README's test command collects every test file under tests/: none sits in a folder pytest skips."""

from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path

TESTS = Path(__file__).parent


def test_no_test_folder_matches_a_pattern_pytest_does_not_recurse_into(request):
    patterns = request.config.getini("norecursedirs")
    folders = {path.parent for path in TESTS.rglob("test_*.py")}
    assert TESTS / "dist" in folders  # the folder pytest's default list skipped
    skipped = sorted(
        str(folder.relative_to(TESTS.parent))
        for folder in folders
        for part in folder.relative_to(TESTS).parts
        if any(fnmatch(part, pattern) for pattern in patterns)
    )
    assert not skipped, f"pytest's norecursedirs {patterns} skip {skipped}"
