"""`Sandbox`: the E2B-shaped API over the two backends. A sandbox is a directory under the state root
(its workspace tmpfs, its bundle, its runsc state), a cgroup, for gVisor a running container, and a
reaper process that removes all of it when the sandbox is killed, its lifetime ends, or this process dies.

    with Sandbox.create(template="python", backend="bwrap", limits=Limits(memory_mb=256)) as sbx:
        sbx.files.write("main.py", "print(6 * 7)")
        r = sbx.commands.run("python3 main.py", timeout=10)    # CommandResult(stdout="42\\n", ...)
"""

from __future__ import annotations

import errno
import itertools
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
from k3.sandbox.files import Files
from k3.sandbox.guest import guest_tools
from k3.sandbox.gvisor import GvisorBackend
from k3.sandbox.process import Outcome, Proc
from k3.sandbox.templates import WORKSPACE, resolve_template
from k3.sandbox.types import CommandResult, Limits, SandboxError, Snapshot, Usage
from k3.sandbox.workspace import Disk, unmount

BACKENDS = {"gvisor": GvisorBackend, "bwrap": BwrapBackend}
CGROUP_ROOT = Path("/sys/fs/cgroup")
REAPER = Path(__file__).with_name("reaper.py")
KILL_TIMEOUT_S = 30.0
REAPER_GRACE_S = 1.0  # the reaper ends a sandbox this long after its lifetime, so that a command the
# lifetime cuts short is stopped (and reported as a timeout) by its own deadline first


def default_root() -> Path:
    """Where sandboxes, templates and snapshots live: $K3_SANDBOX_ROOT, else /var/lib/k3-sandbox as root,
    else ~/.cache/k3/sandbox."""
    if env := os.environ.get("K3_SANDBOX_ROOT"):
        return Path(env)
    return Path("/var/lib/k3-sandbox") if os.geteuid() == 0 else Path.home() / ".cache/k3/sandbox"


def _check_root(root: Path, backend: str) -> None:
    """Create the state root; bubblewrap runs as an unprivileged user, who must be able to reach it."""
    root.mkdir(parents=True, exist_ok=True)
    if backend == "bwrap":
        for d in (root.resolve(), *root.resolve().parents):
            if not os.stat(d).st_mode & 0o001:
                raise SandboxError(f"the sandbox root {root} is unreachable for other users ({d} lacks o+x)")


FILE_OP_TIMEOUT_S = 60.0  # a files operation is a command too; this is its deadline


MAX_ARG_STRLEN = 32 * 4096  # Linux's limit on one argument or one NAME=VALUE string, its NUL included


def check_exec_strings(argv: list[str], env: dict[str, str]) -> None:
    """SandboxError for what exec(2) would refuse in one string (a NUL byte, a string over MAX_ARG_STRLEN)
    or an environment name it cannot carry (empty, or holding '='), said before anything starts."""
    for name, value in env.items():
        if not name or "=" in name or "\0" in name:
            raise SandboxError(
                f"environment variable name {name[:40]!r}: must be non-empty, without '=' or NUL"
            )
        if "\0" in value:
            raise SandboxError(f"environment variable {name}: its value holds a NUL byte")
        if len(f"{name}={value}".encode()) >= MAX_ARG_STRLEN:
            raise SandboxError(
                f"environment variable {name}: {len(value.encode())} bytes, over exec(2)'s "
                f"{MAX_ARG_STRLEN - 1} for one NAME=VALUE: pass large data as stdin or a file"
            )
    for arg in argv:
        if "\0" in arg:
            raise SandboxError("the command holds a NUL byte")
        if len(arg.encode()) >= MAX_ARG_STRLEN:
            raise SandboxError(
                f"the command has a string of {len(arg.encode())} bytes, over exec(2)'s "
                f"{MAX_ARG_STRLEN - 1}: pass large data as stdin or a file"
            )


