"""One running sandbox command as a host process (`Proc`): its stdin stays writable while it runs, its
stdout and stderr are collected up to a cap and can be followed as they come (`events`), and it is stopped at
its deadline. The backend says how to end the command's whole tree (`kill_tree`: its cgroup, or its
supervisor inside gVisor) and what else ends it early (`check`: the pids limit); a guest supervisor reports
its own kills as a line `MARK killed_by=<why>` on stderr, which is cut out and becomes `stopped_by`."""

from __future__ import annotations

import os
import selectors
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

DRAIN_S = 5.0  # after a kill, how long the pipes may take to close before the process is abandoned
CHUNK = 65536


@dataclass
class Outcome:
    stdout: bytes
    stderr: bytes
    exit_code: int
    duration_s: float
    stopped_by: str | None  # "timeout", "output", "oom", "pids", "killed" or what `check` returned


class Proc:
    """Start `argv` now; a thread pumps its pipes until it ends. `pid` is a number naming it inside its
    sandbox (E2B's process id); `argv`, `envs`, `cwd`, `tag` describe what was started, for listings."""

    def __init__(
        self,
        argv: list[str],
        *,
        pid: int,
        timeout: float,
        output_cap: int,
        kill_tree: Callable[[], None],
        check: Callable[[], str | None] = lambda: None,
        stdin: bytes = b"",
        keep_stdin: bool = False,
        mark: bytes | None = None,
        pass_fds: tuple[int, ...] = (),
        env: dict[str, str] | None = None,
        on_exit: Callable[[Outcome], None] = lambda outcome: None,
    ):
        self.pid = pid
        self.argv: list[str] = list(argv)  # what the sandbox's API started (set by Commands.start)
        self.envs: dict[str, str] = {}
        self.cwd, self.tag = "", ""
        self.start = time.monotonic()
        self._kill_tree, self._check, self._mark, self._on_exit = kill_tree, check, mark, on_exit
        self._cap, self._deadline = output_cap, self.start + timeout
        self._cond = threading.Condition()
        self.events: list[tuple[str, bytes]] = []  # ("stdout" | "stderr", chunk) in arrival order
        self.outcome: Outcome | None = None
        self._stop_reason: str | None = None
        self._stdin_lock = threading.Lock()
        self._proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=pass_fds,
            env=env,
            start_new_session=True,
        )
        self.host_pid = self._proc.pid
        if stdin and not keep_stdin:
            threading.Thread(target=self._feed, args=(stdin,), daemon=True).start()
        elif stdin:
            self.write_stdin(stdin)
        elif not keep_stdin:
            self.close_stdin()
        self._thread = threading.Thread(target=self._pump, name=f"sandbox-proc-{pid}", daemon=True)
        self._thread.start()

    # -- stdin -----------------------------------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        self.write_stdin(data)
        self.close_stdin()

    def write_stdin(self, data: bytes) -> None:
        with self._stdin_lock:
            if self._proc.stdin.closed:
                return
            try:
                self._proc.stdin.write(data)
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass

    def close_stdin(self) -> None:
        with self._stdin_lock:
            try:
                self._proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass

    # -- ending ----------------------------------------------------------------------------------------
    def stop(self, reason: str = "killed") -> None:
        """Have the command's whole tree ended (by the pump, within its next tick); it reports `reason` as
        what stopped it, unless something did first."""
        with self._cond:
            if self._stop_reason is None:
                self._stop_reason = reason

    @property
    def done(self) -> bool:
        return self.outcome is not None

    def wait(self, timeout: float | None = None) -> Outcome | None:
        self._thread.join(timeout)
        return self.outcome

    def follow(self, start: int = 0) -> Iterator[tuple[str, bytes]]:
        """Every output event from index `start` on, blocking for new ones until the command ends."""
        i = start
        while True:
            with self._cond:
                while i >= len(self.events) and self.outcome is None:
                    self._cond.wait(1.0)
                batch, finished = self.events[i:], self.outcome is not None
            yield from batch
            i += len(batch)
            if finished and i >= len(self.events):
                return

    # -- the pump --------------------------------------------------------------------------------------
    def _pump(self) -> None:
        proc = self._proc
        names = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}
        out = {"stdout": bytearray(), "stderr": bytearray()}
        sel = selectors.DefaultSelector()
        for f in (proc.stdout, proc.stderr):
            os.set_blocking(f.fileno(), False)
            sel.register(f, selectors.EVENT_READ)
        guest_reason, killed_at = None, None
        while sel.get_map():
            now = time.monotonic()
            with self._cond:
                if self._stop_reason is None:
                    self._stop_reason = "timeout" if now >= self._deadline else self._check()
                reason = self._stop_reason
            if reason is not None and killed_at is None:
                killed_at = now
                self._kill_tree()
            if killed_at is not None and now - killed_at > DRAIN_S:
                break
            for key, _ in sel.select(timeout=0.05):
                chunk = os.read(key.fileobj.fileno(), CHUNK)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                name = names[key.fileobj.fileno()]
                if self._mark and name == "stderr" and self._mark in chunk:
                    # the supervisor writes its line before it kills, so the tree's last output may follow
                    chunk, _, tail = chunk.partition(self._mark)
                    line, _, rest = tail.partition(b"\n")
                    guest_reason = line.partition(b"killed_by=")[2].decode() or "killed"
                    chunk += rest
                room = self._cap - len(out["stdout"]) - len(out["stderr"])
                if len(chunk) > room:
                    chunk = chunk[: max(0, room)]
                    with self._cond:
                        self._stop_reason = self._stop_reason or "output"
                if chunk:
                    out[name] += chunk
                    with self._cond:
                        self.events.append((name, chunk))
                        self._cond.notify_all()
        sel.close()
        try:
            code = proc.wait(timeout=DRAIN_S if killed_at is None else 0.5)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        self.close_stdin()
        for f in (proc.stdout, proc.stderr):
            f.close()
        code = 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell says
        with self._cond:
            reason = self._stop_reason or (guest_reason if guest_reason != "signal" else "killed")
        outcome = Outcome(
            bytes(out["stdout"]), bytes(out["stderr"]), code, time.monotonic() - self.start, reason
        )
        self._on_exit(outcome)  # the backend's last word (cgroup OOM counters, cleanup) before anyone sees it
        with self._cond:
            self.outcome = outcome
            self._cond.notify_all()
