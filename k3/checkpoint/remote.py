"""Reading checkpoint files over HTTP with Range requests.

`HttpSource` is the remote `ByteSource`. Opening one fetches the first `first_read` bytes (64 kB), which
holds the 8-byte header length and, for all but huge shards, the whole header: so opening a remote
checkpoint costs one request per shard, and a second only when a header is longer. Larger reads are split
on a grid of `block_size` blocks fetched by a small thread pool; with `cache_dir` the blocks (and the
ranges `read_owned` fetches whole, e.g. the stages of `k3 stream`) are kept on disk, content-addressed by
URL, file size, offset and length, written atomically, at most `cache_max_bytes` of them.

Every response is checked against the request: status 206, a `Content-Range` for exactly the bytes asked
(clamped at the end of the file, as RFC 9110 allows) and a body of that length. 5xx, 429, dropped
connections and timeouts are retried with exponential backoff a bounded number of times; everything else
is a `CheckpointError` naming the URL.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx

from k3.checkpoint.source import CheckpointError, check_range

T = TypeVar("T")


class RemoteNotFound(CheckpointError):
    """The server answered 404."""

    def __init__(self, url: str):
        super().__init__(f"{url}: not found (HTTP 404)")
        self.url = url


@dataclass(frozen=True)
class RemoteOptions:
    block_size: int = 8 * 2**20  # bytes per ranged request (and per cached block) for large reads
    parallel: int = 4  # concurrent requests for a large read
    retries: int = 4  # extra attempts after a 5xx, 429, dropped connection or timeout
    backoff: float = 0.25  # seconds before the first retry; doubled each time
    timeout: float = 30.0  # seconds per network operation (connect, read)
    first_read: int = 65536  # bytes fetched when a shard is opened: the header length and, usually, header
    cache_dir: Path | None = None  # keep fetched blocks here (shared between runs)
    cache_max_bytes: int | None = None  # at most this much in cache_dir (least recently used deleted first)
    max_json_bytes: int = 100_000_000  # largest config.json / index accepted


@dataclass
class FetchStats:
    """What the network cost: counted by every request of one checkpoint (thread-safe)."""

    requests: int = 0  # HTTP requests sent, retries included
    bytes_fetched: int = 0  # body bytes received
    retries: int = 0
    cache_hits: int = 0  # blocks served from cache_dir
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, requests: int = 0, bytes_fetched: int = 0, retries: int = 0, cache_hits: int = 0) -> None:
        with self._lock:
            self.requests += requests
            self.bytes_fetched += bytes_fetched
            self.retries += retries
            self.cache_hits += cache_hits


class _Retryable(Exception):
    """A transient failure: worth another attempt."""


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")
_UNSATISFIABLE = re.compile(r"bytes \*/(\d+)")


class HttpClient:
    """One httpx client (thread-safe, connection-pooled) plus the retry policy and byte counters."""

    def __init__(self, options: RemoteOptions):
        self.options = options
        self.stats = FetchStats()
        self.cache = BlockCache(options.cache_dir, options.cache_max_bytes) if options.cache_dir else None
        limits = httpx.Limits(max_connections=max(options.parallel, 1) + 2)
        self._client = httpx.Client(timeout=options.timeout, follow_redirects=True, limits=limits)

    def close(self) -> None:
        self._client.close()

    transport_errors: tuple[type[Exception], ...] = (httpx.TransportError,)  # the client's: refused, dropped

    def _with_retries(self, url: str, attempt: Callable[[], T]) -> T:
        for n in range(self.options.retries + 1):
            try:
                return attempt()
            except (_Retryable, *self.transport_errors) as e:  # refused, dropped, timed out: retried
                problem = f"{type(e).__name__}: {e}" if isinstance(e, self.transport_errors) else str(e)
            if n < self.options.retries:
                self.stats.count(retries=1)
                time.sleep(self.options.backoff * 2**n)
        raise CheckpointError(f"{url}: giving up after {self.options.retries + 1} attempts ({problem})")

    def _read_body(self, response: httpx.Response, limit: int, url: str, exact: bool = False) -> bytearray:
        """The body, refusing more than `limit` bytes (a server may send more than it announced). `exact`:
        `limit` bytes are expected, so they are written into one buffer of that size (no regrowth)."""
        too_long = f"{url}: response body exceeds the {limit} bytes expected"
        if not exact:
            body = bytearray()
            for chunk in response.iter_raw():
                self.stats.count(bytes_fetched=len(chunk))
                body += chunk
                if len(body) > limit:
                    raise CheckpointError(too_long)
            return body
        body, n = bytearray(limit), 0
        with memoryview(body) as view:
            for chunk in response.iter_raw():
                self.stats.count(bytes_fetched=len(chunk))
                if n + len(chunk) > limit:
                    raise CheckpointError(too_long)
                view[n : n + len(chunk)] = chunk
                n += len(chunk)
        del body[n:]  # a short body: the caller retries
        return body

    def _headers(self, **extra: str) -> dict[str, str]:
        """Every request's headers: bytes as stored (no compression), plus `extra`."""
        return {"Accept-Encoding": "identity", **extra}

    def _check_status(self, response: httpx.Response, url: str, expected: int) -> None:
        status = response.status_code
        if status == expected:
            return
        if status == 404:
            raise RemoteNotFound(url)
        if status >= 500 or status == 429:
            raise _Retryable(f"HTTP {status}")
        if status == 200 and expected == 206:
            raise CheckpointError(f"{url}: the server ignored the Range request (HTTP 200, expected 206)")
        raise CheckpointError(f"{url}: HTTP {status}")

    def get(self, url: str) -> bytes | bytearray | None:
        """A whole small file (config.json, an index); None when the server says 404."""

        def attempt() -> bytearray:
            self.stats.count(requests=1)
            with self._client.stream("GET", url, headers=self._headers(), timeout=self.options.timeout) as r:
                self._check_status(r, url, 200)
                return self._read_body(r, self.options.max_json_bytes, url)

        try:
            return self._with_retries(url, attempt)
        except RemoteNotFound:
            return None

    def get_range(self, url: str, offset: int, length: int) -> tuple[bytes | bytearray, int]:
        """(bytes [offset, offset + length), file size). Fewer bytes only where the file ends first."""
        headers = {"Range": f"bytes={offset}-{offset + length - 1}", "Accept-Encoding": "identity"}

        def attempt() -> tuple[bytes | bytearray, int]:
            self.stats.count(requests=1)
            with self._client.stream("GET", url, headers=headers) as r:
                empty = _UNSATISFIABLE.fullmatch(r.headers.get("content-range", ""))
                if r.status_code == 416 and offset == 0 and empty:  # an empty file has no byte 0
                    return b"", int(empty.group(1))
                self._check_status(r, url, 206)
                return self._partial_content(r, url, offset, length)

        return self._with_retries(url, attempt)

    def _partial_content(
        self, r, where: str, offset: int, length: int, note: str = ""
    ) -> tuple[bytes | bytearray, int]:
        """The body of a 206 answer to bytes [offset, offset + length) and the file's size, after checking
        that Content-Range names exactly those bytes; a short body is retried. `note` ends each message."""
        m = _CONTENT_RANGE.fullmatch(r.headers.get("content-range", ""))
        if not m:
            raise CheckpointError(
                f"{where}: bad Content-Range {r.headers.get('content-range')!r} for bytes "
                f"{offset}-{offset + length - 1}{note}"
            )
        first, last, size = map(int, m.groups())
        if first != offset or last != min(offset + length, size) - 1:
            raise CheckpointError(
                f"{where}: asked for bytes {offset}-{offset + length - 1}, "
                f"got Content-Range {r.headers['content-range']!r}{note}"
            )
        body = self._read_body(r, last - first + 1, where, exact=True)
        if len(body) != last - first + 1:
            raise _Retryable(f"short body: {len(body)} of {last - first + 1} bytes{note}")
        return body, size


