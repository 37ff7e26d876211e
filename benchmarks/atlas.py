"""Atlas benchmark: scan throughput against a plain sequential read, peak RSS, and remote census bytes.

    .venv/bin/python benchmarks/atlas.py [--dir CKPT | --preset mini | --synthetic] [--workers 2] [--cold]

1. Sequential read: every shard file read start to end in 16 MiB chunks into one reused buffer.
2. Scan: the `k3.atlas.scan` statistics pass (no similarity) in a fresh process, timed from the call (the
   imports come first, untimed), with that process's peak RSS (ru_maxrss) and CPU seconds; then the
   similarity pass alone (resumed on the same database).
   Both 1 and 2 are measured the same way: warm (page cache: after a warm-up read; the comparison is of the
   scan's computation against memory bandwidth) and, with --cold, cold (each shard's pages dropped from the
   page cache with posix_fadvise(DONTNEED) right before; on a VM whose host caches the disk, "cold" may
   still be served from the host's memory).
3. Remote: the checkpoint behind a local HTTP server with Range support; `Atlas.open(url)` + summary +
   layer map (the census-only view: headers only) and the bytes it fetched, against the checkpoint's size.

`--synthetic` writes a ~1.9 GB checkpoint (3 x 512 MiB BF16 matrices + 16 MXFP4 experts 4096 x 7168) in
the temporary directory, the large-tensor case that `mini` (1,500 small matrices) does not show.
Timings are noisy when other jobs share the CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHUNK = 16 * 2**20


def drop_from_page_cache(files: list[Path]) -> None:
    """Ask the kernel to forget the files' cached pages (clean pages go; no privileges needed)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # dirty pages (a checkpoint just written) are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_read(files: list[Path]) -> float:
    """Seconds to read every file once, in order, into one reused buffer."""
    buf = bytearray(CHUNK)
    start = time.perf_counter()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.readv(fd, [buf]):
                pass
        finally:
            os.close(fd)
    return time.perf_counter() - start


# Peak RSS from /proc/self/status VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss over exec, so a
# child started by this (large) benchmark process would report the parent's peak.
_SCAN = """
import json, re, sys, time
import k3.checkpoint, k3.ops.mxfp4.codec  # imports untimed: the scan is timed, not Python's start-up
from k3.atlas.scan import scan
t, cpu = time.perf_counter(), time.process_time()
scan(sys.argv[1], sys.argv[2], workers=int(sys.argv[3]), similarity=sys.argv[4] == "1")
seconds, cpu_seconds = time.perf_counter() - t, time.process_time() - cpu
hwm_kb = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
print(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds, "peak_rss_mb": hwm_kb / 1024}))
"""


def timed_scan(source: Path, db: Path, workers: int, similarity: bool) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _SCAN, str(source), str(db), str(workers), "1" if similarity else "0"],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_synthetic(directory: Path) -> None:
    """3 x 512 MiB BF16 matrices and 16 MXFP4 experts of 4096 x 7168 (random codes, scales 2^-9..2^-1)."""
    import torch

    from k3.checkpoint import save_checkpoint

    gen = torch.Generator().manual_seed(0)

    def tensors():
        for layer in range(3):
            w = torch.empty(16384, 16384, dtype=torch.bfloat16)  # 512 MiB
            for r0 in range(0, 16384, 1024):
                w[r0 : r0 + 1024] = torch.randn(1024, 16384, generator=gen) * 0.02
            yield f"model.layers.{layer}.mlp.down_proj.weight", w
        for e in range(16):
            prefix = f"model.layers.3.block_sparse_moe.experts.{e}.w1"
            yield (
                f"{prefix}.weight_packed",
                torch.randint(0, 256, (4096, 3584), dtype=torch.uint8, generator=gen),
            )
            yield (
                f"{prefix}.weight_scale",
                torch.randint(118, 127, (4096, 224), dtype=torch.uint8, generator=gen),
            )

    save_checkpoint(tensors(), None, directory, max_shard_size=600 * 2**20)


