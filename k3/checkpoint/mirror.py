"""A remote file mirrored into a sparse local file, fetched on demand: what a model loaded from a URL is
memory-mapped from.

`MirroredSource` is a `ByteSource` over an `HttpSource`. Its local file has the remote file's size and no
blocks until bytes are asked for (a sparse file, unnamed: it disappears with its last mapping).
`read(offset, length)` first fetches whatever of [offset, offset + length) is not there yet (ranged
requests of at most PIECE bytes, `parallel` at once, written with `pwrite` and flushed to disk),
then returns a view of a copy-on-write memory map of the local file. Tensors built on it live in the page
cache, not in anonymous memory: clean file pages that the kernel drops under memory pressure and reads back
from the local disk, so a model larger than RAM, or than a memory cgroup's limit, still loads and runs.

Fetches are rounded out to whole pages (clamped to the file): a page is written once, before any view of
it is handed out, so no view sees a page change under it, and a private copy made by a write to one tensor
never hides bytes of a neighbour fetched later. `fetch(ranges)` brings many ranges at once (the missing
parts merged into maximal runs, in file order); `Checkpoint.prefetch(names)` calls it per shard.
"""

from __future__ import annotations

import bisect
import mmap
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from k3.checkpoint.remote import HttpSource
from k3.checkpoint.source import check_range, release_mapping

PAGE = mmap.PAGESIZE
PIECE = 2 * 2**20  # bytes per request: at most `parallel` pieces are in anonymous memory at once


class Ranges:
    """A set of bytes as sorted, disjoint, non-touching [start, stop) intervals."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._stops: list[int] = []

    def __len__(self) -> int:
        return sum(b - a for a, b in self.intervals())

    def intervals(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._stops, strict=True))

    def missing(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The parts of [start, stop) not in the set, in order."""
        out, pos = [], start
        i = bisect.bisect_right(self._stops, start)  # the first interval ending after `start`
        while i < len(self._starts) and self._starts[i] < stop:
            if self._starts[i] > pos:
                out.append((pos, self._starts[i]))
            pos = max(pos, self._stops[i])
            i += 1
        if pos < stop:
            out.append((pos, stop))
        return out

    def add(self, start: int, stop: int) -> None:
        if start >= stop:
            return
        i = bisect.bisect_left(self._stops, start)  # the first interval ending at or after `start`
        j = bisect.bisect_right(self._starts, stop)  # the first interval starting after `stop`
        if i < j:
            start, stop = min(start, self._starts[i]), max(stop, self._stops[j - 1])
        self._starts[i:j], self._stops[i:j] = [start], [stop]


class MirroredSource:
    """`remote`'s bytes, fetched on first read into an unnamed sparse file in `directory`."""

    def __init__(self, remote: HttpSource, directory: Path, *, parallel: int) -> None:
        self.name, self.size = remote.name, remote.size
        self._remote, self._parallel = remote, max(parallel, 1)
        self._file = tempfile.TemporaryFile(dir=directory)
        self._fd = self._file.fileno()
        os.ftruncate(self._fd, self.size)
        self.present = Ranges()
        self._lock = threading.Lock()
        prefix = remote.prefix  # fetched when the remote file was opened: whole pages of it are kept
        kept = len(prefix) if len(prefix) == self.size else len(prefix) // PAGE * PAGE
        os.pwrite(self._fd, prefix[:kept], 0)
        self.present.add(0, kept)
        self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY) if self.size else None
        self._view = memoryview(self._map) if self._map is not None else memoryview(b"")

    def fetch(self, ranges: list[tuple[int, int]]) -> int:
        """Make the bytes of `ranges` ([start, stop) pairs) local; returns the bytes fetched."""
        wanted = Ranges()
        for start, stop in ranges:
            wanted.add(start // PAGE * PAGE, min(-(-stop // PAGE) * PAGE, self.size))
        with self._lock:
            runs = [part for a, b in wanted.intervals() for part in self.present.missing(a, b)]
            pieces = [(p, min(p + PIECE, b)) for a, b in runs for p in range(a, b, PIECE)]
            if not pieces:
                return 0
            with ThreadPoolExecutor(min(self._parallel, len(pieces))) as pool:
                list(pool.map(self._fetch_piece, pieces))  # list() re-raises the first failure
            os.fdatasync(self._fd)  # clean pages: the kernel may drop them without writing anything
            for a, b in runs:
                self.present.add(a, b)
        return sum(b - a for a, b in runs)

    def _fetch_piece(self, piece: tuple[int, int]) -> None:
        start, stop = piece
        data = memoryview(self._remote.read_owned(start, stop - start))
        while data:
            written = os.pwrite(self._fd, data, start)
            data, start = data[written:], start + written

    def read(self, offset: int, length: int) -> memoryview:
        check_range(self, offset, length)
        self.fetch([(offset, offset + length)])
        return self._view[offset : offset + length]

    def read_owned(self, offset: int, length: int) -> bytearray:
        """One ranged request, as the remote source does (the mirror is neither read nor filled)."""
        return self._remote.read_owned(offset, length)

    def close(self) -> None:
        """Drop the mapping (see `release_mapping`) and the file."""
        release_mapping(self._view, self._map)
        self._map = None
        self._file.close()