class BlockCache:
    """Byte ranges of remote files on disk, each in a file named by a hash of (URL, file size, offset,
    length). Written atomically (a temporary file renamed into place); with `max_bytes`, the least recently
    used are deleted once the cache holds more (use refreshes a file's mtime, so the order outlives the
    process). A range larger than the cap is not kept."""

    def __init__(self, directory: Path, max_bytes: int | None = None):
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        found = [(p.stat().st_mtime, p) for p in self.directory.glob("*/*") if not p.name.startswith(".")]
        self._sizes: OrderedDict[Path, int] = OrderedDict((p, p.stat().st_size) for _, p in sorted(found))
        self.total = sum(self._sizes.values())

    def _path(self, url: str, size: int, offset: int, length: int) -> Path:
        key = hashlib.sha256(f"{url}\n{size}\n{offset}\n{length}".encode()).hexdigest()
        return self.directory / key[:2] / key

    def get(self, url: str, size: int, offset: int, length: int) -> bytearray | None:
        path = self._path(url, size, offset, length)
        data = bytearray(length)
        try:
            with open(path, "rb", buffering=0) as f:
                n = f.readinto(data)
                if n != length or f.read(1):
                    return None  # a damaged entry is fetched again
            os.utime(path)
        except FileNotFoundError:
            return None
        with self._lock:
            if path in self._sizes:
                self._sizes.move_to_end(path)
        return data

    def put(self, url: str, size: int, offset: int, data: bytes | bytearray) -> None:
        if self.max_bytes is not None and len(data) > self.max_bytes:
            return
        path = self._path(url, size, offset, len(data))
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # atomic: readers see the old state or the whole range
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        with self._lock:
            self.total += len(data) - self._sizes.pop(path, 0)
            self._sizes[path] = len(data)
            while self.max_bytes is not None and self.total > self.max_bytes:
                old, n = self._sizes.popitem(last=False)
                old.unlink(missing_ok=True)
                self.total -= n


