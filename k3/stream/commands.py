"""`k3 stream SOURCE --prompts FILE.jsonl --out DIR` and `k3 stream compare OUT OTHER.safetensors`."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import typer

from k3.errors import K3Error
from k3.terminal import fail, group_with_default, remove_if_empty

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20}
_UNITS |= {"GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", re.IGNORECASE)


stream_app = typer.Typer(
    cls=group_with_default("run"),
    help="Exact logits of the whole model on a small machine: stream the weights layer by layer.",
    no_args_is_help=True,
)


def parse_size(text: str) -> int:
    """'4GB' -> 4e9, '512MiB' -> 512 * 2^20, '1000' -> 1000."""
    m = _SIZE.fullmatch(text)
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS:
        raise K3Error(f"{text!r} is not a size (say 4GB, 512MB, 2GiB or a number of bytes)")
    return int(float(m.group(1)) * _UNITS[unit])


def compute_threads() -> int:
    """torch threads: every CPU this process may use. The reading thread hardly needs one (faulting 1.5 GB
    in cost 0.02 s of CPU) now that it lets go of the GIL while it reads; a 256-token `k3-slice` pass
    computed 19.5 s with 2 threads on 2 quiet cores, ~35 s with 1."""
    return max(1, len(os.sched_getaffinity(0)))


def read_prompts(path: Path, tokenizer_source: str | Path) -> tuple[list[list[int]], list[list]]:
    """One prompt a line: {"input_ids": [...]} or {"text": "..."} (encoded by the tokenizer of
    `tokenizer_source`, a checkpoint folder or URL, loaded on the first text prompt), either with
    "images": ["a.png", ...] (paths relative to the prompts file). A text prompt's images come before its
    text (as `k3 generate --image`); `input_ids` hold their `<|media_pad|>` placeholders (one per image or
    the expanded form). Returns the ids and, per prompt, its images (k3.vision.preprocess.Prepared)."""
    if not path.is_file():
        raise K3Error(f"{path}: no such prompts file")
    prompts: list[list[int]] = []
    images: list[list] = []
    tokenizer = None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise K3Error(f"{path}:{n}: not JSON ({e.msg})") from None
        loaded = _images(path, n, row.get("images", []) if isinstance(row, dict) else [])
        if isinstance(row, dict) and isinstance(row.get("input_ids"), list):
            ids = row["input_ids"]
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise K3Error(f"{path}:{n}: input_ids must be a list of integers")
            prompts.append(ids)
        elif isinstance(row, dict) and isinstance(row.get("text"), str):
            if tokenizer is None:
                from k3.tokenizer.kimi import Tokenizer

                tokenizer = Tokenizer.from_source(tokenizer_source)
            from k3.engine.images import image_prompt_ids

            before = [t for im in loaded for t in image_prompt_ids(tokenizer, im)]
            prompts.append(before + tokenizer.encode(row["text"]))
        else:
            raise K3Error(f'{path}:{n}: expected {{"input_ids": [...]}} or {{"text": "..."}}')
        images.append([im.item for im in loaded])
    if not prompts:
        raise K3Error(f"{path}: no prompts")
    return prompts, images


def _images(path: Path, n: int, names: object) -> list:
    """The images of line n (k3.engine.images.ImageInput), each opened and preprocessed."""
    if not isinstance(names, list) or not all(isinstance(x, str) for x in names):
        raise K3Error(f"{path}:{n}: images must be a list of file names")
    from k3.engine.images import load_image

    out = []
    for name in names:
        file = path.parent / name
        if not file.is_file():
            raise K3Error(f"{path}:{n}: {name}: no such image file")
        try:
            out.append(load_image(file.read_bytes()))
        except K3Error as e:
            raise K3Error(f"{path}:{n}: {name}: {e}") from None
    return out


@stream_app.command("run")
def run(
    source: str = typer.Argument(
        ..., help="A checkpoint directory, an http(s) URL of one, or hf://ORG/REPO[@REV]."
    ),
    prompts: Path = typer.Option(
        ..., "--prompts", help='JSONL: {"text": ...} or {"input_ids": [...]} a line (+ "images": [...]).'
    ),
    out: Path = typer.Option(..., "--out", help="Output folder: logits.safetensors, summary.json."),
    memory_budget: str = typer.Option("4GB", help="Prompt state kept in RAM; beyond it, in scratch files."),
    threads: int | None = typer.Option(None, help="torch threads for the computation (default: every CPU)."),
    max_new_tokens: int = typer.Option(0, help="Greedy continuation: one more pass over all weights each."),
    all_positions: bool = typer.Option(False, "--all-positions", help="Logits of every position."),
    dump_hidden: str | None = typer.Option(None, help="Layers whose output to keep, e.g. 0,46,92."),
    top_k: int = typer.Option(5, help="Top-k ids and logprobs kept per position."),
    chunk_tokens: int = typer.Option(2048, help="Tokens per mixer chunk for long prompts."),
    compute: str = typer.Option(
        "float32", help="Activations' dtype: float32, or bfloat16 (bf16 products; see `k3 doctor`)."
    ),
    prefetch: str = typer.Option("256MB", help="Routed experts read ahead of the one computing."),
    tokenizer: str | None = typer.Option(
        None, help="Tokenizer folder or URL for text prompts (default: SOURCE)."
    ),
    scratch: Path | None = typer.Option(None, help="Scratch folder (default OUT/scratch; resume from it)."),
    cache_dir: Path | None = typer.Option(None, help="URLs: keep fetched ranges here for later passes/runs."),
    cache_size: str | None = typer.Option(None, help="At most this much in --cache-dir (e.g. 20GB; LRU)."),
) -> None:
    """Exact logits of every prompt, reading each weight once per pass (docs/stream.md)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from k3.checkpoint.reader import is_url
    from k3.checkpoint.remote import RemoteOptions
    from k3.stream.api import stream_to_dir
    from k3.stream.memory import return_freed_memory, rss_bytes
    from k3.stream.runner import COMPUTE_DTYPES, StreamOptions, StreamStatus

    if compute not in COMPUTE_DTYPES:
        fail(f"--compute must be one of {', '.join(COMPUTE_DTYPES)}, got {compute!r}")
    try:
        budget, ahead = parse_size(memory_budget), parse_size(prefetch)
        cap = parse_size(cache_size) if cache_size is not None else None
        layers = tuple(int(x) for x in dump_hidden.split(",")) if dump_hidden else ()
        ids, images = read_prompts(prompts, tokenizer or source)  # a URL's tokenizer is fetched from it
    except ValueError as e:
        fail(str(e) if isinstance(e, K3Error) else f"--dump-hidden: {e}")
    if max_new_tokens < 0 or top_k < 1 or chunk_tokens < 1 or (threads is not None and threads < 1):
        fail("--max-new-tokens must be >= 0; --top-k, --chunk-tokens and --threads >= 1")
    if cache_size is not None and cache_dir is None:
        fail("--cache-size needs --cache-dir")
    remote = RemoteOptions(cache_dir=cache_dir, cache_max_bytes=cap) if cache_dir is not None else None
    if is_url(source):  # stages arrive in buffers of ours (a local checkpoint's are used in place)
        return_freed_memory()
    import torch

    torch.set_num_threads(threads or compute_threads())
    options = StreamOptions(
        all_positions, max_new_tokens, top_k, chunk_tokens, budget, ahead, layers, compute
    )
    started = time.perf_counter()
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[io]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    ) as bar:
        task = bar.add_task("opening", total=1.0, io="")

        def report(s: StreamStatus) -> None:
            where = f"pass {s.pass_index + 1}/{s.passes}"
            if s.passes > 1:
                where += " (each generated token is one more pass over all weights)"
            seconds = max(time.perf_counter() - started, 1e-9)
            io = f"{s.stats.bytes_read / 1e9:.2f} GB read, {s.stats.bytes_read / seconds / 1e9:.2f} GB/s, "
            io += f"RSS {rss_bytes() / 1e9:.2f} GB"
            bar.update(task, completed=s.fraction, description=f"{where} {s.stage}", io=io)

        try:
            result = stream_to_dir(
                source, ids, out, options, scratch_dir=scratch, remote=remote, report=report, images=images
            )
        except (K3Error, OSError) as e:
            remove_if_empty(out)  # created for the run, nothing written: gone again
            fail(str(e))
        bar.update(task, completed=1.0, description="done")
    s = result.summary
    print(
        f"{len(ids)} prompts, {s['tokens']} tokens, {s['passes']} pass(es): "
        f"{s['bytes_dense'] / 1e9:.3f} GB dense + {s['bytes_experts'] / 1e9:.3f} GB experts read in "
        f"{s['seconds']:.1f} s; peak RSS "
        f"{s['peak_rss_bytes'] / 1e9:.2f} GB -> {out}/logits.safetensors, {out}/summary.json"
    )


