"""Open a source (a checkpoint directory or an http(s) URL of one), stream prompts through it, write OUT.

    result = stream_logits(source, prompts, StreamOptions(...))           # in memory, no scratch folder
    result = stream_to_dir(source, prompts, Path("out"), StreamOptions(...))

`stream_to_dir` keeps the run's state in OUT/scratch/ (resume after a kill: run the same command again),
writes OUT/logits.safetensors and OUT/summary.json atomically, then deletes the scratch folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import save_file

from k3.checkpoint import RemoteOptions, open_checkpoint
from k3.stream.fetch import CheckpointWeights, MappedWeights, ResidentWeights
from k3.stream.plan import StreamPlan
from k3.stream.runner import StreamOptions, StreamResult, StreamRun, StreamStatus, fingerprint
from k3.stream.scratch import Scratch
from k3.vision.preprocess import Prepared

LOGITS = "logits.safetensors"
SUMMARY = "summary.json"


def stream_logits(
    source: str | Path,
    prompts: list[list[int]],
    options: StreamOptions | None = None,
    *,
    resident: bool = False,
    scratch_dir: Path | None = None,
    remote: RemoteOptions | None = None,
    report: Callable[[StreamStatus], None] | None = None,
    images: list[list[Prepared]] | None = None,
) -> StreamResult:
    """Run the schedule over `prompts` (token ids). `resident`: copy every weight into memory first (the
    reference the streamed run matches bit for bit). `scratch_dir`: per-layer state there (resumable).
    `images`: per prompt, the prepared images whose rows fill its `<|media_pad|>` placeholders."""
    options = options or StreamOptions()
    with open_checkpoint(source, remote=remote) as ckpt:
        plan = StreamPlan(ckpt)
        if resident:
            weights: ResidentWeights | CheckpointWeights | MappedWeights = ResidentWeights(ckpt)
        else:  # a local checkpoint is used in place from its memory map; a URL's stages are fetched
            weights = CheckpointWeights(ckpt) if ckpt.fetch_stats is not None else MappedWeights(ckpt)
        scratch = None
        if scratch_dir is not None:
            job = fingerprint(ckpt.location, ckpt.total_bytes, prompts, options, images)
            scratch = Scratch(scratch_dir, job)
        result = StreamRun(plan, weights, prompts, options, scratch, report, images).run()
        result.summary["source"] = str(source)
        if ckpt.revision is not None:  # a Hub source: the commit its revision was resolved to
            result.summary["revision"] = ckpt.revision
            result.summary["resolved_source"] = ckpt.location
        stats = ckpt.fetch_stats
        if stats is not None:
            result.summary["http"] = {
                "requests": stats.requests,
                "bytes": stats.bytes_fetched,
                "retries": stats.retries,
                "cache_hits": stats.cache_hits,
            }
    return result


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def stream_to_dir(
    source: str | Path,
    prompts: list[list[int]],
    out: Path,
    options: StreamOptions | None = None,
    *,
    scratch_dir: Path | None = None,
    remote: RemoteOptions | None = None,
    report: Callable[[StreamStatus], None] | None = None,
    images: list[list[Prepared]] | None = None,
) -> StreamResult:
    """`stream_logits` with state in `scratch_dir` (default OUT/scratch), then OUT/logits.safetensors and
    OUT/summary.json; the scratch folder is deleted once both are in place."""
    out.mkdir(parents=True, exist_ok=True)
    scratch_dir = scratch_dir or out / "scratch"
    result = stream_logits(
        source, prompts, options, scratch_dir=scratch_dir, remote=remote, report=report, images=images
    )
    tensors = {k: v.contiguous() for k, v in result.outputs.items()}
    metadata = {"format": "k3-stream-logits/1"}
    if "revision" in result.summary:
        metadata |= {"source": result.summary["resolved_source"], "revision": result.summary["revision"]}
    _atomic(out / LOGITS, lambda p: save_file(tensors, str(p), metadata=metadata))
    _atomic(out / SUMMARY, lambda p: p.write_text(json.dumps(result.summary, indent=2) + "\n"))
    Scratch(scratch_dir, "").remove()
    return result
