"""Sandbox speed on this machine, both backends, beside the figures AgentEnv and E2B publish.

    .venv/bin/python benchmarks/sandbox.py [--n 5] [--cycles 10] [--backends bwrap,gvisor] [--out FILE]

Create-run-kill cycles per second with 1 and 2 workers; p50 / p95 of create, `python3 -c pass`, snapshot,
restore and fork (per child, forks of 4); snapshot sizes. Needs root, runsc and bwrap (make sandbox-tools).
The published figures come from other hardware (AgentEnv: microVMs on large servers; E2B: Firecracker in
their cloud): they are context, not a like-for-like comparison. Timings on a shared machine are noisy; the
load average is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

from k3.sandbox.bench import cycles_per_second, latencies

PUBLISHED = [  # (what, AgentEnv, E2B) as each project states it
    ("boot / resume", "< 50 ms", "resume ~1 s"),
    ("snapshot", "< 100 ms", "pause ~4 s per GiB of RAM"),
    ("forks", "16 per node", "-"),
]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=5, help="repetitions per latency")
    ap.add_argument("--cycles", type=int, default=10, help="create-run-kill cycles per throughput figure")
    ap.add_argument("--backends", default="bwrap,gvisor")
    ap.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="k3-sandbox-bench-"))
    root.chmod(0o755)
    load_before = os.getloadavg()
    print(f"CPU: {cpu_model()} x {os.cpu_count()}; load average {load_before[0]:.1f} {load_before[1]:.1f}")
    results = {"cpu": cpu_model(), "cores": os.cpu_count(), "load_before": load_before, "backends": {}}
    for b in args.backends.split(","):
        lat = latencies(b, args.n, root)
        rates = {w: cycles_per_second(b, w, args.cycles, root) for w in (1, 2)}
        results["backends"][b] = {"latency_s": lat, "create_run_kill_per_s": rates}
        print(f"\n== {b}")
        print(f"  {'operation':18s} {'p50 ms':>9s} {'p95 ms':>9s}")
        for op, v in lat.items():
            if isinstance(v, dict):
                print(f"  {op:18s} {v['p50'] * 1000:9.1f} {v['p95'] * 1000:9.1f}")
        print(f"  snapshot size      {lat['snapshot_bytes'] / 1e6:.2f} MB ({lat['snapshot_kind']})")
        print(f"  create-run-kill    {rates[1]:.2f}/s (1 worker)  {rates[2]:.2f}/s (2 workers)")
    results["load_after"] = os.getloadavg()
    print(f"\nload average after: {results['load_after'][0]:.1f}")
    print("\nPublished elsewhere (other hardware; context only):")
    print(f"  {'':16s} {'AgentEnv':16s} E2B")
    for what, agentenv, e2b in PUBLISHED:
        print(f"  {what:16s} {agentenv:16s} {e2b}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
