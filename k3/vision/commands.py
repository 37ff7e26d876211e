"""`k3 vision preprocess IMAGE [IMAGE2 ...] [--json]`: what the navit rule makes of an image (or a clip):
original, resized and padded sizes, the patch grid and the number of image tokens.

Wired into the `k3` app by k3/cli.py as `app.add_typer(vision_app, name="vision")`.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from k3.errors import K3Error
from k3.terminal import fail

vision_app = typer.Typer(help="The vision path: preprocessing of images.", no_args_is_help=True)


@vision_app.command("preprocess")
def preprocess(
    images: list[Path] = typer.Argument(..., help="An image, or up to 4 frames of one size (a clip)."),
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON."),
) -> None:
    """Sizes, patch grid and image tokens of IMAGE under K3's preprocessing (Pillow, bicubic, navit)."""
    from k3.vision.preprocess import ImageError, open_image, prepare

    try:
        frames = []
        for path in images:
            try:
                data = path.read_bytes()
            except OSError as e:
                raise ImageError(f"{path}: cannot read ({e.strerror})") from None
            try:
                frames.append(open_image(data))
            except ImageError as e:
                raise ImageError(f"{path}: {e}") from None
        item = prepare(frames)
    except K3Error as e:
        fail(str(e))
    out = {
        **item.geometry.to_json(),
        "frames": item.grid[0],
        "mode": frames[0].mode,
        "format": frames[0].format,
    }
    if as_json:
        print(json.dumps(out))
        return
    g = item.geometry
    Console(soft_wrap=True).print(
        f"{images[0]}: {frames[0].format} {frames[0].mode}, original {g.original[0]}x{g.original[1]}, "
        f"resized {g.resized[0]}x{g.resized[1]}, padded {g.padded[0]}x{g.padded[1]}; "
        f"grid {item.grid[0]} x {g.grid[0]} x {g.grid[1]} patches; {g.tokens} image tokens",
        highlight=False,
    )
