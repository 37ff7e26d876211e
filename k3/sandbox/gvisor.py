"""The gVisor backend: one `runsc` container per sandbox (ptrace platform: the kvm platform hangs on these
machines), its own kernel between the command and the host, an empty network namespace, the template
read-only, the workspace bound at /home/user and /tmp at /tmp (both on the sandbox's disk tmpfs). Commands
enter with `runsc exec` as uid 1000 through /k3/k3-exec, their supervisor inside the guest kernel
(guest/k3_exec.c): the seccomp filter, the per-command memory and pids limits (it kills the command's
tree, the sandbox lives on), and the end of the tree on a timeout or an output overflow (SIGUSR1 through
`runsc kill --pid`). CPU, and a memory backstop for the whole sandbox kernel, are limits on the
container's host cgroup, which runsc creates from the OCI spec. Snapshots are `runsc checkpoint` images
(all memory) plus a copy of the disk ("memory+fs"); restoring one is `runsc restore` into a new container."""

from __future__ import annotations

import json
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from k3.sandbox.cgroups import Cgroup
from k3.sandbox.process import Outcome, Proc
from k3.sandbox.templates import GUEST_TOOLS, GUEST_UID, WORKSPACE, Template
from k3.sandbox.types import Limits, SandboxError

CONTROL_TIMEOUT_S = 30.0  # runsc run / checkpoint / restore / kill / ps never wait longer than this
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKSPACE, "USER": "user", "LANG": "C.UTF-8"}
INIT = [f"{GUEST_TOOLS}/k3-init"]  # PID 1 of every container: reaps orphans (guest/k3_init.c)
NPROC_FACTOR = 2  # RLIMIT_NPROC (all of the sandbox's processes) = this many times the per-command pids
BACKSTOP_EXTRA_MB = 256  # the host cgroup of the sandbox kernel: 2 x memory_mb + this (see _write_bundle)


def runsc_path() -> str:
    path = shutil.which("runsc")
    if path is None:
        raise SandboxError("gVisor is not installed (`apt-get install runsc`; `make sandbox-tools`)")
    return path


def _ro(path: str, dest: str | None = None) -> dict:
    return {"destination": dest or path, "type": "bind", "source": path, "options": ["rbind", "ro"]}


