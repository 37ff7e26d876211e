"""One small interface over cgroup v1 (a directory per controller: memory, pids, cpu) and cgroup v2 (one
unified directory): create a group with limits, put a process in it, read its OOM kills and pids-limit
hits, its CPU time and memory, kill everything in it, remove it. `Cgroup.detect()` picks the version this
machine mounts."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import NamedTuple

from k3.sandbox.types import Limits, SandboxError

CFS_PERIOD_US = 100_000
V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")  # cpu and cpuacct may be one mount (then twice)


def _read_key(path: Path, key: str) -> int:
    """The integer after `key` in a flat-keyed cgroup file ("oom_kill 3"); 0 when file or key is absent."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except OSError:
        pass
    return 0


class Memory(NamedTuple):
    """A cgroup's memory in bytes: `used` without the page cache, `cache` (the file pages on the LRU lists:
    not shared memory, which holds a gVisor guest's memory and counts as used), `limit`."""

    used: int
    cache: int
    limit: int


def _read_int(path: Path) -> int:
    """The integer a one-value cgroup file holds ("max", as cgroup v2 writes no limit, is -1); 0 if absent."""
    try:
        text = path.read_text().strip()
    except OSError:
        return 0
    return -1 if text == "max" else int(text)


class Cgroup:
    """A cgroup named `name` (a relative path such as "k3-sandbox/sbx-1") under the mount `root`."""

    version: int

    def __init__(self, root: Path, name: str):
        self.root = Path(root)
        self.name = name

    @staticmethod
    def detect(root: Path = Path("/sys/fs/cgroup")) -> type[Cgroup]:
        if (root / "cgroup.controllers").exists():
            return CgroupV2
        if all((root / c / "cgroup.procs").exists() for c in V1_CONTROLLERS):
            return CgroupV1
        raise SandboxError(f"no usable cgroup mount under {root} (need v2, or v1 with {V1_CONTROLLERS})")

    def dirs(self) -> list[Path]:
        """Every directory this group occupies (one per v1 controller, one for v2)."""
        raise NotImplementedError

    def every_dir(self) -> list[Path]:
        """Every directory of this name in every hierarchy: runsc creates its container's group in all of
        them (v1: cpuset, devices, freezer, ... too), and all of them must go."""
        return self.dirs()

    def procs_files(self) -> list[Path]:
        """The cgroup.procs files a process writes its pid into to join the group."""
        return [d / "cgroup.procs" for d in self.dirs()]

    def create(self, limits: Limits, cpu: bool = True, pids: int | None = None) -> None:
        """Make the group with `limits` (the CPU quota only if `cpu`; `pids` overrides limits.pids)."""
        raise NotImplementedError

    def oom_kills(self) -> int:
        raise NotImplementedError

    def pids_limit_hits(self) -> int:
        raise NotImplementedError

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the group's processes used, in seconds."""
        raise NotImplementedError

    def memory(self) -> Memory:
        """The group's memory now (its children's included) and its limit, in bytes."""
        raise NotImplementedError

    def pids(self) -> set[int]:
        """Every process in the group and in the groups below it."""
        found: set[int] = set()
        for d in self.dirs():
            for dirpath, _, files in os.walk(d):
                if "cgroup.procs" in files:
                    try:
                        found.update(int(p) for p in Path(dirpath, "cgroup.procs").read_text().split())
                    except OSError:
                        pass
        return found

    def kill_all(self, deadline_s: float = 5.0) -> None:
        """SIGKILL every process in the group until it is empty (a forking process is caught on a later
        pass; the pids limit bounds how many there can be)."""
        end = time.monotonic() + deadline_s
        while (pids := self.pids()) and time.monotonic() < end:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.005)

    def remove(self) -> None:
        """Kill what is left, then remove the group's directories (deepest first)."""
        self.kill_all()
        below = [Path(p) for d in self.every_dir() for p, _, _ in os.walk(d, topdown=False)]
        for d in below:  # children first
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)

    def _write(self, path: Path, value: str) -> None:
        try:
            path.write_text(value)
        except OSError as e:
            raise SandboxError(f"cannot set {path} to {value!r}: {e}") from e


