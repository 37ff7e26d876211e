"""Fixtures for the sandbox tests: a state root shared by the session and each backend as a parameter."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from sandbox_testing import BACKENDS, require


@pytest.fixture(scope="session")
def root():
    """A state root any user can traverse (bwrap runs as nobody), removed at the end."""
    path = Path(tempfile.mkdtemp(prefix="k3-sandbox-tests-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    require(request.param)
    return request.param
