"""Checkpoint I/O throughput: save_checkpoint, local open + read (mmap), remote read over a local server.

    .venv/bin/python benchmarks/checkpoint_io.py [--megabytes 256] [--shard-megabytes 64]

Writes a random BF16/U8 checkpoint of the given size to a temporary directory and times each step. The
local figures are page-cache speeds (the file was just written); remote figures go through a Python
http.server on 127.0.0.1, which is itself the bottleneck. Timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "checkpoint"))
from ckpt_testing import RangeServer  # noqa: E402  (the tests' Range-capable server)

from k3.checkpoint import RemoteOptions, open_checkpoint, save_checkpoint  # noqa: E402


def tensors(total_bytes: int, tensor_bytes: int = 8 * 2**20) -> Iterator[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    for i in range(total_bytes // tensor_bytes):
        if i % 4 == 3:  # a packed MXFP4-like U8 tensor now and then
            yield (
                f"t{i}.weight_packed",
                torch.randint(0, 256, (tensor_bytes // 1024, 1024), dtype=torch.uint8),
            )
        else:
            yield f"t{i}.weight", torch.randn(tensor_bytes // 2048, 1024, generator=gen).to(torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--megabytes", type=int, default=256)
    parser.add_argument("--shard-megabytes", type=int, default=64)
    args = parser.parse_args()
    total = args.megabytes * 2**20
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "ckpt"
        made = list(tensors(total))  # made first, so the write is timed alone
        t0 = time.perf_counter()
        save_checkpoint(iter(made), None, out, max_shard_size=args.shard_megabytes * 2**20)
        t_write = time.perf_counter() - t0
        del made

        t0 = time.perf_counter()
        with open_checkpoint(out) as ckpt:
            t_open = time.perf_counter() - t0
            t0 = time.perf_counter()
            checksum = sum(float(ckpt.read(n).float().sum()) for n in ckpt.names)  # touches every byte
            t_read = time.perf_counter() - t0
            n_shards = len(ckpt.shards)

        with RangeServer(out) as server:
            options = RemoteOptions(block_size=4 * 2**20, parallel=4)
            t0 = time.perf_counter()
            with open_checkpoint(server.url, remote=options) as remote:
                t_ropen = time.perf_counter() - t0
                open_bytes = remote.fetch_stats.bytes_fetched
                t0 = time.perf_counter()
                rchecksum = sum(float(remote.read(n).float().sum()) for n in remote.names)
                t_rread = time.perf_counter() - t0
        assert rchecksum == checksum

    mb = total / 2**20
    print(f"checkpoint: {mb:.0f} MiB in {n_shards} shards")
    print(f"save_checkpoint (with fsync): {t_write:.2f} s ({mb / t_write:.0f} MiB/s)")
    print(
        f"open (local): {t_open * 1e3:.1f} ms; "
        f"read + sum every tensor: {t_read:.2f} s ({mb / t_read:.0f} MiB/s)"
    )
    print(f"open (http): {t_ropen * 1e3:.1f} ms, {open_bytes:,} bytes fetched")
    print(
        f"read every tensor (http, 4 x 4 MiB blocks in parallel): {t_rread:.2f} s ({mb / t_rread:.0f} MiB/s)"
    )


if __name__ == "__main__":
    main()