def measure(files: list[Path], directory: Path, db_dir: Path, workers: int, cold: bool) -> dict:
    """Sequential read and statistics scan, both warm or both cold."""
    if cold:
        reads = []
        for _ in range(2):
            drop_from_page_cache(files)
            reads.append(sequential_read(files))
        drop_from_page_cache(files)
    else:
        sequential_read(files)  # warm the page cache
        reads = [sequential_read(files) for _ in range(3)]
    stats = timed_scan(directory, db_dir / "atlas.sqlite", workers, similarity=False)
    return {"read_seconds": min(reads), "scan": stats}


def remote_census(directory: Path) -> dict:
    from k3.atlas.view import Atlas
    from k3.checkpoint.serve import RangeServer

    with RangeServer(directory) as server, tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        atlas = Atlas.open(server.url, tmp)
        summary, layers = atlas.summary(), atlas.layers()
        seconds = time.perf_counter() - t
        return {
            "seconds": seconds,
            "bytes_fetched": server.bytes_served,
            "layers": len(layers["layers"]),
            "total_params": summary["census"]["total_params"] if summary["census"] else summary["params"],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dir", type=Path, default=None, help="checkpoint (default: a fresh one of --preset)"
    )
    parser.add_argument("--preset", default="mini")
    parser.add_argument("--synthetic", action="store_true", help="a ~1.9 GB checkpoint of large tensors")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cold", action="store_true", help="also measure read and scan from a cold cache")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        directory = args.dir
        if directory is None and args.synthetic:
            directory = Path(tmp) / "synthetic"
            print("writing a synthetic checkpoint ...", flush=True)
            write_synthetic(directory)
        elif directory is None:
            from k3.config import K3Config
            from k3.model.init import init_checkpoint

            directory = Path(tmp) / args.preset
            print(f"writing a random {args.preset} checkpoint ...", flush=True)
            init_checkpoint(K3Config.preset(args.preset), directory, seed=0)
        files = sorted(directory.glob("*.safetensors"))
        total = sum(f.stat().st_size for f in files)
        runs = {"warm (page cache)": measure(files, directory, Path(tmp) / "warm", args.workers, cold=False)}
        if args.cold:
            runs["cold (pages dropped)"] = measure(
                files, directory, Path(tmp) / "cold", args.workers, cold=True
            )
        sim = timed_scan(directory, Path(tmp) / "warm" / "atlas.sqlite", args.workers, similarity=True)
        remote = remote_census(directory)

    mb = total / 1e6
    origin = "synthetic" if args.synthetic else f"random {args.preset}" if args.dir is None else "given"
    print(f"checkpoint: {directory} ({origin}), {mb:,.1f} MB in {len(files)} file(s); {os.cpu_count()} CPUs")
    for label, run in runs.items():
        seq_mbs = mb / run["read_seconds"]
        stats = run["scan"]
        scan_mbs = mb / stats["seconds"]
        print(f"{label}: sequential read {run['read_seconds']:.3f} s = {seq_mbs:,.0f} MB/s")
        print(
            f"{label}: scan, statistics ({args.workers} workers): {stats['seconds']:.2f} s = {scan_mbs:,.1f} "
            f"MB/s = {scan_mbs / seq_mbs:.1%} of the sequential read; {stats['cpu_seconds']:.2f} CPU s; "
            f"peak RSS {stats['peak_rss_mb']:,.0f} MB"
        )
    print(
        f"scan, expert similarity pass (resumed after the statistics): {sim['seconds']:.2f} s; "
        f"peak RSS {sim['peak_rss_mb']:,.0f} MB"
    )
    print(
        f"remote census-only view (Range server): {remote['bytes_fetched']:,} bytes fetched of {total:,} "
        f"({remote['bytes_fetched'] / total:.4%}) in {remote['seconds']:.2f} s; {remote['layers']} layers, "
        f"{remote['total_params']:,} parameters"
    )


if __name__ == "__main__":
    main()
