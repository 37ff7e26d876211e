"""What k3 runs on here: the kernels in use (native or the torch fallback, and why), torch, the CPU.

:func:`diagnose` returns it as a dict (``k3 doctor --json`` prints it); ``k3 doctor`` prints it as text.
CPU features are detected at run time: from /proc/cpuinfo's flags and, where a native module loaded, from
the compiler's ``__builtin_cpu_supports`` inside it (the check the kernels themselves rely on); each
native kernel says which SIMD variant it runs here (AVX-512 or AVX2).
"""

from __future__ import annotations

import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

from k3.ops.decode.native import DECODE_EXTENSION
from k3.ops.extension import NativeExtension, cache_root, native_status
from k3.ops.kda.native import KDA_EXTENSION
from k3.ops.mxfp4.native import MXFP4_EXTENSION
from k3.ops.reproducible import product_checks

# what each extension serves, and what runs instead without it
KERNELS: tuple[tuple[NativeExtension, str, str], ...] = (
    (
        MXFP4_EXTENSION,
        "MXFP4 matmul (routed experts), one decode token's experts in one call, the atlas histograms",
        "dequantize + torch mm; one torch op at a time",
    ),
    (
        KDA_EXTENSION,
        "chunked KDA forward/backward (prefill, training), the one-token KDA decode step",
        "the same loops in torch",
    ),
    (
        DECODE_EXTENSION,
        "the fused decode step: each layer's mixer and FFN, AttnRes reads and lm_head in one call each",
        "the per-module decode paths (torch ops around the two kernels above)",
    ),
)
# /proc/cpuinfo flag -> the name __builtin_cpu_supports uses
CPU_FLAGS = {
    "avx2": "avx2",
    "fma": "fma",
    "avx512f": "avx512f",
    "avx512bw": "avx512bw",
    "avx512vl": "avx512vl",
    "avx512_vnni": "avx512vnni",
    "avx512_bf16": "avx512bf16",
    "amx_tile": "amx-tile",
    "amx_bf16": "amx-bf16",
}


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """The CPU's model name and {feature: present} from /proc/cpuinfo (empty features off Linux)."""
    model, flags = None, None  # the first CPU's
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() == "flags" and flags is None:
                flags = set(value.split())
    features = {name: flag in (flags or ()) for flag, name in CPU_FLAGS.items()}
    return {"model": model or platform.processor() or platform.machine(), "features": features}


def busy_fraction(before: str, after: str) -> float:
    """The share of time the CPUs were busy between two readings of /proc/stat's first line ("cpu user nice
    system idle iowait irq softirq steal ..."): all but idle and iowait (steal counts: another guest ran)."""
    first, second = ([int(v) for v in text.split()[1:9]] for text in (before, after))
    spent = [b - a for a, b in zip(first, second, strict=True)]
    total = sum(spent)
    return 0.0 if total <= 0 else (total - spent[3] - spent[4]) / total


def busy_cpus(seconds: float = 0.25, stat: Path = Path("/proc/stat")) -> float | None:
    """CPUs' worth of time the machine's processes spent busy over `seconds` while this one slept: what other
    processes keep busy now. None where there is no /proc/stat."""
    if not stat.exists():
        return None
    before = stat.read_text().splitlines()[0]
    time.sleep(seconds)
    after = stat.read_text().splitlines()[0]
    return busy_fraction(before, after) * (os.cpu_count() or 1)


def kernel_variant(module) -> str | None:
    """The SIMD code a native module runs here: "avx512" where its few-row MXFP4 GEMV (the MXFP4 module, a
    CPU with AVX-512 F/DQ) or its chunk products (the KDA module, AVX-512 F) take their AVX-512
    variant, else "avx2"; None without it."""
    if module is None:
        return None
    for name in ("gemv_variant", "products_variant"):
        if hasattr(module, name):
            return getattr(module, name)()
    return "avx2"


