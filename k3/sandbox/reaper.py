"""The reaper: one small process per sandbox, started beside it, that removes everything the sandbox
holds (gVisor containers, cgroups, the workspace mount, its directory) when its supervisor lets go, when
the supervisor dies (even by SIGKILL: the pipe it reads then closes), or when the sandbox's lifetime ends.
It is the only cleanup path, so all three cases leave the same nothing behind.

Run as `python -S -I reaper.py` (it imports nothing of k3, so it starts in milliseconds). Protocol on
stdin: JSON lines, each the whole current plan {"deadline": unix time, "containers": [[runsc_root, id]],
"cgroups": [dirs], "mounts": [dirs], "dirs": [dirs]}; end of input means clean up now, then exit.
"""

import json
import os
import select
import shutil
import signal
import subprocess
import time


def _kill_cgroup(path):
    for _ in range(500):
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            return
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    for _ in range(200):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)


def clean(plan):
    for state, cid in plan.get("containers", []):  # its processes also die with its cgroup, below
        try:
            subprocess.run(["runsc", f"--root={state}", "kill", cid, "KILL"], capture_output=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            pass
    for path in sorted(plan.get("cgroups", []), key=len, reverse=True):
        for below, _, _ in os.walk(path, topdown=False):  # a command's own group first, then the sandbox's
            _kill_cgroup(below)
    for path in plan.get("mounts", []):
        if os.path.ismount(path):
            subprocess.run(["umount", "-l", path], capture_output=True)
    for path in plan.get("dirs", []):
        shutil.rmtree(path, ignore_errors=True)


def main():
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the supervisor's group must not skip cleanup
    plan, buf = {}, b""
    while True:
        wait = plan.get("deadline", time.time() + 3600) - time.time()
        ready, _, _ = select.select([0], [], [], max(0.0, wait))
        if not ready:
            break  # the sandbox's lifetime is over
        chunk = os.read(0, 65536)
        if not chunk:
            break  # the supervisor closed the pipe, or died
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.strip():
                plan = json.loads(line)
    clean(plan)


if __name__ == "__main__":
    main()
