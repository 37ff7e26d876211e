"""Helpers for the checkpoint tests: random tensors, hand-made safetensors files, a Range server with faults.

The hand-made files are written here byte by byte from the format spec, independently of k3's writer, so
tests can plant exactly the corruption they check for.
"""

from __future__ import annotations

import json
import struct
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from k3.checkpoint.serve import RANGE, RangeRequestHandler, RangeServer
from k3.config import K3Config
from k3.layout import checkpoint_tensors

TORCH = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}


def random_tensor(shape: tuple[int, ...], dtype: str, gen: torch.Generator) -> torch.Tensor:
    t = TORCH[dtype]
    if t.is_floating_point:
        return torch.randn(shape, generator=gen).to(t)
    if t is torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    info = torch.iinfo(t)
    return torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=gen).to(t)


def tiny_tensors(cfg: K3Config, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Random tensors in the published layout of `cfg`, vision tower included (MXFP4 tensors as random
    uint8)."""
    gen = torch.Generator().manual_seed(seed)
    for spec in checkpoint_tensors(cfg):
        yield spec.name, random_tensor(spec.shape, spec.dtype, gen)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN-safe: compares the bytes); bools by truth value, whatever their bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype is torch.bool:
        a, b = a.view(torch.uint8) != 0, b.view(torch.uint8) != 0
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def raw_safetensors(
    entries: dict[str, Any] | bytes, data: bytes, *, header_len: int | None = None, pad: bool = True
) -> bytes:
    """A safetensors file from a header (a dict, serialized here, or raw bytes) and a data section."""
    header = entries if isinstance(entries, bytes) else json.dumps(entries).encode()
    if pad:
        header += b" " * (-(8 + len(header)) % 8)
    n = len(header) if header_len is None else header_len
    return struct.pack("<Q", n) + header + data


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# ---- k3's Range server, with planted faults ---------------------------------------------------------------


class FaultyRangeServer(RangeServer):
    """`k3.checkpoint.serve.RangeServer` on 127.0.0.1 (ephemeral port) with planted faults.

    `faults[path]` is a queue of faults for the next requests of that path: "500" (answer 500), "drop"
    (close the connection without answering), "truncate" (announce the length, send half, close),
    "bad-range" (a Content-Range for other bytes), "ignore-range" (answer 200 with the whole file).
    """

    def __init__(self, root: Path):
        super().__init__(root, handler=_FaultyHandler)
        self.faults: dict[str, list[str]] = defaultdict(list)


class _FaultyHandler(RangeRequestHandler):
    server: FaultyRangeServer

    def answer(self, send_body: bool) -> None:
        path = self.path.split("?")[0]
        with self.server.lock:
            fault = self.server.faults[path].pop(0) if self.server.faults[path] else None
        file = self.server.resolve(path)
        if fault is None or file is None:
            super().answer(send_body)
            return
        range_header = self.headers.get("Range")
        self.server.count_request(path, range_header)
        if fault == "drop":
            self.close_connection = True
            return
        if fault == "500":
            self.send_bytes(500, b"boom", {})
            return
        size = file.stat().st_size
        m = RANGE.fullmatch(range_header or "")
        if m is None or fault == "ignore-range":
            self.send_bytes(200, file.read_bytes(), {})
            return
        first = int(m.group(1))
        last = min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
        body = file.read_bytes()[first : last + 1]
        if fault == "bad-range":
            self.send_bytes(206, body, {"Content-Range": f"bytes {first + 1}-{last + 1}/{size}"})
        elif fault == "truncate":
            self.send_head(206, len(body), {"Content-Range": f"bytes {first}-{last}/{size}"})
            self.wfile.write(body[: len(body) // 2])
            self.close_connection = True
        else:
            raise ValueError(f"unknown fault {fault!r}")