class Commands:
    """`sbx.commands`: shell commands in the sandbox. Several may run at once; each has its own limits
    (memory, pids, output, timeout) and a limit ends that command only."""

    def __init__(self, sandbox: Sandbox):
        self._sbx = sandbox

    def start(
        self,
        cmd: str | list[str],
        timeout: float = 30,
        cwd: str | None = None,
        envs: dict[str, str] | None = None,
        stdin: str | bytes | None = None,
        keep_stdin: bool = False,
        output_cap: int | None = None,
        tag: str = "",
    ) -> Proc:
        """Start `cmd` (a string for /bin/sh -c, or an argv) and return at once: the running `Proc`
        (write_stdin, close_stdin, follow, stop, wait). `keep_stdin` leaves its stdin open for later
        writes; otherwise `stdin` is its whole input."""
        if timeout <= 0:
            raise SandboxError(f"timeout must be > 0 seconds, got {timeout}")
        sbx = self._sbx
        data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
        env = {"K3_SEED": str(sbx.seed), **(envs or {})}
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        check_exec_strings(argv, env)
        with sbx._lock:  # not during a snapshot
            sbx._check_alive()
            limit = min(float(timeout), sbx._remaining())
            pid = sbx._next_pid()
            cap = output_cap or sbx.limits.output_mb << 20
            try:
                proc = sbx._backend.exec(argv, limit, cwd or WORKSPACE, env, data, keep_stdin, pid, cap)
            except OSError as e:
                if e.errno != errno.E2BIG:
                    raise
                raise SandboxError(
                    "the command with its arguments and environment is larger than exec(2) takes "
                    f"({sum(len(a) for a in argv) + sum(len(k) + len(v) for k, v in env.items())} bytes): "
                    "pass large data as stdin or a file"
                ) from e
            proc.argv, proc.envs, proc.cwd, proc.tag = argv, dict(envs or {}), cwd or WORKSPACE, tag
            sbx._procs[pid] = proc
        return proc

    def run(
        self,
        cmd: str,
        timeout: float = 30,
        cwd: str | None = None,
        envs: dict[str, str] | None = None,
        stdin: str | bytes | None = None,
    ) -> CommandResult:
        """Run `cmd` with /bin/sh and wait for it. The timeout (seconds, capped by the sandbox's remaining
        lifetime) kills the command's whole process tree; the result says what stopped it (`killed_by`)."""
        out = self.start(cmd, timeout, cwd, envs, stdin).wait()
        sbx = self._sbx
        if out.exit_code != 0 and out.stopped_by in (None, "killed") and not sbx._killed:
            if not sbx._backend.alive():  # its kernel (gVisor) was killed from outside under the command
                sbx._lost = True
                raise SandboxError(f"sandbox {sbx.sandbox_id} is not running (killed from outside)")
        return result_of(out)

    def list(self) -> list[Proc]:
        """The commands still running."""
        return [p for p in list(self._sbx._procs.values()) if not p.done]

    def get(self, pid: int) -> Proc:
        proc = self._sbx._procs.get(pid)
        if proc is None:
            raise SandboxError(f"no process {pid} in sandbox {self._sbx.sandbox_id}")
        return proc

    def signal(self, pid: int, sig: int) -> None:
        """Send `sig` to a running command: SIGKILL ends its whole tree, others go to the command."""
        self._sbx._backend.signal(self.get(pid), sig)

    def _file_op(self, argv: list[str], data: bytes) -> Outcome:
        cap = max(self._sbx.limits.disk_mb << 20, self._sbx.limits.output_mb << 20)
        return self.start(argv, timeout=FILE_OP_TIMEOUT_S, stdin=data, output_cap=cap).wait()


