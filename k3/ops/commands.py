"""`k3 doctor`: which kernels are in use and why, torch, threads, the CPU and its features."""

from __future__ import annotations

import json

import typer


def doctor(as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON.")) -> None:
    """Which kernels k3 uses here (native or the torch fallback, and why), torch and threads, the CPU."""
    from k3.ops.doctor import diagnose, render

    report = diagnose()
    print(json.dumps(report, indent=2) if as_json else render(report))
