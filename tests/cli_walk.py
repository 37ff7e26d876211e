"""Every `k3` command, for tests that look at all of them (their help, their options)."""

from __future__ import annotations

from typer.main import get_command

from k3.cli import app


def commands(command=None, path: tuple[str, ...] = ()):
    """(path, click command) for `k3` and every command below it."""
    command = get_command(app) if command is None else command
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from commands(sub, (*path, name))