def result_of(out: Outcome) -> CommandResult:
    return CommandResult(
        stdout=out.stdout.decode(errors="replace"),
        stderr=out.stderr.decode(errors="replace"),
        exit_code=out.exit_code,
        duration_s=out.duration_s,
        killed_by=out.stopped_by,
    )


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
        self.files = Files(self.commands._file_op)
        self._backend = backend
        self._home = root / "sandboxes" / sid
        self._disk = Disk(self._home / "disk", backend.host_uid)
        self._procs: dict[int, Proc] = {}  # E2B-style process ids, per sandbox
        self._pid_counter = itertools.count(1000)
        self._deadline = time.time() + lifetime
        self._lock = threading.RLock()  # one command, snapshot or file operation at a time
        self._kill_lock = threading.Lock()
        self._killed = False
        self._lost = False  # its processes were killed from outside (gVisor: its kernel is gone)
        self._snapshotting = False  # between checkpoint and restore its kernel is down, and it is not dead
        self._cpu_sample = (time.monotonic(), 0.0)  # (when, its cgroup's CPU seconds then): usage()
        self._usage_lock = threading.Lock()
        self._reaper = subprocess.Popen(
            [sys.executable, "-S", "-I", str(REAPER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # a signal to our process group must not stop the cleanup
        )
        self._send_plan()

    def _next_pid(self) -> int:
        pid = next(self._pid_counter)
        for old in [p for p, proc in self._procs.items() if proc.done][:-64]:  # keep the last 64 ended
            self._procs.pop(old, None)
        return pid

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
        _check_root(root, backend)
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
            sbx._disk.mount(limits.disk_mb)
            if snap is not None:
                sbx._disk.restore_from(Path(snap.path) / "workspace")
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

    @classmethod
    def delete_snapshot(cls, snapshot: Snapshot | str, root: str | Path | None = None) -> None:
        """Remove a snapshot (or a paused sandbox's saved state) from disk."""
        root = Path(root) if root is not None else default_root()
        snapshots.delete(snapshots.load(root, snapshot))

    # -- state -----------------------------------------------------------------------------------------
    def _plan(self) -> dict:
        return {
            "deadline": self._deadline + REAPER_GRACE_S,
            "containers": self._backend.containers(),
            "cgroups": self._backend.cgroups(),
            "mounts": [str(self._disk.path)],
            "dirs": [str(self._home)],
        }

    def _send_plan(self) -> None:
        with self._kill_lock:
            if self._reaper.stdin.closed:
                return
            try:
                self._reaper.stdin.write(json.dumps(self._plan()).encode() + b"\n")
                self._reaper.stdin.flush()
            except BrokenPipeError:
                pass

    def _remaining(self) -> float:
        return self._deadline - time.time()

    def _check_alive(self) -> None:
        if self._killed:
            raise SandboxError(f"sandbox {self.sandbox_id} was killed")
        if self._lost:
            raise SandboxError(f"sandbox {self.sandbox_id} is not running (killed from outside)")
        if self._reaper.poll() is not None or self._remaining() <= 0:
            self.kill()
            raise SandboxError(f"sandbox {self.sandbox_id} reached the end of its lifetime and was removed")

    def live(self) -> bool:
        """Not killed, not lost, within its lifetime: what a quota counts (no call into the backend)."""
        return not self._killed and not self._lost and self._reaper.poll() is None and self._remaining() > 0

    def is_running(self) -> bool:
        """Alive and within its lifetime. In the middle of a snapshot it counts as running: its kernel is
        checkpointed and restored (gVisor), and a server's TTL reaper asking meanwhile must not remove it
        (which removed its directory under the restore: tests/sandbox/test_snapshot.py)."""
        if self._killed or self._reaper.poll() is not None or self._remaining() <= 0:
            return False
        return self._snapshotting or self._backend.alive()

    def set_timeout(self, timeout: float) -> None:
        """Make the sandbox end `timeout` seconds from now."""
        self._deadline = time.time() + timeout
        self._send_plan()

    def usage(self) -> Usage:
        """What the sandbox uses now (types.Usage): the CPU since the call before, memory, disk."""
        self._check_alive()
        cgroup = self._backend.cgroup
        now, cpu = time.monotonic(), cgroup.cpu_seconds()
        with self._usage_lock:  # two callers each get their own interval
            then, before = self._cpu_sample
            self._cpu_sample = (now, cpu)
        percent = 100 * max(cpu - before, 0.0) / max(now - then, 1e-6) / self.limits.cpus
        memory = cgroup.memory()
        if not os.path.ismount(self._disk.path):  # killed meanwhile: statvfs would read the host's disk
            raise SandboxError(f"sandbox {self.sandbox_id} is not running")
        disk = os.statvfs(self._disk.path)
        return Usage(
            timestamp=time.time(),
            cpu_count=self.limits.cpus,
            cpu_used_pct=percent,
            mem_used=memory.used,
            mem_cache=memory.cache,
            mem_total=memory.limit,
            disk_used=(disk.f_blocks - disk.f_bfree) * disk.f_frsize,
            disk_total=disk.f_blocks * disk.f_frsize,
        )

    # -- snapshots, fork, pause ------------------------------------------------------------------------
    def create_snapshot(self, snapshot_id: str | None = None) -> Snapshot:
        """Save this sandbox: "memory+fs" on gVisor (every process, paused for the checkpoint, then
        resumed), "fs" on bubblewrap (the disk: workspace and /tmp). The sandbox goes on running. Commands
        still running through the API are ended first (killed_by="killed"): their pipes to the host cannot
        be saved; processes they left in the background with their own output are saved (gVisor)."""
        with self._lock:
            self._check_alive()
            sid = snapshot_id or f"snap-{secrets.token_hex(6)}"
            path = snapshots.directory(self.root, sid)
            kind = self._backend.snapshot_kind
            for proc in list(self._procs.values()):  # their host-side pipes cannot be saved: end them first
                if not proc.done:
                    proc.stop("killed")
                    proc.wait(KILL_TIMEOUT_S)
            self._snapshotting = True
            try:
                if kind == "memory+fs":
                    self._backend.checkpoint(path / "image")
                size = self._disk.copy_to(path / "workspace")
                if kind == "memory+fs":
                    self._backend.restore(path / "image")
                    self._send_plan()
                    if self._killed:  # killed from another thread meanwhile: the reaper has gone
                        self._backend.stop()
                        raise SandboxError(f"sandbox {self.sandbox_id} was killed during its snapshot")
            except BaseException:
                snapshots.remove_directory(path)
                raise
            finally:
                self._snapshotting = False
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
        """Stop every process and remove the sandbox's cgroup, mount and directory (idempotent). It does
        not wait for a running command: that command's processes die and it returns."""
        with self._kill_lock:
            self._killed = True
            try:
                self._backend.stop()
            except (SandboxError, OSError, subprocess.TimeoutExpired):
                pass  # the reaper removes whatever is left
            for proc in list(self._procs.values()):
                if not proc.done:
                    proc.stop("killed")
            unmount(self._disk.path)
            if self._reaper.stdin and not self._reaper.stdin.closed:
                self._reaper.stdin.close()
            try:
                self._reaper.wait(timeout=KILL_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._reaper.kill()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def __repr__(self) -> str:
        return f"Sandbox({self.sandbox_id!r}, backend={self.backend!r}, template={self.template!r})"
