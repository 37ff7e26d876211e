"""The values the sandbox API passes around: limits, a command's result, a snapshot, and its errors."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from k3.errors import K3Error


class SandboxError(K3Error):
    """A sandbox cannot do what was asked: bad arguments, a missing backend, a dead sandbox, a path
    outside the workspace. The message says which."""


@dataclass(frozen=True)
class Usage:
    """What a sandbox uses at one moment (E2B's sandbox metrics). `cpu_used_pct`: the CPU time its processes
    took since the sample before (or since it started), in percent of its `cpus` quota over that time;
    memory of its cgroup (gVisor: its kernel's too), `mem_used` without the page cache `mem_cache`,
    `mem_total` the cgroup's limit; the disk (workspace and /tmp) used and its size; bytes throughout."""

    timestamp: float  # Unix seconds
    cpu_count: float  # the CPU quota in cores
    cpu_used_pct: float
    mem_used: int
    mem_cache: int
    mem_total: int
    disk_used: int
    disk_total: int


@dataclass(frozen=True)
class Limits:
    """Hard limits. `cpus` is a CFS quota in cores for the whole sandbox; `memory_mb` (RAM, no swap) and
    `pids` (processes) are limits of each command's process tree, and of all of them together on bubblewrap
    (memory_mb, 2 x pids; gVisor: 2 x memory_mb + 256 MB for the whole sandbox kernel, 2 x pids processes);
    `disk_mb` is the size of the sandbox's disk (the workspace and /tmp); `output_mb` caps stdout + stderr
    per command; `cpu_s` (None: no limit) caps the CPU time of each command's tree, in seconds (its wall
    time is the command's own `timeout`)."""

    cpus: float = 0.5
    memory_mb: int = 512
    pids: int = 64
    disk_mb: int = 256
    output_mb: int = 8
    cpu_s: float | None = None

    def __post_init__(self) -> None:
        if self.cpu_s is not None and not 0.01 <= self.cpu_s <= 86400:
            raise SandboxError(f"Limits.cpu_s must be None or in [0.01, 86400] seconds, got {self.cpu_s}")
        if not 0.01 <= self.cpus <= 256:
            raise SandboxError(f"Limits.cpus must be in [0.01, 256] cores, got {self.cpus}")
        for name, low in (("memory_mb", 16), ("pids", 4), ("disk_mb", 1), ("output_mb", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise SandboxError(f"Limits.{name} must be an integer >= {low}, got {value!r}")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_fields(cls, values: dict) -> Limits:
        """Limits from a request's `{field: value}` (the defaults for the rest); an unknown field is a
        SandboxError, as is a bad value."""
        unknown = sorted(set(values) - set(cls.__dataclass_fields__))
        if unknown:
            raise SandboxError(
                f"no such limit {', '.join(unknown)}: one of {', '.join(cls.__dataclass_fields__)}"
            )
        return cls(**values)

    def over(self, ceiling: Limits) -> list[str]:
        """The fields of these limits above `ceiling`'s, each as `field value > ceiling` (no CPU-time limit is
        above any)."""
        found = [
            f"{name} {getattr(self, name)} > {getattr(ceiling, name)}"
            for name in self.__dataclass_fields__
            if name != "cpu_s" and getattr(self, name) > getattr(ceiling, name)
        ]
        if ceiling.cpu_s is not None and (self.cpu_s is None or self.cpu_s > ceiling.cpu_s):
            found.append(f"cpu_s {self.cpu_s} > {ceiling.cpu_s}")
        return found


@dataclass(frozen=True)
class CommandResult:
    """What a command did. `killed_by` says why it was stopped early: "timeout" (its deadline), "oom"
    (the memory limit), "pids" (the process limit was reached), "cpu" (its tree used `cpu_s` seconds of
    CPU), "output" (stdout + stderr passed the cap;
    both are cut at it), "killed" (stopped on request, or by the sandbox's end) or None (it ended by
    itself; `exit_code` is then its own). A limit ends the command's process tree, never the sandbox."""

    stdout: str
    stderr: str
    exit_code: int
    duration_s: float
    killed_by: str | None = None

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Snapshot:
    """A saved sandbox: "memory+fs" (gVisor: every process with its memory, plus the workspace) or "fs"
    (bubblewrap: the workspace files only; no process survives). `path` is its directory on the host."""

    id: str
    kind: str
    backend: str
    template: str
    path: str
    size_bytes: int
    limits: Limits = field(default_factory=Limits)

    def to_json(self) -> dict:
        return {**asdict(self), "limits": self.limits.to_json()}

    @classmethod
    def from_json(cls, data: dict) -> Snapshot:
        return cls(**{**data, "limits": Limits(**data["limits"])})
