"""Helpers of the sandbox tests (a basename of its own, as pytest imports test modules by basename):
`require` (a missing backend is a skip locally and a failure under CI=true, since `make test` installs
both) and `leftovers` (what a sandbox could leave behind). The fixtures are in conftest.py."""

from __future__ import annotations

import os
import shutil
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
    if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):  # as tests/conftest.py reads it
        pytest.fail(f"backend {backend} unavailable under CI=true: {why}")
    pytest.skip(why)


def leftovers(root: Path, sid: str) -> list[str]:
    """Every process, cgroup, mount and directory that still carries the sandbox id `sid`."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmdline = (
                    Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
                cgroups = Path(f"/proc/{pid}/cgroup").read_text()
            except OSError:
                continue
            if sid in cmdline or sid in cgroups:  # its own arguments, or a process inside its cgroup
                found.append(f"process {pid}: {cmdline}")
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
