"""The scan: read every tensor of a checkpoint once, in parallel, and store its statistics.

    db_path = scan("checkpoints/mini")            # or an http(s) URL; returns the database path

Work is split into jobs: one per large logical tensor, one per run of small tensors stored next to each
other (up to a chunk's worth of bytes: a K3 checkpoint has tens of thousands of small expert matrices, and
a job per matrix would cost more in hand-offs than in counting), then one per (MoE layer, matrix kind)
(expert cosine similarity). Jobs run on a thread pool (torch releases the GIL while it counts; each worker
runs its torch ops single-threaded, the workers being the parallelism) and are handed out round-robin over
shards, so that workers read different files at once. Workers also encode each record as JSON; the main
thread alone writes to the database, one transaction for whatever finished since its last write, so the
scan can be killed at any instant and rerun: finished tensors are skipped, unfinished ones redone from
scratch.

Memory is bounded by the workers times the chunk size (`TensorReader.chunk_bytes` of stored bytes, a few
times that once widened): whatever the size of the checkpoint, the scan holds a few hundred MB.
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

import torch

from k3.atlas.db import AtlasDB, LogicalTensor, fingerprint, logical_tensors, stats_row
from k3.atlas.reading import TensorReader
from k3.atlas.similarity import MEMORY_BUDGET, cosine_similarities, expert_pairs
from k3.atlas.stats import MXFP4Stats, accumulator_for
from k3.checkpoint.reader import is_url

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
    key = str(source) if is_url(str(source)) else str(Path(source).resolve())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "k3" / "atlas" / hashlib.sha256(key.encode()).hexdigest()[:16] / DB_NAME


def resolve_db_path(source: str | Path, out: str | Path | None) -> Path:
    return Path(out) / DB_NAME if out is not None else default_db_path(source)


def tensor_statistics(
    reader: TensorReader, t: LogicalTensor, chunk_bytes: int | None = None
) -> dict[str, Any]:
    """The statistics record of one logical tensor, read in chunks of ~chunk_bytes stored bytes (default:
    `reader.chunk_bytes`)."""
    chunk_bytes = chunk_bytes or reader.chunk_bytes
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


MAX_TENSORS_PER_JOB = 32  # small tensors grouped into one job (a kill loses at most a few jobs of them)


def _jobs(tensors: list[LogicalTensor], chunk_bytes: int) -> list[list[LogicalTensor]]:
    """Runs of consecutive same-shard tensors of up to ~chunk_bytes (or MAX_TENSORS_PER_JOB) in all; a
    tensor of a chunk or more is a job of its own."""
    jobs: list[list[LogicalTensor]] = []
    run: list[LogicalTensor] = []
    run_bytes = 0
    for t in tensors:
        if run and (
            t.shard != run[0].shard or run_bytes + t.bytes > chunk_bytes or len(run) == MAX_TENSORS_PER_JOB
        ):
            jobs.append(run)
            run, run_bytes = [], 0
        run.append(t)
        run_bytes += t.bytes
    if run:
        jobs.append(run)
    return jobs


def _job_rows(reader: TensorReader, job: list[LogicalTensor], chunk_bytes: int) -> list[tuple[Any, ...]]:
    """The `stats` rows of one job's tensors (computed in a worker thread)."""
    rows = []
    for t in job:
        started = time.perf_counter()
        record = tensor_statistics(reader, t, chunk_bytes)
        rows.append(stats_row(t.id, record, time.perf_counter() - started))
    return rows


def _round_robin(jobs: list[list[LogicalTensor]]) -> Iterator[list[LogicalTensor]]:
    """Interleave jobs of different shards so that parallel workers read different files."""
    by_shard: dict[str, list[list[LogicalTensor]]] = defaultdict(list)
    for job in jobs:
        by_shard[job[0].shard].append(job)
    queues = [iter(v) for v in by_shard.values()]
    while queues:
        alive = []
        for q in queues:
            job = next(q, None)
            if job is not None:
                yield job
                alive.append(q)
        queues = alive


def _single_threaded_torch() -> None:
    """Pool initializer: torch ops in this worker thread run on this thread alone. (OpenMP's thread count
    is per calling thread; left at the core count, every worker would start a team of its own and, on a
    busy machine, wait on it: measured 15x slower with one worker beside another busy process.)"""
    torch.set_num_threads(1)


def scan(
    source: str | Path,
    db_path: str | Path | None = None,
    *,
    workers: int | None = None,
    similarity: bool = True,
    chunk_bytes: int | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> Path:
    """Scan `source` (checkpoint directory, file or URL) into `db_path` (default: `default_db_path`).

    Resumable: tensors and similarity jobs already in the database are not redone. `on_progress` is called
    from the calling thread after every stored tensor and similarity job (an exception there stops the scan;
    what was stored stays). `chunk_bytes` defaults to the reader's (`reading.CHUNK_BYTES` locally).
    Returns the database path.
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
            _run(db, reader, tensors, workers, similarity, chunk_bytes or reader.chunk_bytes, on_progress)
            db.set_meta("complete", similarity)
        finally:
            reader.close()
            db.close()
    return db_path


def _write_meta(db: AtlasDB, source: str | Path, ckpt: Any) -> None:
    db.set_meta("source", str(source))
    db.set_meta("revision", ckpt.revision)  # a Hub source: the commit its revision was resolved to
    db.set_meta("resolved_source", ckpt.location)
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
    threads = torch.get_num_threads()
    pool = ThreadPoolExecutor(workers, thread_name_prefix="atlas-scan", initializer=_single_threaded_torch)
    try:
        # at most 2 jobs per worker in flight: results come back in memory, and a kill loses little
        queue = _round_robin(_jobs(pending, chunk_bytes))
        in_flight: dict[Future, list[LogicalTensor]] = {}

        def submit_next() -> None:
            job = next(queue, None)
            if job is not None:
                in_flight[pool.submit(_job_rows, reader, job, chunk_bytes)] = job

        for _ in range(2 * workers):
            submit_next()
        while in_flight:
            finished, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            rows, stored = [], []
            for fut in finished:
                rows += fut.result()
                stored += in_flight.pop(fut)
                submit_next()
            db.write_stats_rows(rows)  # one transaction for all that finished
            for t in stored:
                progress.tensors_done += 1
                progress.bytes_done += t.bytes
                progress.last = t.name
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
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        torch.set_num_threads(threads)  # the workers' setting also changed torch's process-wide count


def _as_completed(futures: dict[Future, Any]) -> Iterator[Future]:
    pending = set(futures)
    while pending:
        finished, pending = wait(pending, return_when=FIRST_COMPLETED)
        yield from finished
