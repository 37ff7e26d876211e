"""The bubblewrap backend: every command is a fresh `bwrap` process tree, as an unprivileged host user, in
new user/pid/net/ipc/uts/cgroup namespaces (no nested user namespaces), with all capabilities dropped,
the seccomp filter loaded, the template read-only and the workspace bound at /home/user. The sandbox's
cgroup holds the limits and every command's processes, so killing the cgroup kills the whole tree. No
process outlives its command: snapshots are of the files ("fs")."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from k3.sandbox.cgroups import Cgroup
from k3.sandbox.process import Outcome, run_process
from k3.sandbox.templates import GUEST_TOOLS, GUEST_UID, WORKSPACE, Template
from k3.sandbox.types import Limits, SandboxError

HOST_UID = 65534  # nobody: the host user bubblewrap runs as when k3 runs as root
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKSPACE, "USER": "user", "LANG": "C.UTF-8"}
JOIN_CGROUP = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxError("bubblewrap is not installed (`apt-get install bubblewrap`; `make sandbox-tools`)")
    return path


class BwrapBackend:
    name = "bwrap"
    snapshot_kind = "fs"
    host_uid = HOST_UID

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
        self.tools, self.internet, self.cgroup = tools, internet, cgroup
        self.bwrap = bwrap_path()
        if os.geteuid() != 0:
            raise SandboxError("the bwrap backend needs root for its cgroup limits and workspace tmpfs")

    def start(self) -> None:
        self.cgroup.create(self.limits)

    def containers(self) -> list[tuple[str, str]]:
        return []

    def cgroups(self) -> list[str]:
        return [str(d) for d in self.cgroup.dirs()]

    def argv(self, cmd: str, cwd: str, envs: dict[str, str], seccomp_fd: int) -> list[str]:
        a = [self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
        a += ["--new-session", "--cap-drop", "ALL", "--uid", str(GUEST_UID), "--gid", str(GUEST_UID)]
        a += ["--hostname", "sandbox", "--ro-bind", str(self.template.rootfs), "/"]
        for b in self.template.binds:
            a += ["--ro-bind", b, b]
        a += ["--ro-bind", str(self.tools), GUEST_TOOLS, "--proc", "/proc", "--dev", "/dev"]
        a += ["--size", str(self.limits.disk_mb << 20), "--tmpfs", "/tmp"]
        a += ["--bind", str(self.home / "workspace"), WORKSPACE, "--chdir", cwd, "--clearenv"]
        for k, v in {**BASE_ENV, **envs}.items():
            a += ["--setenv", k, v]
        if self.internet:
            a.append("--share-net")
        return a + ["--seccomp", str(seccomp_fd), "--", "/bin/sh", "-c", cmd]

    def run(self, cmd: str, timeout: float, cwd: str, envs: dict[str, str], stdin: bytes) -> Outcome:
        oom0, pids0 = self.cgroup.oom_kills(), self.cgroup.pids_limit_hits()
        fd = os.open(self.tools / "seccomp.bpf", os.O_RDONLY)
        try:
            join = ["/bin/sh", "-c", JOIN_CGROUP, "sh", *map(str, self.cgroup.procs_files()), "--"]
            drop = ["setpriv", f"--reuid={HOST_UID}", f"--regid={HOST_UID}", "--clear-groups", "--"]
            outcome = run_process(
                join + drop + self.argv(cmd, cwd, envs, fd),
                stdin=stdin,
                timeout=timeout,
                output_cap=self.limits.output_mb << 20,
                kill_tree=self.cgroup.kill_all,
                check=lambda: "pids" if self.cgroup.pids_limit_hits() > pids0 else None,
                pass_fds=(fd,),
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            )
        finally:
            os.close(fd)
        self.cgroup.kill_all()  # nothing of a command outlives it
        if outcome.exit_code == 125 and not outcome.stdout and b"cgroup" in outcome.stderr:
            raise SandboxError(f"could not join the sandbox cgroup: {outcome.stderr.decode().strip()}")
        if self.cgroup.oom_kills() > oom0:
            outcome.stopped_by = "oom"
        return outcome

    def stop(self) -> None:
        self.cgroup.kill_all()

    def alive(self) -> bool:
        return True
