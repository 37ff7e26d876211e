"""Atlas benchmark: scan throughput against a plain sequential read, peak RSS, and remote census bytes.

    .venv/bin/python benchmarks/atlas.py [--dir checkpoints/mini] [--preset mini] [--workers 2]

1. Sequential read: every shard file read start to end in 16 MiB chunks (after one warm-up pass, so both
   this and the scan read from the page cache: the comparison is of the scan's computation, not the disk).
2. Scan: `k3.atlas.scan` statistics pass (no similarity) in a fresh process, timed, with that process's
   peak RSS (ru_maxrss); then the similarity pass alone.
3. Remote: the checkpoint behind a local HTTP server with Range support; `Atlas.open(url)` + summary +
   layer map (the census-only view: headers only) and the bytes it fetched, against the checkpoint's size.

Timings are noisy when other jobs share the CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

CHUNK = 16 * 2**20


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


_SCAN = """
import json, resource, sys, time
from k3.atlas.scan import scan
t = time.perf_counter()
scan(sys.argv[1], sys.argv[2], workers=int(sys.argv[3]), similarity=sys.argv[4] == "1")
print(json.dumps({"seconds": time.perf_counter() - t,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def timed_scan(source: Path, db: Path, workers: int, similarity: bool) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _SCAN, str(source), str(db), str(workers), "1" if similarity else "0"],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


class _CountingRangeHandler(SimpleHTTPRequestHandler):
    """Static files with `Range: bytes=a-b`; counts the body bytes it sends."""

    sent = 0
    lock = threading.Lock()

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        size = path.stat().st_size
        start, stop = 0, size - 1
        rng = self.headers.get("Range")
        if rng:
            a, b = rng.removeprefix("bytes=").split("-")
            start, stop = int(a), min(size - 1, int(b) if b else size - 1)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{stop}/{size}")
        else:
            self.send_response(200)
        with open(path, "rb") as f:
            f.seek(start)
            body = f.read(stop - start + 1)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self.wfile.write(body)
        with _CountingRangeHandler.lock:
            _CountingRangeHandler.sent += len(body)


def remote_census(directory: Path) -> dict:
    from k3.atlas.view import Atlas

    server = ThreadingHTTPServer(
        ("127.0.0.1", 0), lambda *a, **k: _CountingRangeHandler(*a, directory=str(directory), **k)
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        _CountingRangeHandler.sent = 0
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            atlas = Atlas.open(url, tmp)
            summary, layers = atlas.summary(), atlas.layers()
            seconds = time.perf_counter() - t
        return {
            "seconds": seconds,
            "bytes_fetched": _CountingRangeHandler.sent,
            "layers": len(layers["layers"]),
            "total_params": summary["census"]["total_params"] if summary["census"] else summary["params"],
        }
    finally:
        server.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dir", type=Path, default=None, help="checkpoint (default: a fresh one of --preset)"
    )
    parser.add_argument("--preset", default="mini")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        directory = args.dir
        if directory is None:
            from k3.config import K3Config
            from k3.model.init import init_checkpoint

            directory = Path(tmp) / args.preset
            print(f"writing a random {args.preset} checkpoint ...", flush=True)
            init_checkpoint(K3Config.preset(args.preset), directory, seed=0)
        files = sorted(directory.glob("*.safetensors"))
        total = sum(f.stat().st_size for f in files)
        sequential_read(files)  # warm the page cache
        seq = min(sequential_read(files) for _ in range(3))
        stats = timed_scan(directory, Path(tmp) / "db" / "atlas.sqlite", args.workers, similarity=False)
        sim = timed_scan(directory, Path(tmp) / "db" / "atlas.sqlite", args.workers, similarity=True)
        remote = remote_census(directory)

    mb = total / 1e6
    scan_mbs = mb / stats["seconds"]
    seq_mbs = mb / seq
    origin = f"random {args.preset}" if args.dir is None else "given"
    print(f"checkpoint: {directory} ({origin}), {mb:,.1f} MB in {len(files)} file(s)")
    print(f"sequential read (page cache): {seq:.3f} s = {seq_mbs:,.0f} MB/s")
    print(
        f"scan, statistics ({args.workers} workers): {stats['seconds']:.2f} s = {scan_mbs:,.1f} MB/s "
        f"= {scan_mbs / seq_mbs:.1%} of the sequential read; peak RSS {stats['peak_rss_mb']:,.0f} MB"
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
