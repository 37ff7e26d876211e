"""MQAR accuracy against sequence length: the K3 hybrid (3 KDA : 1 MLA) vs all-MLA vs all-KDA.

Three 4-layer models derived from the `tiny` preset differ only in their mixers: `hybrid` = KDA, KDA, KDA,
MLA (K3's pattern), `mla` = four MLA layers, `kda` = four KDA layers. Everything else (width 64, the dense
first layer, latent MoE with 8 experts top-2, AttnRes, vocabulary) is the same, so parameter counts differ
only by the attention weights (reported). Each (model, length) pair is trained from the same seed on MQAR
(Zoology-style; `--kv-pairs` key-value pairs per sequence, default `seq_len / 16`) with quantile
balancing, then evaluated on 4 held-out batches (the trainer's default). Runs go longest-first, `--jobs`
at a time, each on one torch thread. Writes benchmarks/results/train_mqar.csv and train_mqar.png (final
accuracy against length, and held-out accuracy against step for every run).

    .venv/bin/python benchmarks/train_mqar.py [--steps 300] [--lengths 64 128] [--kv-pairs 4] [--jobs 1]
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
LAYERS = 4
PATTERNS = {"hybrid": "KKKM", "mla": "MMMM", "kda": "KKKK"}


def write_config(pattern: str, vocab: int, path: Path) -> Path:
    raw = json.loads(resources.files("k3").joinpath("presets", "tiny.json").read_text())
    text = raw["text_config"]
    text["num_hidden_layers"] = len(pattern)
    text["vocab_size"] = vocab
    text["linear_attn_config"]["kda_layers"] = [i + 1 for i, c in enumerate(pattern) if c == "K"]
    text["linear_attn_config"]["full_attn_layers"] = [i + 1 for i, c in enumerate(pattern) if c == "M"]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw, indent=1))
    return path / "config.json"


def parameter_count(config: Path) -> int:
    from k3.census import census_of

    return census_of(str(config)).to_json()["total_params"]


def wait_for(run: tuple) -> tuple[str, int, int, Path, float]:
    """Wait for one training subprocess; return its (arch, length, kv pairs, run folder, wall seconds)."""
    arch, length, pairs, out, process, started = run
    if process.wait() != 0:
        raise SystemExit(f"the {arch} run at seq_len {length} failed")
    seconds = time.perf_counter() - started
    print(f"done {arch} seq_len {length} in {seconds:.0f} s", flush=True)
    return arch, length, pairs, out, seconds


def kv_text(kv_pairs: int) -> str:
    return f"{kv_pairs} kv pairs" if kv_pairs else "kv pairs = length / 16"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--kv-pairs", type=int, default=0, help="key-value pairs (0: seq_len / 16)")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        configs = {
            arch: write_config(p, args.vocab, Path(tmp) / f"cfg-{arch}") for arch, p in PATTERNS.items()
        }
        jobs = []
        for length in sorted(args.lengths, reverse=True):  # longest first: the slowest runs overlap
            pairs = args.kv_pairs or length // 16
            for arch, config in configs.items():
                out = Path(tmp) / f"{arch}-{length}"
                command = [
                    sys.executable, "-m", "k3.train.commands", "--preset", str(config), "--data", "mqar",
                    "--out", str(out), "--steps", str(args.steps), "--warmup", str(max(1, args.steps // 10)),
                    "--batch-size", str(args.batch_size), "--seq-len", str(length),
                    "--num-kv-pairs", str(pairs), "--lr", str(args.lr), "--seed", str(args.seed),
                    "--eval-every", str(args.eval_every), "--checkpoint-every", str(args.steps),
                    "--no-export", "--quiet", "--threads", "1",
                ]  # fmt: skip
                jobs.append((arch, length, pairs, out, command))
        running: list[tuple[str, int, int, Path, subprocess.Popen, float]] = []
        finished = []
        for arch, length, pairs, out, command in jobs:
            while len(running) >= args.jobs:
                finished.append(wait_for(running.pop(0)))
            print(f"start {arch} seq_len {length}", flush=True)
            started = time.perf_counter()
            running.append((arch, length, pairs, out, subprocess.Popen(command, cwd=ROOT), started))
        finished.extend(wait_for(run) for run in running)
        from k3.train.plot import read_log

        curves = {}
        for arch, length, pairs, out, seconds in finished:
            log = read_log(out)
            evaluated = [(s, a) for s, a in zip(log["step"], log["eval_acc"], strict=True) if a == a]  # NaN
            curves[arch, length] = evaluated
            rows.append(
                {
                    "arch": arch,
                    "pattern": PATTERNS[arch],
                    "seq_len": length,
                    "kv_pairs": pairs,
                    "params": parameter_count(configs[arch]),
                    "steps": args.steps,
                    "eval_acc": log["eval_acc"][-1],
                    "best_eval_acc": max(a for _, a in evaluated),
                    "eval_loss": log["eval_loss"][-1],
                    "train_loss_last_10": sum(log["loss"][-10:]) / 10,
                    "chance_acc": 1 / (args.vocab - args.vocab // 2),
                    "wall_s": seconds,
                }
            )
        rows.sort(key=lambda r: (r["seq_len"], list(PATTERNS).index(r["arch"])))
    with (RESULTS / "train_mqar.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: f"{v:.4f}" if isinstance(v, float) else v for k, v in row.items()})
            print(row)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, curve_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for arch in PATTERNS:
        mine = sorted((r["seq_len"], r["eval_acc"]) for r in rows if r["arch"] == arch)
        params = next(r["params"] for r in rows if r["arch"] == arch)
        ax.plot(
            *zip(*mine, strict=True),
            marker="o",
            label=f"{arch} ({PATTERNS[arch]}, {params / 1e3:.0f}K params)",
        )
    ax.axhline(rows[0]["chance_acc"], color="gray", lw=0.5, ls="--", label="chance")
    ax.set(
        xlabel=f"sequence length ({kv_text(args.kv_pairs)})",
        ylabel="held-out MQAR accuracy",
        title=f"MQAR after {args.steps} steps of {args.batch_size} sequences",
        xscale="log",
    )
    ax.set_xticks(args.lengths, [str(n) for n in args.lengths])
    ax.minorticks_off()  # only the measured lengths on the log axis
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    for (arch, length), points in sorted(curves.items()):
        style = "-" if length == max(args.lengths) else "--"
        color = f"C{list(PATTERNS).index(arch)}"
        curve_ax.plot(*zip(*points, strict=True), style, color=color, label=f"{arch}, length {length}")
    curve_ax.axhline(rows[0]["chance_acc"], color="gray", lw=0.5, ls="--")
    curve_ax.set(xlabel="optimizer step", ylabel="held-out MQAR accuracy", title="Learning curves")
    curve_ax.legend(fontsize=8)
    curve_ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / "train_mqar.png", dpi=110)


if __name__ == "__main__":
    main()
