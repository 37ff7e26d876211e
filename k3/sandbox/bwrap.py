"""The bubblewrap backend: every command is a fresh `bwrap` process tree, as an unprivileged host user, in
new user/pid/net/ipc/uts/cgroup namespaces (no nested user namespaces), with all capabilities dropped,
the seccomp filter loaded, the template read-only and the workspace bound at /home/user. The sandbox's
cgroup holds the limits of them all; each command runs in its own cgroup under it (its memory and pids
limits), so a limit, a timeout or an output overflow kills that command's tree and nothing else. Commands
run side by side (a background command is one that has not ended yet). /home/user and /tmp are the
sandbox's disk tmpfs, shared by all its commands. No process outlives its command: snapshots are of the
files ("fs")."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

from k3.sandbox.cgroups import Cgroup
from k3.sandbox.process import Outcome, Proc
from k3.sandbox.templates import GUEST_TOOLS, GUEST_UID, WORKSPACE, Template
from k3.sandbox.types import Limits, SandboxError

HOST_UID = 65534  # nobody: the host user bubblewrap runs as when k3 runs as root
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKSPACE, "USER": "user", "LANG": "C.UTF-8"}
SANDBOX_PIDS_FACTOR = 2  # the sandbox's cgroup holds at most this many times one command's pids limit
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
        self.cgroup_type = type(cgroup)
        self.disk = home / "disk"
        self.bwrap = bwrap_path()
        if os.geteuid() != 0:
            raise SandboxError("the bwrap backend needs root for its cgroup limits and workspace tmpfs")

    def start(self) -> None:
        self.cgroup.create(self.limits, pids=SANDBOX_PIDS_FACTOR * self.limits.pids)

    def containers(self) -> list[tuple[str, str]]:
        return []

    def cgroups(self) -> list[str]:
        return [str(d) for d in self.cgroup.dirs()]

    def argv(self, cmd: list[str], cwd: str, envs: dict[str, str], seccomp_fd: int) -> list[str]:
        a = [self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
        a += ["--new-session", "--cap-drop", "ALL", "--uid", str(GUEST_UID), "--gid", str(GUEST_UID)]
        a += ["--hostname", "sandbox", "--ro-bind", str(self.template.rootfs), "/"]
        for b in self.template.binds:
            a += ["--ro-bind", b, b]
        a += ["--ro-bind", str(self.tools), GUEST_TOOLS, "--proc", "/proc", "--dev", "/dev"]
        a += ["--bind", str(self.disk / "tmp"), "/tmp"]
        a += ["--bind", str(self.disk / "user"), WORKSPACE, "--chdir", cwd, "--clearenv"]
        for k, v in {**BASE_ENV, **envs}.items():
            a += ["--setenv", k, v]
        if self.internet:
            a.append("--share-net")
        return a + ["--seccomp", str(seccomp_fd), "--", *cmd]

    def exec(self, cmd: list[str], timeout: float, cwd: str, envs: dict[str, str], stdin: bytes,
              keep_stdin: bool, pid: int, output_cap: int) -> Proc:  # fmt: skip
        """Start `cmd` in its own cgroup under the sandbox's (its memory, pids and CPU-time limits); a
        limit, a timeout or an output overflow kills that cgroup only."""
        group = self.cgroup_type(self.cgroup.root, f"{self.cgroup.name}/c{pid}")
        group.create(self.limits, cpu=False)  # cpu: the sandbox's quota covers all its commands
        parent_oom0, parent_pids0 = self.cgroup.oom_kills(), self.cgroup.pids_limit_hits()
        fd = os.open(self.tools / "seccomp.bpf", os.O_RDONLY)

        cpu_s = self.limits.cpu_s

        def over_limit() -> str | None:
            if group.pids_limit_hits() > 0 or self.cgroup.pids_limit_hits() > parent_pids0:
                return "pids"
            return "cpu" if cpu_s is not None and group.cpu_seconds() > cpu_s else None

        def ended(outcome: Outcome) -> None:
            oom = group.oom_kills() > 0 or (
                self.cgroup.oom_kills() > parent_oom0 and outcome.exit_code == 137
            )
            group.remove()  # nothing of a command outlives it
            if outcome.exit_code == 125 and not outcome.stdout and b"cgroup" in outcome.stderr:
                outcome.stderr += b"k3: could not join the command's cgroup\n"
            if oom:
                outcome.stopped_by = "oom"

        join = ["/bin/sh", "-c", JOIN_CGROUP, "sh", *map(str, group.procs_files()), "--"]
        drop = ["setpriv", f"--reuid={HOST_UID}", f"--regid={HOST_UID}", "--clear-groups", "--"]
        try:
            return Proc(
                join + drop + self.argv(cmd, cwd, envs, fd),
                pid=pid,
                timeout=timeout,
                output_cap=output_cap,
                kill_tree=group.kill_all,
                check=over_limit,
                stdin=stdin,
                keep_stdin=keep_stdin,
                pass_fds=(fd,),
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                on_exit=ended,
            )
        except BaseException:  # it never started (exec refused it): its cgroup goes now
            group.remove()
            raise
        finally:
            os.close(fd)

    def signal(self, proc: Proc, sig: int) -> None:
        """SIGKILL ends the command's cgroup; other signals go to every process of the command in it, parents
        before their children: a shell gets its signal before the children it waits on, whose end would
        otherwise let it finish before its trap ran (seen: `trap ...; sleep 50 & wait` exiting 0)."""
        if sig == signal.SIGKILL:
            proc.stop("killed")
            return
        group = self.cgroup_type(self.cgroup.root, f"{self.cgroup.name}/c{proc.pid}")
        parent: dict[int, int] = {}
        for p in group.pids() - {proc.host_pid}:
            try:  # not the wrappers (sh joining the cgroup, setpriv, bwrap): they would die of it
                if Path(f"/proc/{p}/comm").read_text().strip() not in ("bwrap", "setpriv"):
                    stat = Path(f"/proc/{p}/stat").read_text()
                    parent[p] = int(stat[stat.rindex(")") + 2 :].split()[1])  # field 4 of proc_pid_stat(5)
            except (FileNotFoundError, ProcessLookupError, ValueError):
                pass  # gone meanwhile

        def depth(p: int) -> int:  # ancestors among the signalled
            n, seen = 0, {p}
            while (p := parent[p]) in parent and p not in seen:
                n, seen = n + 1, seen | {p}
            return n

        for p in sorted(parent, key=depth):
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        self.cgroup.kill_all()

    def alive(self) -> bool:
        return True
