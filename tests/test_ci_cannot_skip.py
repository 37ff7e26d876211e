"""tests/conftest.py under CI=true: a skip of any kind fails (and says why); without CI it stays a skip."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()
SKIPPING = """
import pytest

def test_skip_call():
    pytest.skip("no frobnicator")

@pytest.mark.skipif(True, reason="kernels not built")
def test_skipif_mark():
    pass

def test_missing_tool(require_tool):
    require_tool("surely-no-such-program-k3", install="apt-get install frobnicator")

def test_importorskip():
    pytest.importorskip("surely_no_such_module_k3")

@pytest.mark.xfail(reason="known", strict=True)
def test_expected_failure():
    assert False

def test_passes():
    pass
"""


@pytest.mark.parametrize("ci", ["true", ""])
def test_skips_fail_only_under_ci(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str):
    monkeypatch.setenv("CI", ci)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_skipping=SKIPPING)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")
    if ci:
        result.assert_outcomes(passed=1, failed=3, errors=1, xfailed=1)
        result.stdout.fnmatch_lines(["*skipped under CI=true*no frobnicator*"])
        result.stdout.fnmatch_lines(["*skipped under CI=true*kernels not built*"])
        result.stdout.fnmatch_lines(["*needs surely-no-such-program-k3 (apt-get install frobnicator)*"])
    else:
        result.assert_outcomes(passed=1, skipped=4, xfailed=1)