def module_answer(module, question: str) -> bool | None:
    """`module.<question>()` from a native module that has it; None for the modules that do not (and without
    the module). The MXFP4 module answers `bf16_gemv_supported` (few rows of bf16 activations multiply MXFP4
    weights with bf16 dot products, AVX-512 BF16) and `int8_vnni_supported` (activations rounded to int8,
    `--int8-expert-inputs`, use AVX-512 VNNI: the same bits as its AVX2 kernel); the decode
    module `bf16_products_supported` (`--bf16-products`: BF16 weights times inputs rounded to bf16) and
    `short_rows_one_by_one` (short fp32 rows read one at a time for up to 12 vectors: Zen 3; else tiles) and
    `tiled_rows_ask_ahead` (tiled BF16 rows at one vector ask for their lines ahead: all but Zen 4)."""
    if module is None or not hasattr(module, question):
        return None
    return getattr(module, question)()


# what runs in AVX-512 where a module's "avx512" variant is in use (the rest: AVX2 + FMA)
AVX512_PARTS = {
    MXFP4_EXTENSION.name: "the few-row MXFP4 GEMV (M <= 8)",
    KDA_EXTENSION.name: "the chunk products (prefill, training)",
    DECODE_EXTENSION.name: "the experts' MXFP4 products, the weight rows and the MLA heads",
}


# How the decode module reads rows where CPUs differ (its answer's key, what, what yes and no mean).
READ_CHOICES = (
    (
        "short_rows_one_by_one",
        "short fp32 rows (<= 2 kB, K <= 512)",
        "one row at a time, each asking 2 kB ahead (Zen 3: faster there)",
        "in tiles (of 8 rows at one vector, each asking for the next ahead into L2)",
    ),
    (
        "tiled_rows_ask_ahead",
        "tiled BF16 rows at one vector",
        "each block asks for its lines 8 kB ahead",
        "left to the hardware prefetcher (Zen 4: faster there)",
    ),
)


def variant_text(name: str, variant: str) -> str:
    """How `k3 doctor` says what SIMD code the native module `name` runs."""
    return f"AVX-512 for {AVX512_PARTS[name]}, AVX2 + FMA elsewhere" if variant == "avx512" else "AVX2 + FMA"


def kernel_reports() -> list[dict]:
    """What `k3 doctor` says of each native module: in use or why not, its SIMD code and its choices (for a
    benchmark's header too, without diagnose's quarter second sampling the load)."""
    kernels = []
    for extension, serves, fallback in KERNELS:
        with warnings.catch_warnings():  # the reason is reported below, not warned about
            warnings.simplefilter("ignore", RuntimeWarning)
            status = native_status(extension)
        kernels.append(
            {
                "name": extension.name,
                "serves": serves,
                "in_use": "native" if status.in_use else "torch fallback",
                "variant": kernel_variant(status.module),
                "bf16_dot_products": module_answer(status.module, "bf16_gemv_supported"),
                "int8_vnni": module_answer(status.module, "int8_vnni_supported"),
                "bf16_products": module_answer(status.module, "bf16_products_supported"),
                **{key: module_answer(status.module, key) for key, *_ in READ_CHOICES},
                "reason": status.reason if not status.in_use else "",
                "fallback": fallback,
                "path": str(status.path) if status.path else None,
            }
        )
    return kernels


def diagnose() -> dict:
    """Everything `k3 doctor` reports, as plain data."""
    import k3

    kernels = kernel_reports()
    cpu = cpu_info()
    loaded = [native_status(ext).module for ext, _, _ in KERNELS if native_status(ext).in_use]
    native_view = dict(loaded[0].cpu_features()) if loaded else None
    return {
        "k3": {"version": k3.__version__, "path": str(Path(k3.__file__).parent)},
        "python": sys.version.split()[0],
        "torch": {
            "version": torch.__version__,
            "threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "mkl": torch.backends.mkl.is_available(),
            "openmp": torch.backends.openmp.is_available(),
        },
        "cpu": {
            "model": cpu["model"],
            "logical_cpus": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "busy_cpus": busy_cpus(),  # what other processes keep busy now (k3 sleeps while it looks)
            "features": cpu["features"],
            "features_native": native_view,
        },
        "native_cache": str(cache_root()),
        "kernels": kernels,
        "products": product_checks(),
    }


