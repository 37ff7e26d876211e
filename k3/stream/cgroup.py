"""A memory cgroup for one child process, cgroup v1 (`memory.limit_in_bytes`) or v2 (`memory.max`): how the
tests and benchmarks/stream.py measure a run's memory by the kernel, with the checkpoint's page cache
dropped first (`drop_page_cache`) so that pages charged elsewhere do not hide the cost.

The child joins the group first thing (so everything it maps is charged there), warms up, then sets its
own limit to what it uses plus an allowance: the limit measures the work, not the Python runtime.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


class MemoryCgroup:
    def __init__(self, path: Path, v2: bool) -> None:
        self.path, self.v2 = path, v2

    @classmethod
    def create(cls) -> MemoryCgroup | None:
        """A fresh group, or None when this machine lets us make none (no memory controller, no rights)."""
        name = f"k3-stream-test-{uuid.uuid4().hex[:8]}"
        v2 = (V2 / "cgroup.controllers").is_file() and "memory" in (V2 / "cgroup.controllers").read_text()
        base = V2 if v2 else V1
        if not (base / "cgroup.procs").is_file():
            return None
        try:
            (base / name).mkdir()
        except OSError:
            return None
        return cls(base / name, v2)

    @property
    def files(self) -> dict[str, str]:
        """The file names a child needs (it is told them on its command line)."""
        if self.v2:
            return {
                "procs": "cgroup.procs",
                "usage": "memory.current",
                "limit": "memory.max",
                "peak": "memory.peak",
            }
        return {
            "procs": "cgroup.procs",
            "usage": "memory.usage_in_bytes",
            "limit": "memory.limit_in_bytes",
            "peak": "memory.max_usage_in_bytes",
        }

    def oom_kills(self) -> int:
        if self.v2:
            events = dict(line.split() for line in (self.path / "memory.events").read_text().splitlines())
            return int(events.get("oom_kill", 0))
        control = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
        return int(control.get("oom_kill", 0))

    def remove(self) -> None:
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def swap_is_off() -> bool:
    return len(Path("/proc/swaps").read_text().splitlines()) <= 1


def drop_page_cache(directory: Path) -> None:
    """POSIX_FADV_DONTNEED on every file of a folder: its pages leave the page cache (they are clean)."""
    for file in Path(directory).iterdir():
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
