"""Sandbox speed on this machine, both backends, beside the figures AgentEnv and E2B publish.

    .venv/bin/python benchmarks/sandbox.py [--n 5] [--cycles 10] [--backends bwrap,gvisor] [--out FILE]

Create-run-kill cycles per second with 1 and 2 workers; p50 / p95 of create, `python3 -c pass`, snapshot,
restore and fork (per child, forks of 4); snapshot sizes. Then the protocol's cost: create / run
`python3 -c pass` / kill through the official `e2b` SDK and through k3's own client (`RemoteSandbox`),
against one `k3 sandbox serve --e2b` started in this process, in the same run. Needs root, runsc and bwrap
(make sandbox-tools).
The published figures come from other hardware (AgentEnv: microVMs on large servers; E2B: Firecracker in
their cloud): they are context, not a like-for-like comparison. Timings on a shared machine are noisy; the
load average is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import uvicorn

from k3.sandbox.bench import _pct, cycles_per_second, latencies
from k3.sandbox.client import RemoteSandbox
from k3.sandbox.e2b import create_e2b_app

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


def serve_e2b(root: Path) -> tuple[str, str, uvicorn.Server]:
    """`k3 sandbox serve --e2b` in a thread of this process: (url, API key, server)."""
    key = secrets.token_urlsafe(16)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_e2b_app({key: "bench"}, root=root, quota=4)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return f"http://127.0.0.1:{port}", key, server


def protocol_latencies(backend: str, n: int, url: str, key: str) -> dict:
    """p50 / p95 seconds of create, run `python3 -c pass` and kill through the e2b SDK and k3's client."""
    from e2b import Sandbox as E2BSandbox

    opts = {"api_key": key, "api_url": url, "sandbox_url": url, "http_version": "1.1"}
    times: dict[str, list[float]] = {
        f"{c} {op}": [] for c in ("e2b", "k3") for op in ("create", "run", "kill")
    }
    for i in range(n + 1):  # the first round warms both clients up and is not counted
        for client in ("e2b", "k3"):
            t0 = time.perf_counter()
            if client == "e2b":
                sbx = E2BSandbox.create(template=f"base@{backend}", timeout=60, **opts)
            else:
                sbx = RemoteSandbox.create(f"{url}/k3", key, backend=backend, timeout=60)
            t1 = time.perf_counter()
            sbx.commands.run("python3 -c pass", timeout=30)
            t2 = time.perf_counter()
            sbx.kill()
            t3 = time.perf_counter()
            if i:
                for op, dt in (("create", t1 - t0), ("run", t2 - t1), ("kill", t3 - t2)):
                    times[f"{client} {op}"].append(dt)
    return {k: {"p50": statistics.median(v), "p95": _pct(v, 0.95)} for k, v in times.items()}


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
    url, key, server = serve_e2b(root)
    try:
        for b in args.backends.split(","):
            proto = protocol_latencies(b, args.n, url, key)
            results["backends"][b]["protocol_latency_s"] = proto
            print(f"\n== {b}: e2b SDK vs k3 client, one server (the SDK runs `bash -l -c`, k3 `sh -c`)")
            for op, v in proto.items():
                print(f"  {op:18s} {v['p50'] * 1000:9.1f} {v['p95'] * 1000:9.1f}")
    finally:
        server.should_exit = True
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
