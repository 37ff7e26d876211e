"""MXFP4 packed matmul vs dense F.linear on the K3 expert shapes.

    python benchmarks/mxfp4.py [--m 1 16 256] [--repeat 20] [--threads N] [--copies 8]

For each shape and each number of rows M of x, times ``mxfp4_matmul`` (native kernels, if built with
``python -m k3.ops.build``, and the pure-torch fallback) against dense bfloat16 and float32
``F.linear`` on the dequantized weight, and prints: median time, weight bytes read per second (the bytes
each method's weight occupies, read once per call), GFLOP/s (2*M*N*K per call) and resident weight bytes
per parameter. Then checks the targets: resident <= 0.54 B/param; at M = 1 the native kernel at least as
fast as dense bfloat16; at M = 256 within 2x of dense float32.

With the default ``--copies 1`` the same weight is read on every call, so a small one (5.8 MB of MXFP4)
may stay in the last-level cache; ``--copies 8`` cycles through 8 weights per method to measure reading
from memory. Timings on a shared machine are noisy; the median of several repeats is reported.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from k3.ops.mxfp4 import dequantize_mxfp4, mxfp4_matmul, native_available, quantize_mxfp4

# K3 routed-expert matrices W [N, K]: w1/w3 map hidden 3584 -> 3072, w2 maps 3072 -> 3584
SHAPES = {"w1/w3": (3072, 3584), "w2": (3584, 3072)}


def median_ms(fn: Callable[..., torch.Tensor], x: torch.Tensor, operands: list, repeat: int) -> float:
    """Median time of ``fn(x, operands[i % len(operands)])`` over ``repeat`` calls, after one warm-up call."""
    fn(x, operands[0])
    times = []
    for i in range(repeat):
        operand = operands[i % len(operands)]
        start = time.perf_counter()
        fn(x, operand)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def matmul_native(x: torch.Tensor, packed_scale: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return mxfp4_matmul(x, *packed_scale, backend="native")


def matmul_torch(x: torch.Tensor, packed_scale: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return mxfp4_matmul(x, *packed_scale, backend="torch")


def linear_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.to(torch.bfloat16), w)


def linear_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def main() -> None:
    parser = argparse.ArgumentParser(description="MXFP4 matmul vs dense F.linear on K3 expert shapes")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 256], help="rows of x")
    parser.add_argument("--repeat", type=int, default=20, help="timed calls per measurement (median)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--copies",
        type=int,
        default=1,
        help="distinct weight matrices used in turn (e.g. 8: no weight fits in the last-level cache)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, native kernels: {native_available()}"
    )

    checks: list[tuple[str, bool]] = []
    header = f"{'shape':<7}{'M':>5}  {'method':<16}{'ms':>9}{'weight GB/s':>13}{'GFLOP/s':>10}{'B/param':>9}"
    print(header)
    print("-" * len(header))
    for shape_name, (n, k) in SHAPES.items():
        # `copies` independent weights, used in turn, so that repeated calls can be made to miss the caches
        packed_scales = [quantize_mxfp4(torch.randn(n, k) * 0.02) for _ in range(args.copies)]
        dense_fp32 = [dequantize_mxfp4(packed, scale) for packed, scale in packed_scales]
        dense_bf16 = [w.to(torch.bfloat16) for w in dense_fp32]
        packed, scale = packed_scales[0]
        mxfp4_bytes = packed.nbytes + scale.nbytes
        resident = mxfp4_bytes / (n * k)
        checks.append((f"{shape_name}: resident {resident:.4f} B/param <= 0.54", resident <= 0.54))
        for m in args.m:
            x = torch.randn(m, k)
            weights: dict[str, tuple[Callable[..., torch.Tensor], list, int]] = {}
            if native_available():
                weights["mxfp4 native"] = (matmul_native, packed_scales, mxfp4_bytes)
            weights["mxfp4 torch"] = (matmul_torch, packed_scales, mxfp4_bytes)
            weights["dense bf16"] = (linear_bf16, dense_bf16, dense_bf16[0].nbytes)
            weights["dense fp32"] = (linear_fp32, dense_fp32, dense_fp32[0].nbytes)
            times = {}
            for name, (fn, operands, weight_bytes) in weights.items():
                # the slow fallback gets fewer repeats at large M so the run stays short
                repeat = max(3, args.repeat // 4) if name == "mxfp4 torch" and m > 16 else args.repeat
                ms = times[name] = median_ms(fn, x, operands, repeat)
                print(
                    f"{shape_name:<7}{m:>5}  {name:<16}{ms:>9.3f}{weight_bytes / ms / 1e6:>13.2f}"
                    f"{2 * m * n * k / ms / 1e6:>10.1f}{weight_bytes / (n * k):>9.4f}"
                )
            best = "mxfp4 native" if "mxfp4 native" in times else "mxfp4 torch"
            if m == 1:
                bf16 = times["dense bf16"]
                checks.append(
                    (
                        f"{shape_name} M=1: {best} {times[best]:.3f} ms <= bf16 {bf16:.3f} ms",
                        times[best] <= bf16,
                    )
                )
            if m == 256:
                fp32 = times["dense fp32"]
                ok = times[best] <= 2 * fp32
                checks.append(
                    (f"{shape_name} M=256: {best} {times[best]:.2f} ms <= 2 x fp32 {fp32:.2f} ms", ok)
                )
    print("\ntargets:")
    for description, ok in checks:
        print(f"  [{'ok' if ok else 'MISSED'}] {description}")


if __name__ == "__main__":
    main()
