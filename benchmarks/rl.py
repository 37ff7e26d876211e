"""RL on a briefly supervised tiny model: K2 loss vs GRPO vs ReST at equal samples, partial vs full rollouts.

    nice -n 10 python benchmarks/rl.py --base benchmarks/results/_rl_runs/base --seeds 0,1,2 --name rl_final

Every method starts from the same SFT policy and draws the same prompts (seeded by iteration), `prompts` x
`samples` samples per iteration, so the number of samples is equal by construction. Each run is a plain
`k3 rl` run folder under benchmarks/results/_rl_runs/NAME/; this script runs them (in parallel processes),
then writes benchmarks/results/NAME.csv (one row per run: held-out accuracy before and after, samples,
wall-clock, machine load) and NAME.png (held-out accuracy per iteration; reward against wall-clock seconds).
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
RUNS = RESULTS / "_rl_runs"


def method_args(method: str, partial_budget: int) -> list[str]:
    if method == "k2_partial":
        return ["--loss", "k2", "--partial-budget", str(partial_budget)]
    return ["--loss", method]


def run(name: str, method: str, seed: int, a: argparse.Namespace) -> Path:
    out = RUNS / a.name / name
    cmd = [
        "nice",
        "-n",
        "10",
        sys.executable,
        "-m",
        "k3",
        "rl",
        "--init",
        a.base,
        "--task",
        a.task,
        "--digits",
        str(a.digits),
    ]
    cmd += ["--out", str(out), "--iterations", str(a.iterations), "--prompts", str(a.prompts)]
    cmd += ["--samples", str(a.samples), "--seed", str(seed), "--lr", str(a.lr), "--tau", str(a.tau)]
    cmd += [
        "--temperature",
        str(a.temperature),
        "--warmup",
        str(a.warmup),
        "--minibatches",
        str(a.minibatches),
    ]
    cmd += ["--max-batch", str(a.prompts * a.samples)]
    cmd += ["--eval-every", str(a.eval_every), "--held-out", str(a.held_out), "--threads", "1", "--quiet"]
    cmd += method_args(method, a.partial_budget)
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return out


def read(path: Path, at: int = 0) -> list[dict]:
    """A run's log rows (iteration 0, the base, first), up to iteration `at` (0: all)."""
    with (path / "log.csv").open(newline="") as f:
        return [r for r in csv.DictReader(f) if not at or int(r["step"]) <= at]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="policy folder from `k3 rl sft`")
    p.add_argument("--task", default="arithmetic", help="a `k3 rl --task`, e.g. arithmetic@long")
    p.add_argument("--digits", type=int, default=2)
    p.add_argument("--partial-budget", type=int, default=2, help="tokens per iteration of k2_partial")
    p.add_argument("--iterations", type=int, default=16)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--tau", type=float, default=0.1)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--held-out", type=int, default=400)
    p.add_argument("--methods", default="k2,grpo,rest,k2_partial")
    p.add_argument("--seeds", default="0")
    p.add_argument("--jobs", type=int, default=3)
    p.add_argument("--name", default="rl", help="results: NAME.csv, NAME.png, _rl_runs/NAME/")
    p.add_argument("--replot", action="store_true", help="only redraw NAME.png from the run folders")
    p.add_argument("--summary", action="store_true", help="only rewrite NAME.csv and NAME.png (no runs)")
    p.add_argument("--at", type=int, default=0, help="with --summary: each log up to this iteration")
    p.add_argument("--load", default="", help="with --summary: the load column's text")
    a = p.parse_args()
    jobs = [(f"{m}_s{s}", m, int(s)) for s in a.seeds.split(",") for m in a.methods.split(",")]
    if a.replot or a.summary:
        outs = [RUNS / a.name / name for name, _, _ in jobs]
        if a.summary:
            summarise(jobs, outs, a.name, a.load, a.at)
        plot(jobs, outs, RESULTS / f"{a.name}.png", a.at)
        return
    load_before = os.getloadavg()
    with ThreadPoolExecutor(a.jobs) as pool:
        outs = list(pool.map(lambda j: run(*j, a), jobs))
    after = os.getloadavg()
    load = f"{load_before[0]:.1f}/{load_before[1]:.1f} -> {after[0]:.1f}/{after[1]:.1f}"
    summarise(jobs, outs, a.name, load)
    plot(jobs, outs, RESULTS / f"{a.name}.png")


