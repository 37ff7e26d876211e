"""MXFP4 packed matmul vs dense F.linear on the K3 expert shapes, against this machine's read bandwidth.

    python benchmarks/mxfp4.py [--m 1 8 256] [--threads 2 1] [--repeat 40] [--cycle-mb 256]

`mxfp4 bf16 x` is the same packed matrix times a bf16 x (k3's bf16 compute mode: bf16 dot products at
M <= 8 where the CPU has AVX-512 BF16, bf16 tiles and torch's bf16 GEMM above). `mxfp4 decode` (M <= 8) is
the product the fused decode step runs for each chosen expert (k3.ops.decode's `expert_rows`: the same
nibble-order kernel as `mxfp4 native` at M <= 8, entered the way the step enters it). `mxfp4 int8 x` is the
approximate mode (k3.ops.mxfp4.int8_x: x rounded to int8 per block of 32, integer products); its distance
from the exact product is printed beside it (largest |difference| / largest |exact|, and against the bound
of the rounding).

Measured as decode meets it: every call reads another matrix, each method cycling through distinct
matrices totalling ``--cycle-mb`` (256 MB: 44 MXFP4 experts of 5.9 MB, far more than the caches hold; one
matrix timed in a loop stays cache-hot and overstates the rate). For each thread count the run first
measures its references (k3.ops.roofline: a plain read of a 512 MiB buffer and a 2048^3 fp32 GEMM, all
threads), then for each shape and rows M of x: median wall time and process CPU time per call (CPU time
moves less than wall time on a shared machine), bytes of weight read per second and their share of the
read bandwidth, GFLOP/s, and weight bytes per parameter (MXFP4: 16 packed bytes + 1 scale byte per 32).

Targets checked: resident <= 0.54 B/param; at M = 1 and 8 the native kernel >= 80 % of the read bandwidth
(issue 40, target 3; the int8 mode listed apart) and faster than dense bfloat16; at M = 256 within 2x of
dense fp32. Report the load (printed) with any figure.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from k3.ops.decode.native import load_native as load_decode_native
from k3.ops.mxfp4 import dequantize_mxfp4, mxfp4_matmul, native_available
from k3.ops.mxfp4.int8_x import rounding_bound
from k3.ops.mxfp4.matmul import NATIVE_GEMV_MAX_M, NATIVE_TILE_K, NATIVE_TILE_N
from k3.ops.mxfp4.native import load_native
from k3.ops.roofline import machine_line, references, references_line

# K3 routed-expert matrices W [N, K]: w1/w3 map latent 3584 -> 3072, w2 maps 3072 -> 3584
SHAPES = {"w1/w3": (3072, 3584), "w2": (3584, 3072)}


def random_mxfp4(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random packed matrix [n, k/2] with E8M0 scales [n, k/32] around 2^-6 (a trained expert's range)."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(116, 126, (n, k // 32), dtype=torch.uint8, generator=gen)
    return packed, scale


def median_ms(
    fn: Callable[..., torch.Tensor], x: torch.Tensor, operands: list, repeat: int
) -> tuple[float, float]:
    """Median wall and process-CPU ms of ``fn(x, operands[i % len(operands)])`` over ``repeat`` calls, after
    one pass over every operand (so none is touched for the first time while timed)."""
    for operand in operands:
        fn(x, operand)
    wall, cpu = [], []
    for i in range(repeat):
        operand = operands[i % len(operands)]
        start, start_cpu = time.perf_counter(), time.process_time()
        fn(x, operand)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def matmul_native(x: torch.Tensor, packed_scale: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return mxfp4_matmul(x, *packed_scale, backend="native")


def matmul_native_avx2(x: torch.Tensor, packed_scale: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The native kernels with the AVX2 GEMV forced (the same bits as the AVX-512 one: its baseline)."""
    return load_native().matmul(
        x,
        *packed_scale,
        gemv_max_m=NATIVE_GEMV_MAX_M,
        tile_n=NATIVE_TILE_N,
        tile_k=NATIVE_TILE_K,
        variant="avx2",
    )


