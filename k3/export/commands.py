"""`k3 export gguf CKPT OUT.gguf [--outtype f32|bf16|q8_0] [--experts mxfp4|f32]`.

Register in k3/cli.py with `app.add_typer(export_app, name="export")`. The export (torch, gguf) is imported
when the command runs, so that `k3 --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path

import typer

from k3.errors import K3Error
from k3.terminal import fail

export_app = typer.Typer(help="Export a checkpoint for other engines.", no_args_is_help=True)


@export_app.command("gguf")
def gguf(
    checkpoint: Path = typer.Argument(
        ..., help="A k3 checkpoint directory (weights, config.json, tokenizer)."
    ),
    out: Path = typer.Argument(..., help="The GGUF file to write."),
    outtype: str = typer.Option("f32", "--outtype", help="Weight matrices: f32, bf16 or q8_0."),
    experts: str = typer.Option(
        None,
        "--experts",
        help="Routed experts: mxfp4 (default for MXFP4 checkpoints) or f32 (exactly decoded).",
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT if it exists."),
) -> None:
    """Write a GGUF file that llama.cpp (kimi-linear / kimi-k3) opens without its converter."""
    from k3.export.gguf import export_gguf

    try:
        report = export_gguf(checkpoint, out, outtype=outtype, experts=experts, overwrite=overwrite)
    except K3Error as e:
        fail(str(e))
    types = ", ".join(f"{n} {k}" for k, n in sorted(report.types.items()))
    size = f"{report.nbytes / 1e6:.1f} MB"
    typer.echo(f"wrote {report.path}: {report.arch}, {report.tensors} tensors ({types}), {size}")
