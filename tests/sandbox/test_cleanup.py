"""Nothing is left behind: after kill(), after the supervising process is SIGKILLed in the middle of a
command, and when a sandbox's lifetime ends. `leftovers` lists processes, cgroups, mounts and directories
that carry the sandbox's id, straight from /proc, /sys/fs/cgroup and /proc/mounts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sandbox_testing import leftovers

from k3.sandbox import Sandbox, SandboxError

REPO = Path(__file__).resolve().parents[2]


def wait_clean(root: Path, sid: str, within_s: float = 15.0) -> list[str]:
    end = time.monotonic() + within_s
    while (left := leftovers(root, sid)) and time.monotonic() < end:
        time.sleep(0.1)
    return left


def test_kill_leaves_nothing(backend, root):
    sbx = Sandbox.create(backend=backend, root=root)
    sbx.commands.run("nohup sleep 100 >/dev/null 2>&1 &", timeout=20)
    assert leftovers(root, sbx.sandbox_id)  # the check sees a live sandbox
    sbx.kill()
    assert leftovers(root, sbx.sandbox_id) == []
    with pytest.raises(SandboxError, match="killed"):
        sbx.commands.run("true")


SUPERVISOR = """
import sys, threading
from k3.sandbox import Sandbox
sbx = Sandbox.create(backend=sys.argv[1], root=sys.argv[2])

def run():  # the command never ends before the SIGKILL; if it does, its outcome goes to the test's stderr
    result = sbx.commands.run("sleep 100", timeout=200)
    print(f"the command ended before the SIGKILL: {result}", file=sys.stderr, flush=True)

threading.Thread(target=run, daemon=True).start()
print(sbx.sandbox_id, flush=True)
threading.Event().wait()
"""


def test_sigkill_of_the_supervisor_leaves_nothing(backend, root):
    proc = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, backend, str(root)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        sid = proc.stdout.readline().strip()
        assert sid.startswith("sbx-"), sid
        end = time.monotonic() + 20
        while not any("sleep 100" in item for item in leftovers(root, sid)) and time.monotonic() < end:
            time.sleep(0.05)
        running = leftovers(root, sid)
        assert any("sleep 100" in item for item in running), running  # the command is running
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert wait_clean(root, sid) == []


def test_the_end_of_the_lifetime_removes_the_sandbox(backend, root):
    sbx = Sandbox.create(backend=backend, root=root, timeout=2)
    r = sbx.commands.run("sleep 10", timeout=10)
    assert r.killed_by == "timeout" and r.duration_s < 4  # the lifetime caps the command's timeout
    assert wait_clean(root, sbx.sandbox_id) == []
    with pytest.raises(SandboxError, match="lifetime"):
        sbx.commands.run("true")


def test_kill_from_another_thread_ends_a_running_command(backend, root):
    sbx = Sandbox.create(backend=backend, root=root)
    killer = threading.Timer(1.0, sbx.kill)
    killer.start()
    started = time.monotonic()
    try:
        r = sbx.commands.run("sleep 30", timeout=25)
        assert r.exit_code != 0
    except SandboxError:
        pass  # gVisor: the container vanished under `runsc exec`
    assert time.monotonic() - started < 8  # kill did not wait for the command's timeout
    killer.join()
    assert leftovers(root, sbx.sandbox_id) == []
