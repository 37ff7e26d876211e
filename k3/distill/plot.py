"""PNG plots of distillation runs: per-teacher reverse KL and per-task held-out accuracy against teacher
tokens, one run or several side by side (on-policy vs off-policy at equal teacher budgets)."""

from __future__ import annotations

import math
from pathlib import Path

from k3.train.plot import _pyplot, read_log


def _points(log: dict, x: str, y: str) -> list[tuple[float, float]]:
    return [(a, b) for a, b in zip(log[x], log[y], strict=True) if not math.isnan(b)]


def plot_distill(runs: list[str | Path], out: str | Path | None = None) -> Path:
    """Top: reverse KL to each teacher (eval_rkl_*, the student's held-out samples); bottom: held-out
    accuracy per task; x: teacher tokens. Written to `out` (default RUN/distill.png of the first run)."""
    plt = _pyplot()
    runs = [Path(r) for r in runs]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    styles = ["-", "--", ":", "-."]
    for r, run in enumerate(runs):
        log = read_log(run)
        ls = styles[r % len(styles)]
        for col in (c for c in log if c.startswith("eval_rkl_")):
            pts = _points(log, "teacher_tokens", col)
            if pts:
                top.plot(*zip(*pts, strict=True), ls=ls, marker="o", ms=3, label=f"{run.name}: {col[9:]}")
        for col in (c for c in log if c.startswith("acc_") and c != "acc_mean"):
            pts = _points(log, "teacher_tokens", col)
            if pts:
                bottom.plot(*zip(*pts, strict=True), ls=ls, marker="o", ms=3, label=f"{run.name}: {col[4:]}")
    top.set(ylabel="reverse KL to teacher (nats/token)", title="distillation")
    bottom.set(xlabel="teacher tokens", ylabel="held-out accuracy (greedy)", ylim=(-0.02, 1.02))
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out = Path(out) if out is not None else runs[0] / "distill.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