class GvisorBackend:
    name = "gvisor"
    snapshot_kind = "memory+fs"
    host_uid = GUEST_UID  # the gofer creates files with the guest's uid

    def __init__(
        self,
        sid: str,
        home: Path,
        template: Template,
        limits: Limits,
        tools: Path,
        internet: bool,
        cgroup: Cgroup,
    ):
        self.sid, self.home, self.template, self.limits = sid, home, template, limits
        self.tools, self.internet = tools, internet
        self.runsc = runsc_path()
        self.cgroup_type, self.cgroup_root = type(cgroup), cgroup.root
        self.generation = 0
        self.state = home / "runsc"
        self.disk = home / "disk"

    # -- the container ---------------------------------------------------------------------------------
    @property
    def cid(self) -> str:
        return f"{self.sid}-{self.generation}"

    @property
    def cgroup(self) -> Cgroup:
        return self.cgroup_type(self.cgroup_root, f"k3-sandbox/{self.cid}")

    def cgroups(self) -> list[str]:
        return [str(d) for d in self.cgroup.every_dir()]

    def containers(self) -> list[tuple[str, str]]:
        return [(str(self.state), self.cid)]

    def _cmd(self, *args: str) -> list[str]:
        network = "host" if self.internet else "none"
        return [self.runsc, f"--root={self.state}", "--platform=ptrace", f"--network={network}", *args]

    def _control(self, *args: str, timeout: float = CONTROL_TIMEOUT_S) -> str:
        """Run a runsc subcommand; its output goes through files, because a detached sandbox keeps the
        descriptors it inherits open (pipes would never reach end of file)."""
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                code = subprocess.run(self._cmd(*args), stdout=out, stderr=err, timeout=timeout).returncode
            except subprocess.TimeoutExpired as e:
                raise SandboxError(f"runsc {args[0]} did not answer within {timeout:.0f} s") from e
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
        if code != 0:
            raise SandboxError(f"runsc {args[0]} failed: {(stderr or stdout).strip()[-400:]}")
        return stdout

    def _write_bundle(self) -> Path:
        mounts = [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
            {"destination": "/tmp", "type": "bind", "source": str(self.disk / "tmp"), "options": ["rbind"]},
            {
                "destination": WORKSPACE,
                "type": "bind",
                "source": str(self.disk / "user"),
                "options": ["rbind"],
            },
            _ro(str(self.tools), GUEST_TOOLS),
            *(_ro(b) for b in self.template.binds),
        ]
        # the guest's k3-exec ends a command whose tree passes memory_mb; the host cgroup is only the
        # backstop for the whole sandbox kernel (the sentry, its page cache, every command together)
        memory = (2 * self.limits.memory_mb + BACKSTOP_EXTRA_MB) << 20
        spec = {
            "ociVersion": "1.0.0",
            "process": {
                "user": {"uid": 0, "gid": 0},
                "args": INIT,
                "env": [f"{k}={v}" for k, v in BASE_ENV.items()],
                "cwd": "/",
                "capabilities": {
                    k: [] for k in ("bounding", "effective", "inheritable", "permitted", "ambient")
                },
                "noNewPrivileges": True,
            },
            "root": {"path": str(self.template.rootfs), "readonly": True},
            "hostname": "sandbox",
            "mounts": mounts,
            "linux": {
                "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
                "resources": {
                    "memory": {"limit": memory, "swap": memory},
                    "cpu": {"quota": round(self.limits.cpus * 100_000), "period": 100_000},
                },
                "cgroupsPath": f"/k3-sandbox/{self.cid}",
            },
        }
        bundle = self.home / f"bundle-{self.generation}"
        bundle.mkdir(parents=True, exist_ok=True)
        (bundle / "config.json").write_text(json.dumps(spec))
        return bundle

    def start(self) -> None:
        self._control("run", "--detach", f"--bundle={self._write_bundle()}", self.cid)

    def restore(self, image: Path) -> None:
        self.generation += 1
        bundle = self._write_bundle()
        self._control("restore", "--detach", f"--image-path={image}", f"--bundle={bundle}", self.cid)

    def checkpoint(self, image: Path) -> None:
        """Save every process and its memory to `image`; the container stops (restore to continue)."""
        self._control("checkpoint", f"--image-path={image}", self.cid)
        self._delete()

    def _delete(self) -> None:
        """End the container's host processes (sentry, gofer) through its cgroup; `runsc delete` would
        take over a second to find out they are gone, and its state lies in the sandbox's directory."""
        self.cgroup.remove()

    def alive(self) -> bool:
        try:
            return json.loads(self._control("state", self.cid)).get("status") == "running"
        except (SandboxError, ValueError):
            return False

    def _signal(self, proc: Proc, sig: str) -> None:
        """Send `sig` to the command's supervisor (k3-exec) inside the guest: USR1 ends its whole tree,
        TERM / INT / HUP are passed on to the command."""
        pidfile = self.home / "pids" / str(proc.pid)
        for _ in range(200):  # runsc writes the guest pid just after the command starts
            if pidfile.exists() and (guest := pidfile.read_text().strip()):
                kill = self._cmd("kill", f"--pid={guest}", self.cid, sig)
                subprocess.run(kill, capture_output=True, timeout=10)
                return
            if proc.done:
                return
            time.sleep(0.01)

    # -- commands --------------------------------------------------------------------------------------
    def exec(self, cmd: list[str], timeout: float, cwd: str, envs: dict[str, str], stdin: bytes,
              keep_stdin: bool, pid: int, output_cap: int) -> Proc:  # fmt: skip
        """Start `cmd` under its own k3-exec supervisor (which holds its memory and pids limits)."""
        oom0 = self.cgroup.oom_kills()
        (self.home / "pids").mkdir(exist_ok=True)
        mark = f"k3-exec-{secrets.token_hex(8)}"
        argv = self._cmd("exec", f"--user={GUEST_UID}:{GUEST_UID}", f"--cwd={cwd}")
        argv.append(f"--internal-pid-file={self.home / 'pids' / str(pid)}")
        for k, v in {**BASE_ENV, **envs}.items():
            argv.append(f"--env={k}={v}")
        pids = self.limits.pids
        argv += [self.cid, f"{GUEST_TOOLS}/k3-exec", f"{GUEST_TOOLS}/seccomp.bpf", str(NPROC_FACTOR * pids)]
        cpu_ms = round(self.limits.cpu_s * 1000) if self.limits.cpu_s is not None else 0
        argv += [str(pids), str(self.limits.memory_mb << 20), str(cpu_ms), mark, *cmd]

        def ended(outcome: Outcome) -> None:
            (self.home / "pids" / str(pid)).unlink(missing_ok=True)
            if self.cgroup.oom_kills() > oom0:  # the host's backstop ended the sandbox kernel
                outcome.stopped_by = "oom"

        proc: Proc

        def kill_tree() -> None:
            self._signal(proc, "USR1")

        proc = Proc(argv, pid=pid, timeout=timeout, output_cap=output_cap, kill_tree=kill_tree, stdin=stdin,
                    keep_stdin=keep_stdin, mark=mark.encode(), on_exit=ended)  # fmt: skip
        return proc

    def signal(self, proc: Proc, sig: int) -> None:
        """SIGKILL ends the command's tree; other signals go to the command itself."""
        if sig == signal.SIGKILL:
            proc.stop("killed")
        else:
            self._signal(proc, signal.Signals(sig).name.removeprefix("SIG"))

    def stop(self) -> None:
        self._delete()
