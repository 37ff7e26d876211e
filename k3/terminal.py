"""How every `k3` command reports bad input: one line on stderr, no traceback, a non-zero exit."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape


def fail(message: str, code: int = 1) -> NoReturn:
    """Print `error: message` on stderr (never wrapped, markup in the message shown as text) and exit."""
    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    raise typer.Exit(code)


def remove_if_empty(path: Path) -> None:
    """Remove the folder `path` and the folders under it if none holds a file: what a command that failed
    before writing anything leaves behind (a folder with a file in it, say resumable state, stays)."""
    path = Path(path)
    if not path.is_dir() or path.is_symlink():
        return
    for root, dirs, files in os.walk(path, topdown=False):
        if not files and not any((Path(root) / d).exists() for d in dirs):
            Path(root).rmdir()
