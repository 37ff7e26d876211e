"""Helpers for the checkpoint tests: random tensors, hand-made safetensors files, a Range-capable server.

The hand-made files are written here byte by byte from the format spec, independently of k3's writer, so
tests can plant exactly the corruption they check for.
"""

from __future__ import annotations

import json
import re
import struct
import threading
from collections import defaultdict
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from k3.config import K3Config
from k3.layout import published_tensors

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
    """Random tensors in the published layout of `cfg` (MXFP4 tensors as random uint8)."""
    gen = torch.Generator().manual_seed(seed)
    for spec in published_tensors(cfg):
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


# ---- a Range-capable HTTP server ----------------------------------------------------------------------
_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


class RangeServer(ThreadingHTTPServer):
    """Serves `root` on 127.0.0.1 (ephemeral port) with single `Range: bytes=a-b` requests answered 206.

    `faults[path]` is a queue of faults for the next requests of that path: "500" (answer 500), "drop"
    (close the connection without answering), "truncate" (announce the length, send half, close),
    "bad-range" (a Content-Range for other bytes), "ignore-range" (answer 200 with the whole file).
    `bytes_served` and `requests` count what went out, independently of the client's own counters.
    """

    daemon_threads = True

    def __init__(self, root: Path):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = Path(root)
        self.faults: dict[str, list[str]] = defaultdict(list)
        self.bytes_served = 0
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.serve_forever, args=(0.02,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> RangeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()
        self.thread.join()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Stay quiet about clients hanging up (they do, on purpose, in the fault tests); report the rest."""
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def reset_counters(self) -> None:
        with self.lock:
            self.bytes_served = 0
            self.requests.clear()


class _Handler(BaseHTTPRequestHandler):
    server: RangeServer
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK stall

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(k, v)
        self.end_headers()
        with self.server.lock:  # counted before sending, so a client that has the bytes sees the count
            self.server.bytes_served += len(body)
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        range_header = self.headers.get("Range")
        with self.server.lock:
            self.server.requests.append((path, range_header))
            fault = self.server.faults[path].pop(0) if self.server.faults[path] else None
        file = (self.server.root / path.lstrip("/")).resolve()
        if fault == "drop":
            self.close_connection = True
            return
        if fault == "500":
            self._send(500, b"boom", {})
            return
        if not file.is_file() or self.server.root.resolve() not in file.parents:
            self._send(404, b"not found", {})
            return
        size = file.stat().st_size
        m = _RANGE.fullmatch(range_header or "")
        if m is None or fault == "ignore-range":
            self._send(200, file.read_bytes(), {})
            return
        first = int(m.group(1))
        last = min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
        if first >= size:
            self._send(416, b"", {"Content-Range": f"bytes */{size}"})
            return
        with open(file, "rb") as f:
            f.seek(first)
            body = f.read(last + 1 - first)
        if fault == "bad-range":
            first, last = first + 1, last + 1
        if fault == "truncate":
            self.send_response(206)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.close_connection = True
            return
        self._send(206, body, {"Content-Range": f"bytes {first}-{last}/{size}"})