@stream_app.command("compare")
def compare(
    out: Path = typer.Argument(..., help="A `k3 stream` output folder (or its logits.safetensors)."),
    other: Path = typer.Argument(..., help="Another engine's logits in the same format (docs/stream.md)."),
    tolerance: float = typer.Option(1e-3, help="|dlogit| above which two positions are said to part."),
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON."),
) -> None:
    """Per prompt: max/mean |dlogit|, KL(k3 || other), top-1/top-5 agreement, first position they part."""
    from rich.console import Console
    from rich.table import Table

    from k3.stream.compare import compare_logits, read_logits

    try:
        rows = compare_logits(read_logits(out), read_logits(other), tolerance)
    except K3Error as e:
        fail(str(e))
    if as_json:
        print(json.dumps([r.to_json() for r in rows], indent=2))
        return
    table = Table(title=f"{out} vs {other}", title_justify="left")
    for col in (
        "prompt",
        "positions",
        "max |d|",
        "mean |d|",
        "KL mean",
        "KL max",
        "top-1",
        "top-5",
        "parts at",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        first = r.first_over_tolerance if r.first_over_tolerance is not None else "-"
        if r.first_top1_mismatch is not None:
            first = f"{first} (top-1 at {r.first_top1_mismatch})"
        table.add_row(
            str(r.prompt),
            str(r.positions),
            f"{r.max_abs:.3g}",
            f"{r.mean_abs:.3g}",
            f"{r.kl_mean:.3g}",
            f"{r.kl_max:.3g}",
            f"{r.top1:.1%}",
            f"{r.top5:.1%}",
            str(first),
        )
    Console().print(table)
