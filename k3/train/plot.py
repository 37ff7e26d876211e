"""PNG plots of training logs (matplotlib, headless): loss, learning rate, expert load balance."""

from __future__ import annotations

import csv
from pathlib import Path

LOG_FILE = "log.csv"


def read_log(path: str | Path) -> dict[str, list[float]]:
    """A training CSV as columns of floats (empty cells become NaN)."""
    path = Path(path)
    if path.is_dir():
        path = path / LOG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no training log")
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{path}: the log has no rows yet")
    return {key: [float(row[key]) if row[key] else float("nan") for row in rows] for key in rows[0]}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def layer_columns(log: dict[str, list[float]]) -> list[str]:
    """The per-layer load columns `load_max_over_mean_L{i}`, in layer order."""
    cols = [c for c in log if c.startswith("load_max_over_mean_L")]
    return sorted(cols, key=lambda c: int(c.rsplit("L", 1)[1]))


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write `loss.png` and `load_balance.png` (max/mean expert load per MoE layer) into the run folder."""
    plt = _pyplot()
    run_dir = Path(run_dir)
    log = read_log(run_dir)
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(log["step"], log["loss"], lw=1)
    ax.set(xlabel="step", ylabel="training loss", title=f"loss: {run_dir.name}")
    ax.grid(alpha=0.3)
    if "lr" in log:
        twin = ax.twinx()
        twin.plot(log["step"], log["lr"], color="gray", lw=0.8, ls="--")
        twin.set_ylabel("learning rate", color="gray")
    fig.tight_layout()
    written.append(run_dir / "loss.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    layers = layer_columns(log)
    if layers:
        fig, ax = plt.subplots(figsize=(7, 4))
        for col in layers:
            ax.plot(log["step"], log[col], lw=0.8, label=col.removeprefix("load_max_over_mean_"))
        ax.plot(log["step"], log["max_over_mean_load"], color="black", lw=1.5, label="worst layer")
        ax.axhline(1.0, color="gray", lw=0.5)
        ax.set(xlabel="step", ylabel="max / mean expert load", title=f"expert load balance: {run_dir.name}")
        ax.legend(fontsize=7, ncol=3)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        written.append(run_dir / "load_balance.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def plot_comparison(
    series: dict[str, dict[str, list[float]]], column: str, out: str | Path, ylabel: str, title: str
) -> Path:
    """One line per run (label -> log) of `column` against step; for benchmarks comparing methods."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, log in series.items():
        ax.plot(log["step"], log[column], lw=1, label=label)
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
