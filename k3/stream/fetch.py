"""Reading stages ahead of the computation, one read (or HTTP request) per span.

`CheckpointWeights` reads a stage's spans with `Checkpoint.read_span` (`preadv` locally, a single Range
request remotely) into buffers it owns and cuts the tensors out of them without copying. `MappedWeights`
(local checkpoints, the default there) uses the spans in place: the reading thread maps them and faults
their pages in, the computation reads the mapping, and `done` unmaps them; no byte is copied.
`ResidentWeights` serves the same tensors from memory: the same schedule with resident weights, which the
streamed run must match bit for bit. `Reads` runs the reads on one background thread, in the order they
are asked for, so that the next stage arrives while this one computes.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from k3.checkpoint import Checkpoint
from k3.checkpoint.reader import tensor_from_bytes
from k3.stream.plan import Stage

Tensors = dict[str, torch.Tensor]


@dataclass
class ReadStats:
    """What the reads cost (updated by the reading thread, read by the progress display)."""

    bytes_dense: int = 0
    bytes_experts: int = 0
    reads: int = 0  # spans read (HTTP requests, without retries)
    seconds_reading: float = 0.0  # time the reading thread spent in reads
    seconds_waiting: float = 0.0  # time the computation waited for a read
    experts_touched: dict[int, list[int]] = field(default_factory=dict)  # layer -> experts read, per pass
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def bytes_read(self) -> int:
        return self.bytes_dense + self.bytes_experts

    def count(self, stage: Stage, reads: int, seconds: float) -> None:
        with self._lock:
            if stage.kind == "expert":
                self.bytes_experts += stage.nbytes
            else:
                self.bytes_dense += stage.nbytes
            self.reads += reads
            self.seconds_reading += seconds


class CheckpointWeights:
    """Stages read from a checkpoint (directory or URL) into buffers owned by the returned tensors."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt

    def fetch(self, stage: Stage) -> tuple[Tensors, int]:
        """({name: tensor}, spans read)."""
        spans = stage.spans()
        buffers = [
            (span, memoryview(self.ckpt.read_span(span.shard, span.start, span.stop))) for span in spans
        ]
        out: Tensors = {}
        for name, t in stage.tensors:
            span, buf = next((s, b) for s, b in buffers if s.shard == t.shard and s.start <= t.start < s.stop)
            out[name] = tensor_from_bytes(buf[t.start - span.start : t.end - span.start], t.dtype, t.shape)
        return out, len(spans)


class MappedWeights:
    """Stages of a local checkpoint used in place: the reading thread maps a stage's spans and faults their
    pages in (`Checkpoint.map_span`: read from disk into the page cache, no copy into a buffer of ours),
    the computation uses them, and `done` unmaps them, so resident memory holds the stages in use only."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt

    def fetch(self, stage: Stage) -> tuple[Tensors, int]:
        spans = stage.spans()
        views = [(span, self.ckpt.map_span(span.shard, span.start, span.stop)) for span in spans]
        out: Tensors = {}
        for name, t in stage.tensors:
            span, view = next((s, v) for s, v in views if s.shard == t.shard and s.start <= t.start < s.stop)
            out[name] = tensor_from_bytes(view[t.start - span.start : t.end - span.start], t.dtype, t.shape)
        return out, len(spans)

    def done(self, stage: Stage) -> None:
        for span in stage.spans():
            self.ckpt.unmap_span(span.shard, span.start, span.stop)


class ResidentWeights:
    """Every tensor of a checkpoint copied into memory first; stages are then served from there."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self._tensors = {t.name: ckpt.read(t.name).clone() for t in ckpt.tensors()}
        self._starts = {t.name: t.start for t in ckpt.tensors()}

    def fetch(self, stage: Stage) -> tuple[Tensors, int]:
        """The stage's tensors; one that covers only some rows of a tensor (the embedding's) as those rows."""
        out = {}
        for name, t in stage.tensors:
            full = self._tensors[t.name]
            row = full[0].numel() * full.element_size() if full.dim() else 0
            first = (t.start - self._starts[t.name]) // row if row else 0
            out[name] = full[first : first + t.shape[0]] if t.shape != tuple(full.shape) else full
        return out, 0


class Reads:
    """Stages read by one background thread, in the order `ahead` asks for them; `take` waits for one."""

    def __init__(
        self, weights: CheckpointWeights | MappedWeights | ResidentWeights, stats: ReadStats
    ) -> None:
        self._weights = weights
        self.stats = stats
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="k3-stream-read")
        self._pending: dict[Stage, Future[Tensors]] = {}

    def _read(self, stage: Stage) -> Tensors:
        start = time.perf_counter()
        tensors, reads = self._weights.fetch(stage)
        self.stats.count(stage, reads, time.perf_counter() - start)
        return tensors

    def ahead(self, stage: Stage) -> None:
        """Start reading `stage` after the reads already asked for (no-op when already asked)."""
        if stage not in self._pending:
            self._pending[stage] = self._pool.submit(self._read, stage)

    def done(self, stage: Stage) -> None:
        """The computation is finished with `stage`'s tensors (mapped weights give their pages back)."""
        if isinstance(self._weights, MappedWeights):
            self._weights.done(stage)

    def take(self, stage: Stage) -> Tensors:
        """The tensors of `stage` (read now if it was not asked for ahead)."""
        self.ahead(stage)
        future = self._pending.pop(stage)
        start = time.perf_counter()
        tensors = future.result()
        self.stats.seconds_waiting += time.perf_counter() - start
        return tensors

    def close(self) -> None:
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True)