class HttpSource:
    """One remote file as a `ByteSource`. Construction fetches the first `first_read` bytes."""

    def __init__(self, url: str, http: HttpClient):
        self.name = url
        self.url = url
        self._http = http
        self._options = http.options
        self._cache = http.cache
        self._prefix, self.size = http.get_range(url, 0, self._options.first_read)

    @property
    def prefix(self) -> bytes | bytearray:
        """The first bytes of the file, fetched when it was opened."""
        return self._prefix

    def read(self, offset: int, length: int) -> bytearray:
        check_range(self, offset, length)
        if offset + length <= len(self._prefix):
            return bytearray(self._prefix[offset : offset + length])
        out = bytearray(length)
        if length == 0:
            return out
        B = self._options.block_size
        blocks = range(offset // B, (offset + length - 1) // B + 1)

        def fill(index: int) -> None:
            a, b = max(offset, index * B), min(offset + length, (index + 1) * B)  # the part of [a, b) we need
            if self._cache is None:
                out[a - offset : b - offset] = self._fetch(a, b - a)
            else:
                block = self._cached_block(index)
                out[a - offset : b - offset] = block[a - index * B : b - index * B]

        if len(blocks) == 1:
            fill(blocks[0])
        else:
            with ThreadPoolExecutor(min(self._options.parallel, len(blocks))) as pool:
                list(pool.map(fill, blocks))  # list() re-raises the first failure
        return out

    def read_owned(self, offset: int, length: int) -> bytearray:
        """The bytes in one ranged request (retried as usual), whatever their length; with `cache_dir`,
        from the cache when this very range was fetched before (and kept there after a fetch)."""
        check_range(self, offset, length)
        if not length:
            return bytearray()
        if self._cache is not None:
            cached = self._cache.get(self.url, self.size, offset, length)
            if cached is not None:
                self._http.stats.count(cache_hits=1)
                return cached
        body = self._fetch(offset, length)
        body = body if isinstance(body, bytearray) else bytearray(body)
        if self._cache is not None:
            self._cache.put(self.url, self.size, offset, body)
        return body

    def _fetch(self, offset: int, length: int) -> bytes | bytearray:
        body, size = self._http.get_range(self.url, offset, length)
        if size != self.size:
            raise CheckpointError(f"{self.url}: file size changed from {self.size} to {size} while reading")
        return body

    def _cached_block(self, index: int) -> bytes | bytearray:
        assert self._cache is not None
        B = self._options.block_size
        length = min(B, self.size - index * B)
        block = self._cache.get(self.url, self.size, index * B, length)
        if block is not None:
            self._http.stats.count(cache_hits=1)
            return block
        block = self._fetch(index * B, length)
        self._cache.put(self.url, self.size, index * B, block)
        return block

    def close(self) -> None:
        """The HTTP client belongs to the checkpoint, which closes it."""
