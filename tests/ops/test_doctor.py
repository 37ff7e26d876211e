"""`k3 doctor`: the kernels it reports are those in use, the fallback's reason, CPU features parsed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3.cli import app
from k3.ops.decode.native import DECODE_EXTENSION
from k3.ops.doctor import busy_cpus, busy_fraction, cpu_info, diagnose, render, shared_machine_advice
from k3.ops.extension import native_status
from k3.ops.kda.native import KDA_EXTENSION
from k3.ops.mxfp4.native import MXFP4_EXTENSION

REPO = Path(__file__).resolve().parents[2]


def test_doctor_reports_the_kernels_in_use():
    result = CliRunner().invoke(app, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # stderr may say a kernel is being compiled
    for kernel, ext in zip(
        report["kernels"], (MXFP4_EXTENSION, KDA_EXTENSION, DECODE_EXTENSION), strict=True
    ):
        status = native_status(ext)
        assert kernel["name"] == ext.name
        assert kernel["in_use"] == ("native" if status.in_use else "torch fallback")
        # MXFP4 and decode say which few-row MXFP4 GEMV they picked, KDA which chunk products
        asked = "products_variant" if ext is KDA_EXTENSION else "gemv_variant"
        assert kernel["variant"] == (getattr(status.module, asked)() if status.in_use else None)
    kda = report["kernels"][1]
    if kda["variant"] is not None:
        assert (kda["variant"] == "avx512") == report["cpu"]["features"]["avx512f"]
    mxfp4 = report["kernels"][0]
    if mxfp4["variant"] is not None:  # AVX-512 only where the CPU has it
        cpu = report["cpu"]["features"]
        assert (mxfp4["variant"] == "avx512") <= cpu["avx512f"]
        # bf16 dot products only where the CPU has them, and the module's answer is the one reported
        assert mxfp4["bf16_dot_products"] == native_status(MXFP4_EXTENSION).module.bf16_gemv_supported()
        assert mxfp4["bf16_dot_products"] <= (cpu["avx512bf16"] and cpu["avx512f"] and cpu["avx512bw"])
    assert all(k["bf16_dot_products"] is None for k in report["kernels"][1:])
    if mxfp4["int8_vnni"] is not None:  # VNNI only where the CPU has it, as the module says
        assert mxfp4["int8_vnni"] == native_status(MXFP4_EXTENSION).module.int8_vnni_supported()
        cpu = report["cpu"]["features"]
        needs = ("avx512f", "avx512bw", "avx512vl", "avx512vnni")
        assert mxfp4["int8_vnni"] <= all(cpu[name] for name in needs)
    assert all(k["int8_vnni"] is None for k in report["kernels"][1:])
    decode = report["kernels"][2]
    if decode["bf16_products"] is not None:  # bf16 products only where the CPU has them, as the module says
        assert decode["bf16_products"] == native_status(DECODE_EXTENSION).module.bf16_products_supported()
        cpu = report["cpu"]["features"]
        assert decode["bf16_products"] <= (cpu["avx512f"] and cpu["avx512bw"] and cpu["avx512bf16"])
    assert all(k["bf16_products"] is None for k in report["kernels"][:2])
    assert report["torch"]["threads"] >= 1 and report["cpu"]["logical_cpus"] >= 1
    if report["cpu"]["features_native"] is not None:  # two run-time detections of the same CPU agree
        assert report["cpu"]["features_native"] == report["cpu"]["features"]
    text = CliRunner().invoke(app, ["doctor"]).output
    assert "k3.ops.kda._native:" in text and "torch 2." in text and "CPU features" in text
    if kda["variant"] == "avx512":
        assert "runs AVX-512 for the chunk products (prefill, training), AVX2 + FMA elsewhere" in text
    if mxfp4["variant"] is not None:
        assert ("runs AVX2 + FMA" in text) == (report["kernels"][1]["variant"] == "avx2")  # KDA
        assert ("runs AVX-512" in text) == (mxfp4["variant"] == "avx512")
        assert ("bf16 activations: bf16 dot products" in text) == mxfp4["bf16_dot_products"]
        assert ("int8 expert inputs: AVX-512 VNNI" in text) == mxfp4["int8_vnni"]
    if decode["bf16_products"] is not None:
        said = "bf16 products in decode steps (--bf16-products): AVX-512 BF16" in text
        assert said == decode["bf16_products"]


def first_cpu_fields(*keys: str) -> dict[str, str]:
    """The first CPU's values for `keys` in /proc/cpuinfo (read apart from the native module's cpuid)."""
    found: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key in keys and key not in found:
            found[key] = value
    return found


@pytest.mark.parametrize(
    ("question", "avx512", "answer_there", "said"),
    [
        # short fp32 rows one at a time (for up to 12 vectors) on Zen 3 only, elsewhere in tiles
        ("short_rows_one_by_one", False, True, "one row at a time, each asking 2 kB ahead (Zen 3"),
        # tiled BF16 rows at one vector left to the hardware prefetcher on Zen 4 only, elsewhere asking ahead
        ("tiled_rows_ask_ahead", True, False, "tiled BF16 rows at one vector: left to the hardware"),
    ],
)
def test_a_read_chosen_for_one_amd_family_25(question, avx512, answer_there, said):
    """The decode module's reads that differ on Zen 3 (AMD family 25 without AVX-512) or Zen 4 (with it),
    chosen by cpuid (_native_gemv.h): the module answers `answer_there` on that CPU and the opposite
    elsewhere; /proc/cpuinfo says which this CPU is, and doctor reports it."""
    status = native_status(DECODE_EXTENSION)
    assert status.in_use, status.reason
    cpu = first_cpu_fields("vendor_id", "cpu family", "flags")
    there = (
        cpu["vendor_id"] == "AuthenticAMD"
        and int(cpu["cpu family"]) == 25
        and ("avx512f" in cpu["flags"].split()) == avx512
    )
    answer = answer_there if there else not answer_there
    assert getattr(status.module, question)() == answer
    report = diagnose()
    assert report["kernels"][2][question] == answer
    assert (said in render(report)) == there


def test_doctor_says_why_a_kernel_is_not_in_use():
    env = {**os.environ, "K3_NATIVE": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "k3", "doctor"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("torch fallback; turned off by K3_NATIVE=0") == 3  # MXFP4, KDA, decode
    assert "CPU features (/proc/cpuinfo)" in done.stdout  # no native module to ask


def test_cpu_features_from_a_planted_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: Planted CPU 9000\nflags\t\t: fpu sse2 avx2 fma avx512f amx_tile\n\n"
        "processor\t: 1\nmodel name\t: Planted CPU 9000\nflags\t\t: fpu sse2 avx2 fma avx512f amx_tile\n"
    )
    info = cpu_info(cpuinfo)
    assert info["model"] == "Planted CPU 9000"
    present = {name for name, yes in info["features"].items() if yes}
    assert present == {"avx2", "fma", "avx512f", "amx-tile"}


def test_doctor_says_when_threads_share_cores_with_other_processes():
    """With the busy CPUs planted: a line naming the idle cores' count when torch's threads outnumber them,
    none on an idle machine or with threads enough for the idle cores."""
    assert shared_machine_advice(2, 2, 0.1) is None
    assert shared_machine_advice(1, 2, 1.0) is None  # one thread for the one idle core
    assert shared_machine_advice(2, 2, None) is None
    busy = shared_machine_advice(2, 2, 1.2)
    assert busy is not None and "--threads 1" in busy and "1.2 of 2 CPUs" in busy
    assert "--threads 6" in (shared_machine_advice(8, 8, 2.4) or "")
    assert "--threads 1" in (shared_machine_advice(4, 4, 9.0) or "")  # never fewer than one
    report = diagnose()
    report["torch"]["threads"], report["cpu"]["usable_cpus"], report["cpu"]["busy_cpus"] = 2, 2, 1.0
    assert "2 threads: they share cores with them; --threads 1 leaves them their cores" in render(report)
    report["cpu"]["busy_cpus"] = 0.0
    assert "--threads" not in render(report)


def test_busy_cpus_from_planted_readings_and_a_spinning_process(tmp_path):
    """The busy share between two /proc/stat readings (planted: 300 of 1,000 ticks idle or iowait: 0.7; no
    ticks: 0), and a live reading while another process spins: at least most of one CPU (other load on the
    machine only adds to it)."""
    before = "cpu  100 0 100 500 0 0 0 0 0 0"
    assert busy_fraction(before, "cpu  500 0 300 750 50 0 0 100 0 0") == 0.7
    assert busy_fraction(before, before) == 0.0
    assert busy_cpus(stat=tmp_path / "missing") is None
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = busy_cpus(0.5)
    finally:
        spinner.kill()
        spinner.wait()
    assert busy is not None and busy >= 0.6, busy
