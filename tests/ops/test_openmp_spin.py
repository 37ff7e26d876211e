"""`import k3` shortens how long torch's OpenMP threads spin after a parallel region (GOMP_SPINCOUNT, which
libgomp reads once, when torch loads it), so that they leave the cores to k3's decode threads; a user's own
value is kept. Measured by the process's CPU time while its main thread sleeps after a region: what it spends
then is the second thread spinning (a count of pauses, whatever else the machine runs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPIN = """
import os, resource, time
import k3, torch  # k3 first, as the k3 command imports it
torch.set_num_threads(2)
x = torch.ones(1 << 20)  # 4 MB: an elementwise op over it runs on both threads

def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

spun = 0.0
for _ in range(20):
    x.add_(1)  # a parallel region; then the second thread spins until libgomp's count runs out
    before = cpu_seconds()
    time.sleep(0.05)
    spun += cpu_seconds() - before
print(os.environ["GOMP_SPINCOUNT"], spun)
"""


def spin(users_value: str | None) -> tuple[str, float]:
    """(GOMP_SPINCOUNT as the process saw it, CPU seconds spent while its main thread slept 20 times)."""
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"} | {"PYTHONPATH": str(ROOT)}
    if users_value is not None:
        env["GOMP_SPINCOUNT"] = users_value
    done = subprocess.run([sys.executable, "-c", SPIN], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    value, seconds = done.stdout.split()
    return value, float(seconds)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs for a second OpenMP thread")
def test_import_k3_shortens_openmp_spin_and_keeps_a_users_value():
    k3s, libgomps = spin(None), spin("300000")  # libgomp's own default count
    assert k3s[0] == "10000" and libgomps[0] == "300000"
    assert libgomps[1] > 0.01  # 20 spins of libgomp's default are milliseconds each
    assert k3s[1] < libgomps[1] / 5, (k3s, libgomps)
