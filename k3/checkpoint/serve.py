"""Serve a checkpoint folder over HTTP with byte ranges: ``python -m k3.checkpoint.serve DIR``.

What ``open_checkpoint(url)`` and ``k3 atlas`` need from a server is plain static files plus single
``Range: bytes=a-b`` requests answered ``206 Partial Content`` (Python's ``http.server`` has no ranges).
Binds 127.0.0.1 by default; only regular files inside DIR are served, never anything outside it (the
resolved path must lie under the resolved root). Bodies go out with the kernel's ``sendfile`` (no copy
through Python: whole shards need no memory and little CPU). ``RangeServer`` also counts the requests and
bytes it answered, for tests and benchmarks.

    with RangeServer("checkpoints/mini") as server:
        ckpt = open_checkpoint(server.url)
"""

from __future__ import annotations

import argparse
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote

RANGE = re.compile(r"bytes=(\d+)-(\d*)")


class RangeRequestHandler(BaseHTTPRequestHandler):
    """GET and HEAD of files under ``server.root``, with single byte ranges."""

    server: RangeServer
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK stall

    def log_message(self, format: str, *args: Any) -> None:  # quiet; the caller reports what it needs
        pass

    def do_GET(self) -> None:
        self.answer(send_body=True)

    def do_HEAD(self) -> None:
        self.answer(send_body=False)

    def answer(self, send_body: bool) -> None:
        path = self.path.split("?")[0]
        range_header = self.headers.get("Range")
        self.server.count_request(path, range_header)
        file = self.server.resolve(path)
        if file is None:
            self.send_bytes(404, b"not found\n", {}, send_body)
            return
        size = file.stat().st_size
        match = RANGE.fullmatch(range_header or "")
        if match is None:
            self.send_file(200, file, 0, size - 1, {"Accept-Ranges": "bytes"}, send_body)
            return
        first = int(match.group(1))
        last = min(int(match.group(2)) if match.group(2) else size - 1, size - 1)
        if first >= size or last < first:
            self.send_bytes(416, b"", {"Content-Range": f"bytes */{size}"}, send_body)
            return
        self.send_file(206, file, first, last, {"Content-Range": f"bytes {first}-{last}/{size}"}, send_body)

    def send_head(self, status: int, length: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for key, value in {"Content-Length": str(length), **headers}.items():
            self.send_header(key, value)
        self.end_headers()

    def send_bytes(self, status: int, body: bytes, headers: dict[str, str], send_body: bool = True) -> None:
        self.send_head(status, len(body), headers)
        if send_body:
            self.server.count_bytes(len(body))  # before sending: a client holding the bytes sees the count
            self.wfile.write(body)

    def send_file(
        self, status: int, file: Path, first: int, last: int, headers: dict[str, str], send_body: bool
    ) -> None:
        length = last + 1 - first
        self.send_head(status, length, headers)
        if not send_body:
            return
        with file.open("rb") as f:
            self.server.count_bytes(length)
            sent = self.connection.sendfile(f, first, length)  # the kernel's sendfile: no copy through Python
            if sent < length:
                raise OSError("the file ended early (changed while being served?)")


class RangeServer(ThreadingHTTPServer):
    """Serves ``root`` on ``host:port`` (port 0: any free one) from a background thread while in ``with``.

    ``bytes_served`` and ``requests`` ([(path, Range header)]) count what went out, independently of the
    client's own counters.
    """

    daemon_threads = True

    def __init__(
        self,
        root: str | Path,
        host: str = "127.0.0.1",
        port: int = 0,
        handler: type[RangeRequestHandler] = RangeRequestHandler,
    ) -> None:
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise NotADirectoryError(f"{root} is not a directory")
        super().__init__((host, port), handler)
        self.bytes_served = 0
        self.requests: list[tuple[str, str | None]] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.serve_forever, args=(0.02,), daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def resolve(self, url_path: str) -> Path | None:
        """The regular file under root that ``url_path`` names, or None (missing, a folder, or outside)."""
        file = (self.root / unquote(url_path).lstrip("/")).resolve()
        return file if file.is_file() and self.root in file.parents else None

    def count_request(self, path: str, range_header: str | None) -> None:
        with self.lock:
            self.requests.append((path, range_header))

    def count_bytes(self, n: int) -> None:
        with self.lock:
            self.bytes_served += n

    def reset_counters(self) -> None:
        with self.lock:
            self.bytes_served = 0
            self.requests.clear()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Stay quiet about clients hanging up mid-answer; report anything else."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def __enter__(self) -> RangeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()
        self.thread.join()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="the checkpoint folder (config.json, *.safetensors, index)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    try:
        server = RangeServer(args.directory, args.host, args.port)
    except (NotADirectoryError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    print(f"serving {server.root} at {server.url} (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
