"""Reading tensors in bounded pieces, for the scan and the tile renderer.

Local shards are read with `os.preadv` into fresh buffers rather than through the checkpoint's memory map:
pages of a memory map that has been read count towards the process's resident memory until it is unmapped,
so a scan over a 1.5 TB checkpoint would show a resident size of terabytes. Reading into a buffer keeps the
resident size at the size of the chunks in flight. Remote checkpoints are read with `Checkpoint.read_rows`
(HTTP ranges of just those rows).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from k3.atlas.db import LogicalTensor
from k3.atlas.stats import TORCH_DTYPES
from k3.checkpoint.reader import is_url
from k3.ops.mxfp4 import dequantize_mxfp4

# Stored bytes read at a time per worker. Locally, small: a 2 MiB chunk and its widened int32 keys stay in
# the CPU caches while they are counted (measured twice as fast as 16 MiB chunks). Remotely, large: each
# chunk is one HTTP request.
CHUNK_BYTES = 2 * 2**20
REMOTE_CHUNK_BYTES = 16 * 2**20


class TensorReader:
    """Row ranges and flat chunks of the tensors of one open checkpoint. Thread-safe."""

    def __init__(self, ckpt, source: str | Path):
        self.ckpt = ckpt
        local = Path(source) if not is_url(str(source)) else None
        self._local = local
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def chunk_bytes(self) -> int:
        """The default chunk size: `CHUNK_BYTES` locally, `REMOTE_CHUNK_BYTES` over HTTP."""
        return CHUNK_BYTES if self._local is not None else REMOTE_CHUNK_BYTES

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def _fd(self, shard: str) -> int:
        with self._lock:
            if shard not in self._fds:
                assert self._local is not None
                path = self._local if self._local.is_file() else self._local / shard
                self._fds[shard] = os.open(path, os.O_RDONLY)
            return self._fds[shard]

    def _read_bytes(self, name: str, offset: int, length: int) -> np.ndarray:
        """`length` bytes at `offset` within the stored tensor `name` (bounds are the caller's job), in a
        fresh uninitialised buffer (np.empty: no time spent zero-filling what is about to be read)."""
        info = self.ckpt.info(name)
        if self._local is not None:
            buf = np.empty(length, dtype=np.uint8)
            view, fd, done = memoryview(buf), self._fd(info.shard), 0
            while done < length:
                n = os.preadv(fd, [view[done:]], info.start + offset + done)
                if n <= 0:
                    raise OSError(f"{info.shard}: unexpected end of file reading {name}")
                done += n
            return buf
        row_bytes = info.nbytes // info.shape[0] if info.shape and info.shape[0] else info.nbytes
        if not info.shape or offset % row_bytes or length % row_bytes:
            data = self.ckpt.read(name).reshape(-1).view(torch.uint8)[offset : offset + length]
        else:
            data = self.ckpt.read_rows(name, offset // row_bytes, (offset + length) // row_bytes)
        return data.reshape(-1).view(torch.uint8).numpy().copy()

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of stored tensor `name`, as a tensor [stop-start, ...] of its dtype."""
        info = self.ckpt.info(name)
        rows = info.shape[0]
        row_bytes = info.nbytes // rows if rows else 0
        buf = self._read_bytes(name, start * row_bytes, (stop - start) * row_bytes)
        return _as_tensor(buf, info.dtype, (stop - start, *info.shape[1:]))

    def flat_chunks(self, name: str, chunk_bytes: int | None = None) -> Iterator[torch.Tensor]:
        """The elements of stored tensor `name` in order, as 1-D tensors of at most ~chunk_bytes each
        (default: `self.chunk_bytes`)."""
        chunk_bytes = chunk_bytes or self.chunk_bytes
        info = self.ckpt.info(name)
        item = TORCH_DTYPES[info.dtype].itemsize
        if self._local is None and info.shape and info.shape[0] > 0:
            # remote: whole rows, so that each read is one HTTP range of exactly those rows
            row_bytes = info.nbytes // info.shape[0]
            step = max(1, chunk_bytes // max(row_bytes, 1))
            for r0 in range(0, info.shape[0], step):
                yield self.rows(name, r0, min(r0 + step, info.shape[0])).reshape(-1)
            return
        step = max(item, chunk_bytes - chunk_bytes % item)
        for off in range(0, info.nbytes, step):
            length = min(step, info.nbytes - off)
            yield _as_tensor(self._read_bytes(name, off, length), info.dtype, (length // item,))

    def row_step(self, t: LogicalTensor, chunk_bytes: int | None = None) -> int:
        """Rows of logical tensor `t` per chunk so that one chunk's stored bytes stay near chunk_bytes
        (default: `self.chunk_bytes`)."""
        chunk_bytes = chunk_bytes or self.chunk_bytes
        rows = t.shape[0] if t.shape else 1
        return max(1, chunk_bytes // max(1, t.bytes // max(rows, 1)))

    def logical_rows(self, t: LogicalTensor, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a 2-D logical tensor as float32 [stop-start, cols] (MXFP4 dequantized)."""
        if t.dtype == "MXFP4":
            packed, scale = (self.rows(p, start, stop) for p in t.parts)
            return dequantize_mxfp4(packed, scale)
        x = self.rows(t.parts[0], start, stop)
        return x.reshape(stop - start, -1).to(torch.float32)


def _as_tensor(buf: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"the atlas cannot read tensors of dtype {dtype}")
    if buf.size == 0:
        return torch.zeros(shape, dtype=TORCH_DTYPES[dtype])
    return torch.from_numpy(buf).view(TORCH_DTYPES[dtype]).view(shape)
