"""`k3 init --preset NAME [--seed S] OUT`: a random checkpoint in the published layout.

Wired into the `k3` app by k3/cli.py as `app.command("init")(init)`.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from k3.errors import K3Error
from k3.terminal import fail


def init(
    out: Path = typer.Argument(..., help="Directory to write the checkpoint into (created if missing)."),
    preset: str = typer.Option(..., "--preset", help="A preset name (k3 census lists them)."),
    seed: int = typer.Option(0, "--seed", help="Random seed: the same seed writes the same bytes."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a checkpoint already in OUT."),
) -> None:
    """Write a random checkpoint (shards, index, config.json; MXFP4 experts) in the published layout."""
    say_written(preset, seed, out, write_random_checkpoint(out, preset, seed, overwrite))


def write_random_checkpoint(out: Path, preset: str, seed: int, overwrite: bool) -> list[Path]:
    """`k3 init`'s files (shards, index, config.json), or a one-line error; a public preset (PUBLIC_PRESETS)
    is written in its exact layout."""
    from k3.config import PRESETS, PUBLIC_PRESETS, K3Config
    from k3.layout import published_tensors, vision_tensors
    from k3.model.init import init_checkpoint

    if preset in PUBLIC_PRESETS:  # a public checkpoint's name: its exact layout
        return write_like_checkpoint(out, preset, seed, overwrite)
    try:
        if preset not in PRESETS:
            choices = ", ".join(PRESETS + PUBLIC_PRESETS)
            raise K3Error(f"--preset: unknown preset {preset!r} (choose from {choices})")
        cfg = K3Config.preset(preset)
        total = sum(s.nbytes for s in published_tensors(cfg, expand_experts=False))
        total += sum(s.nbytes for s in vision_tensors(cfg))
        free = _free_bytes(out)
        if free is not None and total > free:
            raise K3Error(
                f"{out}: {preset} needs {total / 1e9:.1f} GB on disk, only {free / 1e9:.1f} GB free"
            )
        return init_checkpoint(cfg, out, seed=seed, overwrite=overwrite)
    except K3Error as e:
        fail(str(e))


def say_written(preset: str, seed: int, out: Path, files: list[Path]) -> None:
    written = sum(f.stat().st_size for f in files)
    Console().print(f"wrote {preset} (seed {seed}) to {out}: {len(files)} files, {written / 1e9:.3f} GB")


def _free_bytes(path: Path) -> int | None:
    import shutil

    probe = path
    while not probe.exists():
        if probe.parent == probe:
            return None
        probe = probe.parent
    return shutil.disk_usage(probe).free


def write_like_checkpoint(out: Path, name: str, seed: int, overwrite: bool) -> list[Path]:
    """A random checkpoint in a public checkpoint's exact layout (k3.checkpoint.public), or one error line."""
    from k3.checkpoint.public import PUBLIC_LAYOUTS, public_tensors
    from k3.model.init import init_like

    try:
        total = sum(s.nbytes for s in public_tensors(PUBLIC_LAYOUTS[name]))
        free = _free_bytes(out)
        if free is not None and total > free:
            raise K3Error(f"{out}: {name} needs {total / 1e9:.1f} GB on disk, only {free / 1e9:.1f} GB free")
        return init_like(name, out, seed=seed, overwrite=overwrite)
    except K3Error as e:
        fail(str(e))