class CgroupV1(Cgroup):
    """cgroup v1: memory.limit_in_bytes + memory.memsw.limit_in_bytes (no swap), pids.max,
    cpu.cfs_quota_us / cpu.cfs_period_us; OOM kills from memory.oom_control, limit hits from pids.events."""

    version = 1

    def dirs(self) -> list[Path]:
        return [self.root / c / self.name for c in V1_CONTROLLERS]

    def every_dir(self) -> list[Path]:
        hierarchies = sorted(p for p in self.root.iterdir() if (p / "cgroup.procs").exists())
        return [h / self.name for h in hierarchies]

    def create(self, limits: Limits, cpu: bool = True, pids: int | None = None) -> None:
        for d in self.dirs():
            d.mkdir(parents=True, exist_ok=True)
        mem, pid_dir, cpu_dir, _ = self.dirs()
        memory = str(limits.memory_mb << 20)
        self._write(mem / "memory.limit_in_bytes", memory)
        if (mem / "memory.memsw.limit_in_bytes").exists():
            self._write(mem / "memory.memsw.limit_in_bytes", memory)
        self._write(pid_dir / "pids.max", str(pids or limits.pids))
        if cpu:
            self._write(cpu_dir / "cpu.cfs_period_us", str(CFS_PERIOD_US))
            self._write(cpu_dir / "cpu.cfs_quota_us", str(round(limits.cpus * CFS_PERIOD_US)))

    def oom_kills(self) -> int:
        return _read_key(self.dirs()[0] / "memory.oom_control", "oom_kill")

    def pids_limit_hits(self) -> int:
        return _read_key(self.dirs()[1] / "pids.events", "max")

    def cpu_seconds(self) -> float:
        try:
            return int((self.dirs()[3] / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            return 0.0

    def memory(self) -> Memory:
        mem = self.dirs()[0]
        stat = mem / "memory.stat"  # total_: the children's too
        cache = _read_key(stat, "total_active_file") + _read_key(stat, "total_inactive_file")
        used = _read_int(mem / "memory.usage_in_bytes") - cache
        return Memory(max(used, 0), cache, _read_int(mem / "memory.limit_in_bytes"))


class CgroupV2(Cgroup):
    """cgroup v2: memory.max + memory.swap.max = 0, pids.max, cpu.max "quota period"; OOM kills from
    memory.events, limit hits from pids.events. Controllers are enabled down the path first."""

    version = 2

    def dirs(self) -> list[Path]:
        return [self.root / self.name]

    def create(self, limits: Limits, cpu: bool = True, pids: int | None = None) -> None:
        parts = Path(self.name).parts
        for i in range(len(parts)):  # every ancestor must delegate the controllers to its children
            parent = self.root.joinpath(*parts[:i])
            parent.mkdir(parents=True, exist_ok=True)
            self._write(parent / "cgroup.subtree_control", "+memory +pids +cpu")
        d = self.dirs()[0]
        d.mkdir(exist_ok=True)
        self._write(d / "memory.max", str(limits.memory_mb << 20))
        if (d / "memory.swap.max").exists():
            self._write(d / "memory.swap.max", "0")
        self._write(d / "pids.max", str(pids or limits.pids))
        if cpu:
            self._write(d / "cpu.max", f"{round(limits.cpus * CFS_PERIOD_US)} {CFS_PERIOD_US}")

    def oom_kills(self) -> int:
        return _read_key(self.dirs()[0] / "memory.events", "oom_kill")

    def pids_limit_hits(self) -> int:
        return _read_key(self.dirs()[0] / "pids.events", "max")

    def cpu_seconds(self) -> float:
        return _read_key(self.dirs()[0] / "cpu.stat", "usage_usec") / 1e6

    def memory(self) -> Memory:
        d = self.dirs()[0]
        cache = _read_key(d / "memory.stat", "active_file") + _read_key(d / "memory.stat", "inactive_file")
        used = _read_int(d / "memory.current") - cache
        return Memory(max(used, 0), cache, _read_int(d / "memory.max"))

    def kill_all(self, deadline_s: float = 5.0) -> None:
        kill = self.dirs()[0] / "cgroup.kill"
        if kill.exists():
            try:
                kill.write_text("1")
            except OSError:
                pass
        super().kill_all(deadline_s)
