"""What every `k3` command shares: bad input reported as one line on stderr (no traceback, a non-zero exit),
and command groups with a default command."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup


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


class GroupWithDefault(TyperGroup):
    """A command group whose first argument, where it names none of the group's commands, goes to its
    command `default`: `k3 stream SOURCE ...` is `k3 stream run SOURCE ...`; `k3 stream compare ...` stays."""

    default: str

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = [self.default, *args]
        return super().parse_args(ctx, args)


def group_with_default(command: str) -> type[GroupWithDefault]:
    """The class of a group (`typer.Typer(cls=...)`) whose default command is `command`."""
    return type(f"GroupWithDefault[{command}]", (GroupWithDefault,), {"default": command})
