"""Fixtures for the sandbox tests: a state root shared by the session, each backend as a parameter (a
missing backend is a skip locally and a failure under CI=true, since `make test` installs both), and a
`leftovers` check that lists what a sandbox could leave behind."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

BACKENDS = ("gvisor", "bwrap")
TOOLS = {"gvisor": "runsc", "bwrap": "bwrap"}


def backend_missing(backend: str) -> str | None:
    if os.geteuid() != 0:
        return "the sandbox backends need root (cgroups, the workspace tmpfs)"
    if shutil.which(TOOLS[backend]) is None:
        return f"{TOOLS[backend]} is not installed (make sandbox-tools)"
    return None


def require(backend: str) -> None:
    why = backend_missing(backend)
    if why is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"backend {backend} unavailable under CI=true: {why}")
    pytest.skip(why)


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


def leftovers(root: Path, sid: str) -> list[str]:
    """Every process, cgroup, mount and directory that still carries the sandbox id `sid`."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmdline = (
                    Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
            except OSError:
                continue
            if sid in cmdline:
                found.append(f"process {pid}: {cmdline[:120]}")
    for dirpath, dirnames, _ in os.walk("/sys/fs/cgroup"):
        if os.path.basename(dirpath) == "k3-sandbox":
            found += [f"cgroup {dirpath}/{d}" for d in dirnames if sid in d]
            dirnames.clear()
        elif dirpath.count("/") > 5:
            dirnames.clear()
    found += [f"mount {line}" for line in Path("/proc/mounts").read_text().splitlines() if sid in line]
    if (root / "sandboxes" / sid).exists():
        found.append(f"directory {root / 'sandboxes' / sid}")
    return found
