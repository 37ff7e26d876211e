"""Benchmark `k3 stream` from a cold page cache: bytes and GB/s against a plain sequential read of the same
files, and against the ordinary memory-mapped forward under the same memory limit; then extrapolate the
full K3 per batch from the measured rates and the published layout.

    python benchmarks/stream.py CKPT [--tokens 1,16,256] [--limit 2GB] [--out benchmarks/results/stream.json]

Each run is a child process; with root and a memory controller it runs inside a memory cgroup of
`--limit` (the kernel's peak usage is reported). Machine load (`uptime`) is printed beside the figures:
on a shared machine they are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3.census import census_of  # noqa: E402
from k3.stream.cgroup import MemoryCgroup, drop_page_cache  # noqa: E402
from k3.stream.commands import parse_size  # noqa: E402

CHILD = """
import json, os, sys, time
mode, ckpt, cgroup, files, limit, tokens = sys.argv[1:]
if cgroup:
    with open(os.path.join(cgroup, json.loads(files)["procs"]), "w") as f:
        f.write(str(os.getpid()))
    with open(os.path.join(cgroup, json.loads(files)["limit"]), "w") as f:
        f.write(limit)
import torch
from k3.stream.memory import return_freed_memory
ids = torch.randint(1, 1000, (int(tokens),), generator=torch.Generator().manual_seed(0)).tolist()
start = time.perf_counter()
if mode == "stream":
    return_freed_memory()
    from k3.stream.api import stream_logits
    result = {"summary": stream_logits(ckpt, [ids]).summary}
else:
    from k3.model import K3ForCausalLM
    with torch.no_grad():
        K3ForCausalLM.from_pretrained(ckpt)(torch.tensor([ids]), logits_to_keep=1)
    result = {}
result["seconds"] = time.perf_counter() - start
if cgroup:
    result["cgroup_peak"] = int(open(os.path.join(cgroup, json.loads(files)["peak"])).read())
print(json.dumps(result))
"""


def sequential_read(ckpt: Path) -> dict:
    drop_page_cache(ckpt)
    start, n = time.perf_counter(), 0
    for file in sorted(ckpt.glob("*.safetensors")):
        with open(file, "rb", buffering=0) as f:
            while chunk := f.read(16 * 2**20):
                n += len(chunk)
    seconds = time.perf_counter() - start
    return {"bytes": n, "seconds": seconds, "GBps": n / seconds / 1e9}


def child(mode: str, ckpt: Path, tokens: int, limit: int) -> dict:
    drop_page_cache(ckpt)
    cgroup = MemoryCgroup.create()
    try:
        args = [sys.executable, "-c", CHILD, mode, str(ckpt)]
        args += [str(cgroup.path), json.dumps(cgroup.files)] if cgroup else ["", "{}"]
        args += [str(limit), str(tokens)]
        done = subprocess.run(
            args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True
        )
        if done.returncode != 0:
            return {"failed": done.returncode, "oom_kills": cgroup.oom_kills() if cgroup else None}
        return json.loads(done.stdout.splitlines()[-1])
    finally:
        if cgroup:
            cgroup.remove()


def extrapolate(stream_runs: dict[int, dict], slice_layers: int, published_dims: bool) -> dict:
    """Full K3 per batch: bytes from the published layout (uniform routing for the experts touched),
    time = bytes / bandwidth and, separately, the compute measured per layer times 93: only when the
    checkpoint has the published dimensions (`k3-slice`), else None."""
    k3 = census_of("k3").to_json()
    E, k, moe_layers = k3["experts_per_layer"], k3["experts_per_token"], k3["moe_layers"]
    expert_bytes = k3["disk_bytes_by_format"]["MXFP4"] / k3["routed_experts"]  # every routed expert is MXFP4
    dense = k3["disk_bytes"] - k3["routed_experts"] * expert_bytes
    out = {}
    for tokens, run in stream_runs.items():
        touched = E * (1 - (1 - k / E) ** tokens)
        total = dense + moe_layers * touched * expert_bytes
        compute = (
            run["summary"]["seconds_compute"] * k3["layers"] / slice_layers
            if "summary" in run and published_dims
            else None
        )
        out[tokens] = {
            "bytes": total,
            "experts_per_layer": touched,
            "seconds_io_nvme_3GBps": total / 3e9,
            "seconds_io_1Gbit": total / 0.125e9,
            "seconds_compute_estimate": compute,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", type=Path)
    parser.add_argument("--tokens", default="1,16,256")
    parser.add_argument("--limit", default="2GB")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "stream.json")
    args = parser.parse_args()
    limit, tokens = parse_size(args.limit), [int(t) for t in args.tokens.split(",")]
    from k3.config import K3Config

    cfg = K3Config.from_pretrained(args.ckpt)
    published_dims = cfg.hidden_size == K3Config.preset("k3").hidden_size
    report: dict = {"uptime": os.popen("uptime").read().strip(), "limit": limit, "ckpt": str(args.ckpt)}
    report["sequential_read"] = sequential_read(args.ckpt)
    print("sequential read", report["sequential_read"], flush=True)
    report["stream"], report["ordinary"] = {}, {}
    for n in tokens:
        run = child("stream", args.ckpt, n, limit)
        if "summary" in run:
            s = run["summary"]
            run["GBps"] = s["bytes_read"] / run["seconds"] / 1e9
            run["vs_sequential"] = run["GBps"] / report["sequential_read"]["GBps"]
        report["stream"][n] = run
        print(f"stream {n} tokens", {k: v for k, v in run.items() if k != "summary"}, flush=True)
        report["ordinary"][n] = child("ordinary", args.ckpt, n, limit)
        print(f"ordinary {n} tokens", report["ordinary"][n], flush=True)
    report["k3_extrapolated"] = extrapolate(report["stream"], cfg.num_hidden_layers, published_dims)
    report["uptime_after"] = os.popen("uptime").read().strip()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(json.dumps(report["k3_extrapolated"], indent=2))


if __name__ == "__main__":
    main()