def summarise(jobs, outs, name: str, load: str, at: int = 0) -> None:
    """NAME.csv: one row per run (held-out accuracy before and after, samples, time, reward per second)
    of its log up to iteration `at` (0: all of it)."""
    rows = []
    for (name_, method, seed), out in zip(jobs, outs, strict=True):
        log = read(out, at)
        last5 = log[1:][-5:]
        evals = [r for r in log if r["eval_acc"]]
        rows.append(
            {
                "run": name_,
                "method": method,
                "seed": seed,
                "eval_acc_before": evals[0]["eval_acc"],
                "eval_acc_after": evals[-1]["eval_acc"],
                "eval_acc_best": max(float(r["eval_acc"]) for r in evals),
                "eval_sampled_before": evals[0].get("eval_sampled", ""),
                "eval_sampled_after": evals[-1].get("eval_sampled", ""),
                "train_score_first3": sum(float(r["score"] or 0) for r in log[1:4]) / 3,
                "samples": log[-1]["samples"],
                "elapsed_s": log[-1]["elapsed_s"],
                "mean_train_score_last5": sum(float(r["score"] or 0) for r in last5) / len(last5),
                "max_logprob_diff": max(float(r["logprob_diff_max"] or 0) for r in log[1:]),
                "mean_expert_flips": sum(float(r["expert_flips"] or 0) for r in log[1:]) / (len(log) - 1),
                "reward_per_s": reward_sum(log) / float(log[-1]["elapsed_s"]),
                "load_1m_5m": load,
            }
        )
    with (RESULTS / f"{name}.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    for r in rows:
        print(r)


def reward_sum(log: list[dict]) -> float:
    """Total reward of the samples trained on (each row's mean reward x the samples it trained)."""
    total, before = 0.0, 0
    for r in log[1:]:
        n = int(r["samples"]) - before
        total, before = total + n * float(r["reward"] or 0), int(r["samples"])
    return total


def plot(jobs, outs, path: Path, at: int = 0) -> None:
    """Held-out accuracy, greedy and sampled, per iteration (mean over seeds, thin lines: each seed); the
    reward of the samples trained on, summed, against wall-clock seconds (each run)."""
    from k3.train.plot import _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    methods = list(dict.fromkeys(m for _, m, _ in jobs))
    colors = dict(zip(methods, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    logs = {name: read(out, at) for (name, _, _), out in zip(jobs, outs, strict=True)}
    for column, ax in (("eval_acc", axes[0]), ("eval_sampled", axes[1])):
        for m in methods:
            runs = [
                [(int(r["step"]), float(r[column])) for r in logs[n] if r.get(column)]
                for n, mm, _ in jobs
                if mm == m
            ]
            for pts in runs:
                ax.plot(*zip(*pts, strict=True), color=colors[m], lw=0.6, alpha=0.4)
            steps = [s for s, _ in runs[0]]
            mean = [sum(dict(r)[s] for r in runs) / len(runs) for s in steps]
            ax.plot(steps, mean, color=colors[m], marker="o", lw=2, label=f"{m} (mean of {len(runs)})")
    for name, m, _ in jobs:
        total, before, pts = 0.0, 0, [(0.0, 0.0)]
        for r in logs[name][1:]:
            total += (int(r["samples"]) - before) * float(r["reward"] or 0)
            before = int(r["samples"])
            pts.append((float(r["elapsed_s"]), total))
        axes[2].plot(
            *zip(*pts, strict=True), color=colors[m], lw=1, label=m if name.endswith("_s0") else None
        )
    axes[0].set(xlabel="iteration", ylabel="accuracy", title="held-out accuracy, greedy")
    axes[1].set(xlabel="iteration", ylabel="accuracy", title="held-out accuracy, 4 samples at rollout T")
    axes[2].set(xlabel="wall-clock seconds (rollouts + update + eval)", ylabel="reward summed",
                title="reward of trained samples vs time")  # fmt: skip
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
