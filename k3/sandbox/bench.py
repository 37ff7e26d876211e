"""Sandbox timings for `k3 sandbox bench` and benchmarks/sandbox.py: create-run-kill cycles per second
with 1 and 2 workers, and p50 / p95 of create, `python3 -c pass`, snapshot, restore and fork (per child),
with snapshot sizes. Every figure is wall-clock on this machine, with whatever else it is running."""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from k3.sandbox.sandbox import Sandbox


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def cycles_per_second(backend: str, workers: int, cycles: int, root: Path) -> float:
    """Create a sandbox, run `true`, kill it: `cycles` times over `workers` threads."""

    def one(_: int) -> None:
        with Sandbox.create(backend=backend, root=root) as sbx:
            sbx.commands.run("true", timeout=30)

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, range(cycles)))
    return cycles / (time.perf_counter() - start)


def latencies(backend: str, n: int, root: Path, fork_children: int = 4) -> dict:
    """p50 / p95 seconds of each operation over `n` repetitions, and the mean snapshot size in bytes.
    Each sandbox holds 1 MiB of random data in its workspace when it is snapshotted. One untimed create
    first builds the template and the guest helpers."""
    Sandbox.create(backend=backend, root=root).kill()
    times: dict[str, list[float]] = {
        k: [] for k in ("create", "run_python", "snapshot", "restore", "fork_per_child")
    }
    sizes = []
    for _ in range(n):
        dt, sbx = _timed(lambda: Sandbox.create(backend=backend, root=root))
        times["create"].append(dt)
        with sbx:
            sbx.files.write("data.bin", os.urandom(1 << 20))
            times["run_python"].append(_timed(lambda s=sbx: s.commands.run("python3 -c pass", timeout=30))[0])
            dt, snap = _timed(sbx.create_snapshot)
            times["snapshot"].append(dt)
            sizes.append(snap.size_bytes)
            dt, child = _timed(lambda s=snap: Sandbox.create(snapshot=s, root=root))
            times["restore"].append(dt)
            child.kill()
            dt, kids = _timed(lambda s=sbx: s.fork(fork_children))
            times["fork_per_child"].append(dt / fork_children)
            for k in kids:
                if isinstance(k, Sandbox):
                    k.kill()
    out = {k: {"p50": statistics.median(v), "p95": _pct(v, 0.95)} for k, v in times.items()}
    out["snapshot_bytes"] = int(statistics.mean(sizes))
    out["snapshot_kind"] = snap.kind
    return out
