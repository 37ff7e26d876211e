"""What a test may skip for, and why CI cannot pass by skipping.

`make test` installs everything the tests use (the dev extra, the native kernels, Chromium). So with
`CI=true` no test may skip: a skip there (a missing tool, unbuilt kernels, any `pytest.skip`) is reported
as a failure that names its reason. Locally, without CI, a test that lacks a tool skips and says which.

Tests that need an external program ask for it with the `require_tool` fixture:

    def test_in_a_browser(require_tool):
        chromium = require_tool("chromium", install="apt-get install -y chromium")
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import pytest

import k3  # noqa: F401  (sets MKL_CBWR before any test's first MKL product: k3.ops.reproducible)

IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require_tool(name: str, *, path: str | None = None, install: str = "") -> str:
    """The full path of the program `name` (or of `path`, if that file exists): skips the test without it,
    fails it under CI=true."""
    found = path if path is not None and os.path.exists(path) else shutil.which(name)
    if found is None:
        how = f" ({install})" if install else ""
        reason = f"needs {name}{how}"
        if IN_CI:
            pytest.fail(f"{reason}: under CI=true a missing tool fails the test", pytrace=False)
        pytest.skip(reason)
    return found


@pytest.fixture(name="require_tool", scope="session")
def require_tool_fixture() -> Callable[..., str]:
    return require_tool


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Under CI=true every skip (skipif marks, pytest.skip, importorskip) becomes a failure."""
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, which may not skip: {reason}"