def matmul_native_bf16(x: torch.Tensor, packed_scale: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A bf16 x (k3's bf16 compute mode): bf16 dot products at few rows, bf16 tiles and GEMM at many."""
    return mxfp4_matmul(x.to(torch.bfloat16), *packed_scale, backend="native")


def decode_rows(x: torch.Tensor, packed_scale: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The fused decode step's product of a chosen expert's matrix (k3.ops.decode `expert_rows`: bits that
    do not depend on the batch; at one row the AVX-512 kernel with pre-scaled lookup tables)."""
    return load_decode_native().expert_rows(x, *packed_scale)


def matmul_int8_x(x: torch.Tensor, packed_scale: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The approximate mode: x rounded to int8 per block of 32 (k3.ops.mxfp4.int8_x)."""
    return mxfp4_matmul(x, *packed_scale, backend="native", int8_inputs=True)


def matmul_int8_avx2(x: torch.Tensor, packed_scale: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The int8 mode with its AVX2 kernel forced (the same bits as the VNNI one, which runs from 4 rows)."""
    return load_native().matmul_int8_x(x, *packed_scale, "avx2")


def int8_distance(x: torch.Tensor, packed_scale: tuple[torch.Tensor, torch.Tensor]) -> str:
    """How far the int8 mode is from the exact product, and the largest share of its bound it reaches."""
    exact, rounded = matmul_native(x, packed_scale), matmul_int8_x(x, packed_scale)
    error = (rounded - exact).abs()
    bound = rounding_bound(x, *packed_scale)
    share = (error.double() / bound).max().item()
    distance = (error.max() / exact.abs().max()).item()
    return f"distance {distance:.1e} of max |exact|, <= {share:.2f} of the bound"


def matmul_torch(x: torch.Tensor, packed_scale: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return mxfp4_matmul(x, *packed_scale, backend="torch")


def linear_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.to(torch.bfloat16), w)


def linear_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def copies_for(weight_bytes: int, cycle_bytes: int) -> int:
    """Distinct matrices a method cycles through: enough to fill ``cycle_bytes``, at least 2."""
    return max(2, math.ceil(cycle_bytes / weight_bytes))


def bench_threads(args: argparse.Namespace, threads: int, checks: list[tuple[str, bool]]) -> None:
    torch.set_num_threads(threads)
    refs = references()
    read = refs["read_bytes_per_s"]
    print(f"\n{machine_line()}\n{references_line(refs)}")
    header = (
        f"{'shape':<7}{'M':>4}  {'method':<14}{'copies':>7}{'ms':>8}{'CPU ms':>8}{'GB/s':>7}{'% read':>7}"
        f"{'GFLOP/s':>9}{'B/param':>8}"
    )
    print(header)
    print("-" * len(header))
    gen = torch.Generator().manual_seed(args.seed)
    cycle = args.cycle_mb * 10**6
    for shape_name, (n, k) in SHAPES.items():
        packed, scale = random_mxfp4(n, k, gen)
        mxfp4_bytes = packed.nbytes + scale.nbytes
        resident = mxfp4_bytes / (n * k)
        checks.append((f"{shape_name}: resident {resident:.4f} B/param <= 0.54", resident <= 0.54))
        packed_scales = [(packed, scale)] + [
            random_mxfp4(n, k, gen) for _ in range(copies_for(mxfp4_bytes, cycle) - 1)
        ]
        fp32_copies = copies_for(n * k * 4, cycle) if "dense fp32" in args.methods else 0
        bf16_copies = copies_for(n * k * 2, cycle) if "dense bf16" in args.methods else 0
        dense_fp32 = [dequantize_mxfp4(*packed_scales[i]) for i in range(fp32_copies)]
        dense_bf16 = [dequantize_mxfp4(*packed_scales[i]).to(torch.bfloat16) for i in range(bf16_copies)]
        for m in args.m:
            x = torch.randn(m, k, generator=gen)
            methods: dict[str, tuple[Callable[..., torch.Tensor], list, int]] = {}
            if native_available():
                methods["mxfp4 native"] = (matmul_native, packed_scales, mxfp4_bytes)
                if m <= NATIVE_GEMV_MAX_M:  # above it both run the tiled path
                    methods["mxfp4 avx2"] = (matmul_native_avx2, packed_scales, mxfp4_bytes)
                methods["mxfp4 bf16 x"] = (matmul_native_bf16, packed_scales, mxfp4_bytes)
                methods["mxfp4 int8 x"] = (matmul_int8_x, packed_scales, mxfp4_bytes)
                methods["mxfp4 int8 avx2"] = (matmul_int8_avx2, packed_scales, mxfp4_bytes)
            if m <= NATIVE_GEMV_MAX_M and load_decode_native() is not None:
                methods["mxfp4 decode"] = (decode_rows, packed_scales, mxfp4_bytes)
            methods["mxfp4 torch"] = (matmul_torch, packed_scales[:2], mxfp4_bytes)
            methods["dense bf16"] = (linear_bf16, dense_bf16, n * k * 2)
            methods["dense fp32"] = (linear_fp32, dense_fp32, n * k * 4)
            times = {}
            for name, (fn, operands, weight_bytes) in methods.items():
                if name not in args.methods or not operands:
                    continue
                # the slow fallback gets fewer repeats so the run stays short
                repeat = max(3, args.repeat // 8) if name == "mxfp4 torch" else args.repeat
                ms, cpu_ms = median_ms(fn, x, operands, repeat)
                times[name] = ms
                rate = weight_bytes / ms / 1e6
                print(
                    f"{shape_name:<7}{m:>4}  {name:<14}{len(operands):>7}{ms:>8.3f}{cpu_ms:>8.3f}{rate:>7.1f}"
                    f"{100 * rate * 1e9 / read:>6.0f}%{2 * m * n * k / ms / 1e6:>9.1f}"
                    f"{weight_bytes / (n * k):>8.4f}"
                    + (f"  {int8_distance(x, packed_scales[0])}" if name == "mxfp4 int8 x" else "")
                )
            best = "mxfp4 native" if "mxfp4 native" in times else "mxfp4 torch"
            if best not in times:
                continue
            share = mxfp4_bytes / times[best] * 1e3 / read
            where = f"{threads} threads, {shape_name} M={m}: {best}"
            if m <= 8:
                checks.append((f"{where} at {100 * share:.0f} % of read >= 80 %", share >= 0.8))
                if "mxfp4 int8 x" in times:
                    approximate = mxfp4_bytes / times["mxfp4 int8 x"] * 1e3 / read
                    checks.append(
                        (
                            f"{threads} threads, {shape_name} M={m}: mxfp4 int8 x (approximate) at "
                            f"{100 * approximate:.0f} % of read >= 80 %",
                            approximate >= 0.8,
                        )
                    )
            if m == 1 and "dense bf16" in times:
                bf16 = times["dense bf16"]
                checks.append(
                    (
                        f"{where} {times[best]:.3f} ms <= bf16 {bf16:.3f} ms",
                        times[best] <= bf16,
                    )
                )
            if m == 256 and "dense fp32" in times:
                fp32 = times["dense fp32"]
                checks.append(
                    (
                        f"{where} {times[best]:.2f} ms <= 2 x fp32 {fp32:.2f} ms",
                        times[best] <= 2 * fp32,
                    )
                )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--m", type=int, nargs="+", default=[1, 8, 256], help="rows of x")
    parser.add_argument("--repeat", type=int, default=40, help="timed calls per measurement (median)")
    parser.add_argument(
        "--threads", type=int, nargs="+", default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cycle-mb", type=int, default=256, help="MB of distinct matrices each method cycles through"
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=[
            "mxfp4 native",
            "mxfp4 avx2",
            "mxfp4 bf16 x",
            "mxfp4 int8 x",
            "mxfp4 int8 avx2",
            "mxfp4 decode",
            "mxfp4 torch",
            "dense bf16",
            "dense fp32",
        ],
        help="of 'mxfp4 native' 'mxfp4 avx2' (AVX2 GEMV forced) 'mxfp4 bf16 x' (bf16 activations) "
        "'mxfp4 int8 x' (x rounded to int8 per block) 'mxfp4 int8 avx2' (its AVX2 kernel forced) "
        "'mxfp4 decode' (the fused decode step's expert "
        "product) 'mxfp4 torch' 'dense bf16' 'dense fp32'",
    )
    args = parser.parse_args()
    native = load_native()
    variant = native.gemv_variant() if native is not None and hasattr(native, "gemv_variant") else "none"
    print(f"native MXFP4 kernels: {native_available()}, GEMV variant: {variant}")
    checks: list[tuple[str, bool]] = []
    for threads in args.threads or [torch.get_num_threads()]:
        bench_threads(args, threads, checks)
    print("\n(CPU ms: process CPU time per call; read it at 1 thread only: a call this short ends before the")
    print(" other threads' CPU time is counted, e.g. 0.22 ms calls at 2 threads showed ~0.2 CPU ms each,")
    print(" while a 2,000-call loop showed 0.42)")
    print("\ntargets:")
    for description, ok in checks:
        print(f"  [{'ok' if ok else 'MISSED'}] {description}")


if __name__ == "__main__":
    main()
