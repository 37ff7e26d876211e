"""The gVisor backend: one `runsc` container per sandbox (ptrace platform: the kvm platform hangs on these
machines), its own kernel between the command and the host, an empty network namespace, the template
read-only, the workspace bound at /home/user. Commands enter with `runsc exec` as uid 1000 through
/k3/k3-exec (the seccomp filter, RLIMIT_NPROC = the pids limit). Memory and CPU are limits on the
container's host cgroup, which runsc creates from the OCI spec. A timeout ends every process of the
container but its init. Snapshots are `runsc checkpoint` images (all memory) plus a copy of the workspace
("memory+fs"); restoring one is `runsc restore` into a new container."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from k3.sandbox.cgroups import Cgroup
from k3.sandbox.process import Outcome, run_process
from k3.sandbox.templates import GUEST_TOOLS, GUEST_UID, WORKSPACE, Template
from k3.sandbox.types import Limits, SandboxError

CONTROL_TIMEOUT_S = 30.0  # runsc run / checkpoint / restore / kill / ps never wait longer than this
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKSPACE, "USER": "user", "LANG": "C.UTF-8"}
# PID 1 of every container: reaps orphans so that exited processes do not pile up as zombies
INIT = [
    "/usr/bin/python3",
    "-S",
    "-c",
    "import os, time\nwhile True:\n try: os.wait()\n except OSError: time.sleep(1)",
]


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

    # -- the container ---------------------------------------------------------------------------------
    @property
    def cid(self) -> str:
        return f"{self.sid}-{self.generation}"

    @property
    def cgroup(self) -> Cgroup:
        return self.cgroup_type(self.cgroup_root, f"k3-sandbox/{self.cid}")

    def cgroups(self) -> list[str]:
        return [str(d) for d in self.cgroup.dirs()]

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
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"},
            {
                "destination": WORKSPACE,
                "type": "bind",
                "source": str(self.home / "workspace"),
                "options": ["rbind"],
            },
            _ro(str(self.tools), GUEST_TOOLS),
            *(_ro(b) for b in self.template.binds),
        ]
        memory = self.limits.memory_mb << 20
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
        subprocess.run(
            self._cmd("delete", "-force", self.cid), capture_output=True, timeout=CONTROL_TIMEOUT_S
        )
        self.cgroup.remove()

    def alive(self) -> bool:
        try:
            return json.loads(self._control("state", self.cid)).get("status") == "running"
        except (SandboxError, ValueError):
            return False

    def kill_commands(self) -> None:
        """SIGKILL every process of the container except its init (pid 1)."""
        try:
            listing = json.loads(self._control("ps", "--format", "json", self.cid, timeout=10) or "[]")
        except (SandboxError, ValueError):
            return
        for pid in listing or []:  # `runsc ps --format json` lists the pids
            if pid != 1:
                kill = self._cmd("kill", f"--pid={pid}", self.cid, "KILL")
                subprocess.run(kill, capture_output=True, timeout=10)

    # -- commands --------------------------------------------------------------------------------------
    def run(self, cmd: str, timeout: float, cwd: str, envs: dict[str, str], stdin: bytes) -> Outcome:
        if not self.alive():
            raise SandboxError(f"sandbox {self.sid} is not running (killed by its limits or from outside)")
        oom0 = self.cgroup.oom_kills()
        argv = self._cmd("exec", f"--user={GUEST_UID}:{GUEST_UID}", f"--cwd={cwd}")
        for k, v in {**BASE_ENV, **envs}.items():
            argv.append(f"--env={k}={v}")
        argv += [
            self.cid,
            f"{GUEST_TOOLS}/k3-exec",
            f"{GUEST_TOOLS}/seccomp.bpf",
            str(self.limits.pids),
            "/bin/sh",
            "-c",
            cmd,
        ]
        outcome = run_process(
            argv,
            stdin=stdin,
            timeout=timeout,
            output_cap=self.limits.output_mb << 20,
            kill_tree=self.kill_commands,
        )
        if self.cgroup.oom_kills() > oom0:
            outcome.stopped_by = "oom"  # the host OOM killer ended the sandbox kernel: the sandbox is gone
        return outcome

    def stop(self) -> None:
        subprocess.run(self._cmd("kill", self.cid, "KILL"), capture_output=True, timeout=CONTROL_TIMEOUT_S)
        self._delete()
