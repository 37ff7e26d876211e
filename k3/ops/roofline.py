"""This machine's references for a kernel's speed, measured in the same run: streaming read bandwidth and
fp32 GEMM rate, with the CPU's model, SIMD features and the threads used.

A memory-bound kernel (a decode GEMV reads each weight once) is judged against :func:`read_bandwidth`, a
compute-bound one (chunked KDA, prefill) against :func:`gemm_rate`. Both depend on load and threads, so
benchmarks measure them beside the kernel instead of quoting a figure from another day.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from k3.ops.doctor import cpu_info

READ_BYTES = 512 * 2**20  # larger than any CPU's last-level cache today (the EPYC here has 32 MiB)
SIMD_FEATURES = ("avx2", "avx512f", "avx512bf16", "amx-tile", "amx-bf16")


def call_seconds(fn: Callable[[], object], repeats: int) -> list[float]:
    """The seconds of each of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of ``repeats`` calls of ``fn`` after one warm-up call."""
    return min(call_seconds(fn, repeats))


def read_bandwidth(nbytes: int = READ_BYTES, repeats: int = 5) -> float:
    """Bytes per second of a plain read of an ``nbytes`` float32 buffer (a sum: one add per 4 bytes, far
    below the compute a core has, so memory bound), all torch threads; the best of ``repeats``."""
    buffer = torch.ones(nbytes // 4)
    return buffer.nbytes / best_seconds(buffer.sum, repeats)


def gemm(n: int = 2048) -> tuple[Callable[[], torch.Tensor], float]:
    """An fp32 ``[n, n] @ [n, n]`` to time (all torch threads) and its FLOP count, 2 n^3."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return (lambda: a @ b), 2.0 * n**3


def gemm_rate(n: int = 2048, repeats: int = 5) -> float:
    """FLOP per second of :func:`gemm` ``(n)``, the best of ``repeats``."""
    product, flops = gemm(n)
    return flops / best_seconds(product, repeats)


def machine_line() -> str:
    """``CPU <model>; avx2 yes, avx512f yes, ...; N threads of M usable CPUs; load a/b/c``."""
    info = cpu_info()
    features = ", ".join(f"{name} {'yes' if info['features'].get(name) else 'no'}" for name in SIMD_FEATURES)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = "/".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return (
        f"CPU {info['model']}; {features}; torch {torch.__version__}, {torch.get_num_threads()} threads "
        f"of {usable} usable CPUs; load (1/5/15 min) {load}"
    )


def references(repeats: int = 5) -> dict[str, float]:
    """``{"read_bytes_per_s": ..., "gemm_flop_per_s": ...}`` measured now, with the current threads."""
    return {
        "read_bytes_per_s": read_bandwidth(repeats=repeats),
        "gemm_flop_per_s": gemm_rate(repeats=repeats),
    }


def references_line(refs: dict[str, float]) -> str:
    return (
        f"same-run references: streaming read {refs['read_bytes_per_s'] / 1e9:.1f} GB/s "
        f"({READ_BYTES >> 20} MiB fp32 sum), fp32 GEMM 2048^3 {refs['gemm_flop_per_s'] / 1e9:.1f} GFLOP/s"
    )
