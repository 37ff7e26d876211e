"""Running one host process for a sandbox command: feed its stdin, collect stdout and stderr up to a cap,
and stop it at a deadline. The caller says how to stop the whole tree (`kill_tree`: the cgroup, or every
process of a gVisor container) and what else ends a command early (`check`: the pids limit)."""

from __future__ import annotations

import os
import selectors
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

DRAIN_S = 5.0  # after a kill, how long the pipes may take to close before the process is abandoned


@dataclass
class Outcome:
    stdout: bytes
    stderr: bytes
    exit_code: int
    duration_s: float
    stopped_by: str | None  # "timeout", "output", or what `check` returned


def run_process(
    argv: list[str],
    *,
    stdin: bytes,
    timeout: float,
    output_cap: int,
    kill_tree: Callable[[], None],
    check: Callable[[], str | None] = lambda: None,
    pass_fds: tuple[int, ...] = (),
    env: dict[str, str] | None = None,
) -> Outcome:
    start = time.monotonic()
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=pass_fds,
        env=env,
        start_new_session=True,
    )
    out = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    sel = selectors.DefaultSelector()
    for f in (proc.stdout, proc.stderr):
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    pending = memoryview(stdin)
    os.set_blocking(proc.stdin.fileno(), False)
    if pending:
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    deadline = start + timeout
    stopped_by: str | None = None
    hard_end = None
    while sel.get_map():
        now = time.monotonic()
        if stopped_by is None and (reason := "timeout" if now >= deadline else check()):
            stopped_by = reason
        if stopped_by is not None and hard_end is None:
            kill_tree()
            hard_end = time.monotonic() + DRAIN_S
        if hard_end is not None and time.monotonic() > hard_end:
            break
        wait = 0.05 if hard_end is None else 0.1
        for key, _ in sel.select(timeout=max(0.0, min(wait, deadline - now)) if hard_end is None else wait):
            f = key.fileobj
            if f is proc.stdin:
                try:
                    pending = pending[os.write(f.fileno(), pending[:65536]) :]
                except (BrokenPipeError, OSError):
                    pending = memoryview(b"")
                if not pending:
                    sel.unregister(f)
                    f.close()
                continue
            chunk = os.read(f.fileno(), 65536)
            if not chunk:
                sel.unregister(f)
                continue
            buf = out[f.fileno()]
            room = output_cap - sum(len(b) for b in out.values())
            buf += chunk[: max(0, room)]
            if len(chunk) > room and stopped_by is None:
                stopped_by = "output"
    sel.close()
    try:
        code = proc.wait(timeout=max(0.1, (hard_end or time.monotonic() + DRAIN_S) - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if not f.closed:
            f.close()
    stdout, stderr = (bytes(b) for b in out.values())
    return Outcome(stdout, stderr, code, time.monotonic() - start, stopped_by)
