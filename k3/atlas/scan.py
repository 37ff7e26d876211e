"""The scan: read every tensor of a checkpoint once, in parallel, and store its statistics.

    db_path = scan("checkpoints/mini")            # or an http(s) URL; returns the database path

Work is split into jobs: one per logical tensor (statistics), then one per (MoE layer, matrix kind) (expert
cosine similarity). Jobs run on a thread pool (torch releases the GIL while it counts) and are handed out
round-robin over shards, so that workers read different files at once. The main thread alone writes to the
database, one transaction per finished job, so the scan can be killed at any instant and rerun: finished
jobs are skipped, unfinished ones redone from scratch.

Memory is bounded by the workers times the chunk size (`reading.CHUNK_BYTES` of stored bytes, a few times
that once widened to float): whatever the size of the checkpoint, the scan holds a few hundred MB.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3.atlas.db import AtlasDB, LogicalTensor, fingerprint, logical_tensors
from k3.atlas.reading import CHUNK_BYTES, TensorReader
from k3.atlas.similarity import MEMORY_BUDGET, cosine_similarities, expert_pairs
from k3.atlas.stats import MXFP4Stats, accumulator_for

DB_NAME = "atlas.sqlite"


@dataclass
class Progress:
    """What a progress callback sees after each finished job."""

    tensors_done: int
    tensors_total: int
    bytes_done: int
    bytes_total: int
    similarity_done: int
    similarity_total: int
    last: str  # the job just finished


def default_db_path(source: str | Path) -> Path:
    """`$XDG_CACHE_HOME/k3/atlas/<hash of the source>/atlas.sqlite` (the source's absolute path or URL)."""
    key = str(source) if str(source).startswith(("http://", "https://")) else str(Path(source).resolve())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "k3" / "atlas" / hashlib.sha256(key.encode()).hexdigest()[:16] / DB_NAME


def resolve_db_path(source: str | Path, out: str | Path | None) -> Path:
    return Path(out) / DB_NAME if out is not None else default_db_path(source)


def tensor_statistics(
    reader: TensorReader, t: LogicalTensor, chunk_bytes: int = CHUNK_BYTES
) -> dict[str, Any]:
    """The statistics record of one logical tensor, read in chunks of ~chunk_bytes stored bytes."""
    if t.dtype == "MXFP4":
        acc = MXFP4Stats()
        packed, scale = t.parts
        rows = t.shape[0]
        step = reader.row_step(t, chunk_bytes)
        for r0 in range(0, rows, step):
            r1 = min(r0 + step, rows)
            acc.update(reader.rows(packed, r0, r1), reader.rows(scale, r0, r1))
        record = acc.finish()
    else:
        dense = accumulator_for(t.dtype, t.params)
        for chunk in reader.flat_chunks(t.parts[0], chunk_bytes):
            dense.update(chunk)
        record = dense.finish()
    record.update(name=t.name, dtype=t.dtype, shape=list(t.shape), params=t.params, bytes=t.bytes)
    return record


def similarity_jobs(tensors: list[LogicalTensor]) -> dict[tuple[int, str], list[LogicalTensor]]:
    """{(layer, matrix): expert matrices sorted by expert} for every group of >= 2 same-shaped 2-D experts."""
    groups: dict[tuple[int, str], list[LogicalTensor]] = defaultdict(list)
    for t in tensors:
        if t.expert is not None and t.layer is not None and t.matrix is not None and len(t.shape) == 2:
            groups[(t.layer, t.matrix)].append(t)
    return {
        k: sorted(v, key=lambda t: t.expert or 0)
        for k, v in sorted(groups.items())
        if len(v) >= 2 and len({t.shape for t in v}) == 1
    }


def layer_similarity(
    reader: TensorReader, experts: list[LogicalTensor], memory_budget: int = MEMORY_BUDGET
) -> tuple[dict[tuple[int, int], float | None], list[int]]:
    by_expert = {t.expert: t for t in experts}
    ids = sorted(e for e in by_expert if e is not None)
    # pairs are over positions 0..n-1 and mapped back to expert numbers (they are 0..n-1 in K3)
    pos_pairs, pos_subset = expert_pairs(len(ids))
    pairs = [(ids[a], ids[b]) for a, b in pos_pairs]
    rows, cols = experts[0].shape

    def load(e: int, r0: int, r1: int):
        return reader.logical_rows(by_expert[e], r0, r1)

    return cosine_similarities(ids, rows, cols, load, pairs, memory_budget), [ids[i] for i in pos_subset]


def _round_robin(tensors: list[LogicalTensor]) -> Iterator[LogicalTensor]:
    """Interleave tensors of different shards so that parallel workers read different files."""
    by_shard: dict[str, list[LogicalTensor]] = defaultdict(list)
    for t in tensors:
        by_shard[t.shard].append(t)
    queues = [iter(v) for v in by_shard.values()]
    while queues:
        alive = []
        for q in queues:
            t = next(q, None)
            if t is not None:
                yield t
                alive.append(q)
        queues = alive


def scan(
    source: str | Path,
    db_path: str | Path | None = None,
    *,
    workers: int | None = None,
    similarity: bool = True,
    chunk_bytes: int = CHUNK_BYTES,
    on_progress: Callable[[Progress], None] | None = None,
) -> Path:
    """Scan `source` (checkpoint directory, file or URL) into `db_path` (default: `default_db_path`).

    Resumable: tensors and similarity jobs already in the database are not redone. `on_progress` is called
    from the calling thread after every stored job (an exception there stops the scan; what was stored
    stays). Returns the database path.
    """
    from k3.checkpoint import open_checkpoint

    db_path = Path(db_path) if db_path is not None else default_db_path(source)
    workers = workers or min(4, os.cpu_count() or 1)
    with open_checkpoint(source) as ckpt:
        infos = list(ckpt.tensors())
        tensors = logical_tensors(infos, ckpt.config)
        db = AtlasDB(db_path)
        reader = TensorReader(ckpt, source)
        try:
            db.write_index(tensors, fingerprint(infos))
            _write_meta(db, source, ckpt)
            _run(db, reader, tensors, workers, similarity, chunk_bytes, on_progress)
            db.set_meta("complete", similarity)
        finally:
            reader.close()
            db.close()
    return db_path


def _write_meta(db: AtlasDB, source: str | Path, ckpt: Any) -> None:
    db.set_meta("source", str(source))
    db.set_meta("raw_config", ckpt.raw_config)
    db.set_meta("config_error", ckpt.config_error)
    db.set_meta("shards", ckpt.shards)
    db.set_meta("total_bytes", ckpt.total_bytes)


def _run(
    db: AtlasDB,
    reader: TensorReader,
    tensors: list[LogicalTensor],
    workers: int,
    similarity: bool,
    chunk_bytes: int,
    on_progress: Callable[[Progress], None] | None,
) -> None:
    done = db.done_ids()
    pending = [t for t in tensors if t.id not in done]
    sim_jobs = similarity_jobs(tensors) if similarity else {}
    sim_done = db.similarity_done()
    sim_pending = [k for k in sim_jobs if k not in sim_done]
    progress = Progress(
        tensors_done=len(done),
        tensors_total=len(tensors),
        bytes_done=sum(t.bytes for t in tensors if t.id in done),
        bytes_total=sum(t.bytes for t in tensors),
        similarity_done=len(sim_jobs) - len(sim_pending),
        similarity_total=len(sim_jobs),
        last="",
    )
    if on_progress:
        on_progress(progress)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="atlas-scan") as pool:
        # at most 2 jobs per worker in flight: results come back in memory, and a kill loses little
        queue = iter(_round_robin(pending))
        in_flight: dict[Future, tuple[LogicalTensor, float]] = {}

        def submit_next() -> None:
            t = next(queue, None)
            if t is not None:
                in_flight[pool.submit(tensor_statistics, reader, t, chunk_bytes)] = (t, time.perf_counter())

        for _ in range(2 * workers):
            submit_next()
        while in_flight:
            finished, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            for fut in finished:
                t, started = in_flight.pop(fut)
                record = fut.result()
                db.write_stats(t.id, record, time.perf_counter() - started)
                progress.tensors_done += 1
                progress.bytes_done += t.bytes
                progress.last = t.name
                submit_next()
                if on_progress:
                    on_progress(progress)
        # similarity: one job per (layer, matrix); the workers share one memory budget
        budget = max(16 * 2**20, MEMORY_BUDGET // workers)
        futures = {pool.submit(layer_similarity, reader, sim_jobs[k], budget): k for k in sim_pending}
        for fut in _as_completed(futures):
            layer, matrix = futures[fut]
            cosines, subset = fut.result()
            db.write_similarity(layer, matrix, cosines, subset)
            progress.similarity_done += 1
            progress.last = f"similarity layer {layer} {matrix}"
            if on_progress:
                on_progress(progress)


def _as_completed(futures: dict[Future, Any]) -> Iterator[Future]:
    pending = set(futures)
    while pending:
        finished, pending = wait(pending, return_when=FIRST_COMPLETED)
        yield from finished