def shared_machine_advice(threads: int, usable: int | None, busy: float | None) -> str | None:
    """A line for a machine whose other processes keep cores busy (`busy_cpus`), when torch's threads
    outnumber the idle cores; else None. A thread that shares its core runs in turns: timings move with the
    other processes' load, and the idle cores' count of threads leaves them their cores (decode holds its
    speed beside them: docs/native-cpus.md 'A shared machine')."""
    if not usable or busy is None or busy < 0.5:
        return None
    idle = max(1, usable - round(busy))
    if threads <= idle:
        return None
    return (
        f"load: other processes keep about {busy:.1f} of {usable} CPUs busy; torch runs {threads} threads: "
        f"they share cores with them; --threads {idle} leaves them their cores (docs/native-cpus.md "
        "'A shared machine')"
    )


def render(report: dict) -> str:
    """The report as a few lines of text."""
    t, cpu = report["torch"], report["cpu"]
    lines = [
        f"k3 {report['k3']['version']} ({report['k3']['path']}), Python {report['python']}",
        f"torch {t['version']}: {t['threads']} threads ({t['interop_threads']} inter-op), "
        f"CPU capability {t['cpu_capability']}, MKL {'yes' if t['mkl'] else 'no'}, "
        f"OpenMP {'yes' if t['openmp'] else 'no'}",
        f"CPU: {cpu['model']}, {cpu['usable_cpus'] or '?'} of {cpu['logical_cpus']} logical CPUs usable",
    ]
    advice = shared_machine_advice(t["threads"], cpu["usable_cpus"], cpu["busy_cpus"])
    if advice:
        lines.append(advice)
    features = cpu["features_native"] or cpu["features"]
    source = "native module" if cpu["features_native"] else "/proc/cpuinfo"
    lines.append(
        f"CPU features ({source}): "
        + ", ".join(f"{name} {'yes' if present else 'no'}" for name, present in features.items())
    )
    p = report["products"]
    lines.append(
        f"fp32 products (MKL_CBWR={p['mkl_cbwr'] or 'unset'}): "
        + (
            "the same bits at any memory alignment"
            if p["alignment_independent"]
            else "the bits DEPEND ON MEMORY ALIGNMENT (set MKL_CBWR=AUTO before torch runs: import k3 first)"
        )
        + "; 1 vs 2 threads: "
        + (
            "the same bits"
            if p["thread_independent"]
            else "other rounding"
            + (
                " (within the reordering bound)"
                if p["within_order_bound"]
                else ", BEYOND the reordering bound"
            )
        )
    )
    lines.append(f"native kernels (cache {report['native_cache']}):")
    for k in report["kernels"]:
        why = f"; {k['reason']}; instead: {k['fallback']}" if k["reason"] else f" ({k['path']})"
        lines.append(f"  {k['name']}: {k['in_use']}{why}\n    serves {k['serves']}")
        if k["variant"]:
            lines.append(f"    runs {variant_text(k['name'], k['variant'])}")
        if k["bf16_dot_products"] is not None:
            dot = k["bf16_dot_products"]
            few = "bf16 dot products (AVX-512 BF16)" if dot else "fp32 FMAs (no AVX-512 BF16)"
            lines.append(f"    bf16 activations: {few} at <= 8 rows, bf16 tiles + torch's bf16 GEMM above")
        if k["int8_vnni"] is not None:
            how = "AVX-512 VNNI" if k["int8_vnni"] else "AVX2 (no AVX-512 VNNI)"
            lines.append(f"    int8 expert inputs: {how}")
        if k["bf16_products"] is not None:
            how = "AVX-512 BF16" if k["bf16_products"] else "not on this CPU (no AVX-512 BF16)"
            lines.append(f"    bf16 products in decode steps (--bf16-products): {how}")
        for key, what, yes, no in READ_CHOICES:
            if k[key] is not None:
                lines.append(f"    {what}: {yes if k[key] else no}")
    return "\n".join(lines)
