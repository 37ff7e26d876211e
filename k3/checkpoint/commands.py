"""`k3 inspect SOURCE [--filter RE] [--json]`: list and validate a checkpoint's tensors.

Wired into the `k3` app by k3/cli.py, which adds the census's cross-check of the headers against the config
(`inspect_command(cross_check)`): the census sits above the checkpoint room, so this module cannot ask it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from k3.config import K3Config
from k3.errors import K3Error
from k3.terminal import fail

# (config, [(name, safetensors dtype, shape)] of every tensor, source) -> findings about the checkpoint
CrossCheck = Callable[[K3Config, Sequence[tuple[str, str, tuple[int, ...]]], str], list[str]]


def _report(source: str, pattern: re.Pattern[str] | None, cross_check: CrossCheck | None) -> dict[str, Any]:
    """Everything inspect shows, as JSON-ready data. Raises K3Error on a broken checkpoint."""
    from k3.checkpoint import open_checkpoint
    from k3.checkpoint.quant import find_quantization_config, packing_rows
    from k3.layout import parameters_of

    with open_checkpoint(source) as ckpt:
        rows = [
            {
                "name": t.name,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "params": parameters_of(t.name, t.dtype, t.numel),
                "bytes": t.nbytes,
                "shard": t.shard,
                "start": t.start,
                "end": t.end,
            }
            for t in ckpt.tensors()
        ]
        findings = list(ckpt.findings) + [f"trap: {trap}" for trap in ckpt.traps]
        headers = {t.name: (t.dtype, t.shape) for t in ckpt.tensors()}
        quantization = find_quantization_config(ckpt.raw_config)
        try:
            packing = packing_rows(quantization, headers)
        except K3Error as e:
            packing, findings = {}, [*findings, str(e)]
        for row in rows:
            if row["name"] in packing:
                row["packing"] = packing[row["name"]]
        if ckpt.config is None:
            findings.append(f"no K3 config: {ckpt.config_error}")
        elif cross_check is not None:
            headers = [(t.name, t.dtype, t.shape) for t in ckpt.tensors()]
            findings += cross_check(ckpt.config, headers, source)
        shown = [r for r in rows if pattern is None or pattern.search(r["name"])]
        return {
            "source": source,
            "resolved": ckpt.location,  # a Hub source: hf://ORG/REPO@<commit>
            "revision": ckpt.revision,
            "packed": sum(r.get("packing", "").startswith("packed") for r in rows) // 2,
            "shards": ckpt.shards,
            "total_tensors": ckpt.total_tensors,
            "total_bytes": ckpt.total_bytes,
            "total_params": sum(r["params"] for r in rows),
            "shown_tensors": len(shown),
            "shown_bytes": sum(r["bytes"] for r in shown),
            "shown_params": sum(r["params"] for r in shown),
            "findings": findings,
            "tensors": shown,
        }


def _print(report: dict[str, Any]) -> None:
    console = Console()
    table = Table(title=f"Checkpoint: {escape(report['source'])}", title_justify="left")
    table.add_column("name", overflow="fold")  # long names wrap rather than lose their ends
    table.add_column("dtype")
    table.add_column("shape")
    table.add_column("parameters", justify="right")
    table.add_column("bytes", justify="right")
    table.add_column("shard", overflow="fold")
    table.add_column("packing (MXFP4)", overflow="fold")  # packed or not, and why (k3.checkpoint.quant)
    for r in report["tensors"]:
        shape = "[" + ", ".join(map(str, r["shape"])) + "]"
        cells = (r["name"], r["dtype"], shape, f"{r['params']:,}", f"{r['bytes']:,}", r["shard"])
        table.add_row(*map(escape, cells), escape(r.get("packing", "")))
    table.add_row(
        "[bold]shown", "", "", f"[bold]{report['shown_params']:,}", f"[bold]{report['shown_bytes']:,}", "", ""
    )
    console.print(table)
    console.print(
        f"{report['shown_tensors']:,} of {report['total_tensors']:,} tensors shown; checkpoint: "
        f"{report['total_params']:,} parameters, {report['total_bytes']:,} bytes in "
        f"{len(report['shards'])} shard(s); headers valid; {report['packed']:,} MXFP4-packed weights",
        highlight=False,
    )
    if report["revision"] is not None:
        console.print(f"resolved: {escape(report['resolved'])}", highlight=False)
    for finding in report["findings"]:
        console.print(f"[yellow]finding:[/] {escape(finding)}", highlight=False)


def inspect_command(cross_check: CrossCheck | None = None) -> Callable[..., None]:
    """The typer command `inspect`, with `cross_check`'s findings added to the checkpoint's own."""

    def inspect(
        source: str = typer.Argument(
            ..., help="A checkpoint directory, an http(s) URL of one, or hf://ORG/REPO[@REV]."
        ),
        filter: str | None = typer.Option(
            None, "--filter", help="Show only tensors whose name matches this regex."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON."),
    ) -> None:
        """Tensor listing and validation of a checkpoint: every header is checked, no tensor data is read."""
        try:
            pattern = re.compile(filter) if filter is not None else None
        except re.error as e:
            fail(f"--filter {filter!r} is not a regular expression ({e})")
        try:
            report = _report(source, pattern, cross_check)
        except (K3Error, OSError) as e:
            fail(str(e))
        if as_json:
            print(json.dumps(report, indent=2))
        else:
            _print(report)

    return inspect


def download_command(
    source: str = typer.Argument(..., help="hf://ORG/REPO[@REVISION] (or a Hub resolve URL)."),
    include: list[str] | None = typer.Option(
        None, "--include", help="Only files matching this glob (repeatable), e.g. '*.json'."
    ),
    local_dir: Path | None = typer.Option(
        None, "--local-dir", help="Write the files here instead of the Hugging Face cache."
    ),
) -> None:
    """Download a Hub checkpoint's files (resumable after a kill, each checked against the Hub's sha256)."""
    from k3.checkpoint.download import download

    try:
        resolved, folder = download(source, include, local_dir)
    except (K3Error, OSError) as e:
        fail(str(e))
    Console().print(f"{resolved}: files in {folder}", highlight=False)
