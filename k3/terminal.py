"""How every `k3` command reports bad input: one line on stderr, no traceback, a non-zero exit."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape


def fail(message: str, code: int = 1) -> NoReturn:
    """Print `error: message` on stderr (never wrapped, markup in the message shown as text) and exit."""
    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    raise typer.Exit(code)
