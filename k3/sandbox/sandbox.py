"""`Sandbox`: the E2B-shaped API over the two backends. A sandbox is a directory under the state root
(its workspace tmpfs, its bundle, its runsc state), a cgroup, for gVisor a running container, and a
reaper process that removes all of it when the sandbox is killed, its lifetime ends, or this process dies.

    with Sandbox.create(template="python", backend="bwrap", limits=Limits(memory_mb=256)) as sbx:
        sbx.files.write("main.py", "print(6 * 7)")
        r = sbx.commands.run("python3 main.py", timeout=10)    # CommandResult(stdout="42\\n", ...)
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

from k3.sandbox import snapshots
from k3.sandbox.bwrap import BwrapBackend
from k3.sandbox.cgroups import Cgroup
from k3.sandbox.guest import guest_tools
from k3.sandbox.gvisor import GvisorBackend
from k3.sandbox.templates import WORKSPACE, resolve_template
from k3.sandbox.types import CommandResult, Limits, SandboxError, Snapshot
from k3.sandbox.workspace import EntryInfo, Workspace, mount_tmpfs, unmount

BACKENDS = {"gvisor": GvisorBackend, "bwrap": BwrapBackend}
CGROUP_ROOT = Path("/sys/fs/cgroup")
REAPER = Path(__file__).with_name("reaper.py")
KILL_TIMEOUT_S = 30.0


def default_root() -> Path:
    """Where sandboxes, templates and snapshots live: $K3_SANDBOX_ROOT, else /var/lib/k3-sandbox as root,
    else ~/.cache/k3/sandbox."""
    if env := os.environ.get("K3_SANDBOX_ROOT"):
        return Path(env)
    return Path("/var/lib/k3-sandbox") if os.geteuid() == 0 else Path.home() / ".cache/k3/sandbox"


class Commands:
    """`sbx.commands`: run shell commands in the sandbox, one at a time."""

    def __init__(self, sandbox: Sandbox):
        self._sbx = sandbox

    def run(
        self,
        cmd: str,
        timeout: float = 30,
        cwd: str | None = None,
        envs: dict[str, str] | None = None,
        stdin: str | bytes | None = None,
    ) -> CommandResult:
        """Run `cmd` with /bin/sh. The timeout (seconds, capped by the sandbox's remaining lifetime) kills
        the command's whole process tree; the result says what stopped it (`killed_by`)."""
        if timeout <= 0:
            raise SandboxError(f"timeout must be > 0 seconds, got {timeout}")
        sbx = self._sbx
        data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
        env = {"K3_SEED": str(sbx.seed), **(envs or {})}
        with sbx._lock:
            sbx._check_alive()
            limit = min(float(timeout), sbx._remaining())
            out = sbx._backend.run(cmd, limit, cwd or WORKSPACE, env, data)
        return CommandResult(
            stdout=out.stdout.decode(errors="replace"),
            stderr=out.stderr.decode(errors="replace"),
            exit_code=out.exit_code,
            duration_s=out.duration_s,
            killed_by=out.stopped_by,
        )


class Files:
    """`sbx.files`: the workspace (/home/user), read and written from the host side."""

    def __init__(self, sandbox: Sandbox):
        self._sbx = sandbox

    def write(self, path: str, data: str | bytes) -> None:
        self._sbx._check_alive()
        self._sbx._workspace.write(path, data)

    def read(self, path: str, format: str = "text") -> str | bytes:
        self._sbx._check_alive()
        return self._sbx._workspace.read(path, format)

    def list(self, path: str = WORKSPACE) -> list[EntryInfo]:
        self._sbx._check_alive()
        return self._sbx._workspace.list(path)

    def remove(self, path: str) -> None:
        self._sbx._check_alive()
        self._sbx._workspace.remove(path)


class Sandbox:
    """One sandbox. Make it with `Sandbox.create` (or `connect` to a paused one); end it with `kill()` or
    a `with` block."""

    def __init__(self, sid: str, root: Path, backend, template: str, limits: Limits, lifetime: float):
        self.sandbox_id = sid
        self.root = root
        self.template = template
        self.limits = limits
        self.seed = secrets.randbits(63)
        self.commands = Commands(self)
        self.files = Files(self)
        self._backend = backend
        self._home = root / "sandboxes" / sid
        self._workspace = Workspace(self._home / "workspace", backend.host_uid)
        self._deadline = time.time() + lifetime
        self._lock = threading.RLock()
        self._killed = False
        self._reaper = subprocess.Popen(
            [sys.executable, "-S", "-I", str(REAPER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # a signal to our process group must not stop the cleanup
        )
        self._send_plan()

    @property
    def backend(self) -> str:
        return self._backend.name

    # -- creation --------------------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        template: str = "python",
        timeout: float = 300,
        limits: Limits | None = None,
        backend: str = "gvisor",
        allow_internet_access: bool = False,
        snapshot: Snapshot | str | None = None,
        root: str | Path | None = None,
        sandbox_id: str | None = None,
    ) -> Sandbox:
        """Start a sandbox (`timeout`: its lifetime in seconds; commands have their own timeouts). With
        `snapshot` it starts from that snapshot instead: its backend, template and limits."""
        root = Path(root) if root is not None else default_root()
        snap = snapshots.load(root, snapshot) if snapshot is not None else None
        if snap is not None:
            backend, template, limits = snap.backend, snap.template, snap.limits
        limits = limits or Limits()
        if backend not in BACKENDS:
            raise SandboxError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
        if timeout <= 0:
            raise SandboxError(f"timeout (the sandbox lifetime) must be > 0 seconds, got {timeout}")
        sid = sandbox_id or f"sbx-{secrets.token_hex(6)}"
        home = root / "sandboxes" / sid
        if home.exists():
            raise SandboxError(f"sandbox {sid} already exists under {root}")
        tmpl = resolve_template(root, template)
        tools = guest_tools(root)
        cgroup = Cgroup.detect(CGROUP_ROOT)(CGROUP_ROOT, f"k3-sandbox/{sid}")
        impl = BACKENDS[backend](sid, home, tmpl, limits, tools, allow_internet_access, cgroup)
        home.mkdir(parents=True)
        sbx = cls(sid, root, impl, template, limits, timeout)
        try:
            mount_tmpfs(home / "workspace", limits.disk_mb, impl.host_uid)
            if snap is not None:
                sbx._workspace_from(Path(snap.path) / "workspace")
            if snap is not None and snap.kind == "memory+fs":
                impl.restore(Path(snap.path) / "image")
            else:
                impl.start()
            sbx._send_plan()
        except BaseException:
            sbx.kill()
            raise
        return sbx

    @classmethod
    def connect(cls, sandbox_id: str, timeout: float = 300, root: str | Path | None = None) -> Sandbox:
        """Resume the sandbox `pause()` saved as `sandbox_id` (in this process or any other); it keeps its
        id. Its saved state is removed once it runs again."""
        root = Path(root) if root is not None else default_root()
        snap = snapshots.load(root, sandbox_id)
        sbx = cls.create(snapshot=snap, timeout=timeout, root=root, sandbox_id=sandbox_id)
        snapshots.delete(snap)
        return sbx

    # -- state -----------------------------------------------------------------------------------------
    def _plan(self) -> dict:
        return {
            "deadline": self._deadline,
            "containers": self._backend.containers(),
            "cgroups": self._backend.cgroups(),
            "mounts": [str(self._home / "workspace")],
            "dirs": [str(self._home)],
        }

    def _send_plan(self) -> None:
        try:
            self._reaper.stdin.write(json.dumps(self._plan()).encode() + b"\n")
            self._reaper.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def _remaining(self) -> float:
        return self._deadline - time.time()

    def _check_alive(self) -> None:
        if self._killed:
            raise SandboxError(f"sandbox {self.sandbox_id} was killed")
        if self._reaper.poll() is not None or self._remaining() <= 0:
            self.kill()
            raise SandboxError(f"sandbox {self.sandbox_id} reached the end of its lifetime and was removed")

    def is_running(self) -> bool:
        return (
            not self._killed
            and self._reaper.poll() is None
            and self._remaining() > 0
            and self._backend.alive()
        )

    def set_timeout(self, timeout: float) -> None:
        """Make the sandbox end `timeout` seconds from now."""
        self._deadline = time.time() + timeout
        self._send_plan()

    def _workspace_from(self, source: Path) -> None:
        done = subprocess.run(["cp", "-a", f"{source}/.", str(self._workspace.host)], capture_output=True)
        if done.returncode != 0:
            raise SandboxError(f"restoring the workspace failed: {done.stderr.decode().strip()}")

    # -- snapshots, fork, pause ------------------------------------------------------------------------
    def create_snapshot(self, snapshot_id: str | None = None) -> Snapshot:
        """Save this sandbox: "memory+fs" on gVisor (every process, paused for the checkpoint, then
        resumed), "fs" on bubblewrap (the workspace files). The sandbox goes on running."""
        with self._lock:
            self._check_alive()
            sid = snapshot_id or f"snap-{secrets.token_hex(6)}"
            path = snapshots.directory(self.root, sid)
            kind = self._backend.snapshot_kind
            try:
                if kind == "memory+fs":
                    self._backend.checkpoint(path / "image")
                size = self._workspace.copy_to(path / "workspace")
                if kind == "memory+fs":
                    self._backend.restore(path / "image")
                    self._send_plan()
            except BaseException:
                snapshots.remove_directory(path)
                raise
            size += snapshots.image_bytes(path)
            snap = Snapshot(sid, kind, self.backend, self.template, str(path), size, self.limits)
            snapshots.save(snap)
            return snap

    def fork(self, count: int, reseed: bool = False) -> list[Sandbox | Exception]:
        """`count` children started from a snapshot of this sandbox, each its own sandbox; a child that
        fails to start is its exception in the list. Children share this sandbox's K3_SEED unless
        `reseed` (then each gets a fresh one); memory inside running processes is copied as it is."""
        if count < 1:
            raise SandboxError(f"fork count must be >= 1, got {count}")
        snap = self.create_snapshot()
        children: list[Sandbox | Exception] = []
        try:
            for _ in range(count):
                try:
                    child = Sandbox.create(snapshot=snap, timeout=max(1.0, self._remaining()), root=self.root)
                except Exception as e:  # noqa: BLE001 - reported per child, as the API promises
                    children.append(e)
                    continue
                if not reseed:
                    child.seed = self.seed
                children.append(child)
        finally:
            snapshots.delete(snap)
        return children

    def pause(self) -> str:
        """Save this sandbox under its own id and stop it; `Sandbox.connect(id)` resumes it."""
        self.create_snapshot(snapshot_id=self.sandbox_id)
        self.kill()
        return self.sandbox_id

    # -- the end ---------------------------------------------------------------------------------------
    def kill(self) -> None:
        """Stop every process and remove the sandbox's cgroup, mount and directory (idempotent)."""
        with self._lock:
            self._killed = True
            try:
                self._backend.stop()
            except (SandboxError, OSError, subprocess.TimeoutExpired):
                pass  # the reaper removes whatever is left
            unmount(self._home / "workspace")
            if self._reaper.stdin and not self._reaper.stdin.closed:
                self._reaper.stdin.close()
            try:
                self._reaper.wait(timeout=KILL_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._reaper.kill()
            if self._reaper.stdout:
                self._reaper.stdout.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def __repr__(self) -> str:
        return f"Sandbox({self.sandbox_id!r}, backend={self.backend!r}, template={self.template!r})"
