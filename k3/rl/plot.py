"""PNG plots of an RL run's log: reward and held-out accuracy per iteration; KL and engine/trainer
mismatch. (`k3 train plot RUN` reads the same CSV and draws its loss.)"""

from __future__ import annotations

import math
from pathlib import Path

from k3.train.plot import _pyplot, read_log


def _line(ax, log, column, **kw):
    if column not in log:  # (an older log)
        return
    pts = [(s, v) for s, v in zip(log["step"], log[column], strict=True) if not math.isnan(v)]
    if pts:
        ax.plot(*zip(*pts, strict=True), **kw)


def plot_rl(run_dir: str | Path) -> list[Path]:
    plt = _pyplot()
    run_dir = Path(run_dir)
    log = read_log(run_dir)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    _line(top, log, "score", lw=1, label="train score (share right)")
    _line(top, log, "eval_acc", marker="o", lw=1.5, label="held-out accuracy (greedy)")
    _line(top, log, "eval_sampled", marker="s", lw=1, label="held-out accuracy (sampled, rollout T)")
    top.set(ylabel="reward / accuracy", title=f"RL: {run_dir.name}")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    _line(bottom, log, "kl", lw=1, label="KL(pi_v || pi_v+1), k3")
    _line(bottom, log, "logprob_diff_max", lw=1, label="max |trainer - engine| logprob")
    bottom.set(xlabel="iteration", ylabel="nats", yscale="symlog", xlim=(0, None))
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    out = run_dir / "rl.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [out]
