"""Expert load balance while training `mini`: quantile balancing vs the DeepSeek-V3 sign update vs none.

Same seed, same data (Python standard-library source text, tokenised with the built-in k3 BPE of the
model's vocabulary), same schedule; only the balance method differs (QB with the latest batch's bias,
QB with an EMA of it, DeepSeek's sign update, none; on request `qb_exact_ema`: QB run to its fixed point
on each batch, up to 64 rounds, instead of one round warm-started from the last bias, with an EMA of 0.5;
`qb_refresh`: the same fit, no EMA, on the step's batch routed again by the model after the optimizer
step, each router fitted just before it routes: `k3 train --balance-refresh`).
Each run is a `k3.train` run in its own process (one torch thread each by default). Then each final model
(router weights and bias as trained) routes a held-out batch of `--eval-batches` x batch tokens, large
enough that sampling noise stays small: that measures how well the learned bias balances the *expected*
loads. Writes to benchmarks/results/:

    train_balance.csv       per method: max/mean load after warm-up (worst layer and layer mean, per step),
                            the same on loads pooled over windows of steps, the sampling-noise floor of
                            one training batch; on the held-out batch, worst layer, layer mean and floor
    train_balance.png       worst-layer max/mean load against step, one line per method
    train_balance_runs/     the runs' log.csv and loads.csv (checkpoints and exports are not kept)

The noise floor is what perfectly balanced *expected* loads still show on one batch: T tokens, each
choosing k distinct experts uniformly at random; its max/mean is what a bias learned on earlier batches
can at best reach on a new batch of the same size.

    .venv/bin/python benchmarks/train_balance.py [--steps 80] [--batch-size 16] [--seq-len 128] [--jobs 2]
        [--preset mini]    (another preset writes train_balance_<preset>.* and train_balance_<preset>_runs/)
        [--accum N]        (N micro-batches per step, balanced as one batch: writes ..._accum<N>.*)
        [--methods qb none ...] [--threads 1 (per run)] [--name TAG (appended to the result files)]
        [--merge STEM ...] (no training: earlier results of these same options, e.g.
                            train_balance_accum32_x, side by side in one CSV and plot named by --name)
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
METHODS = {  # name -> k3 train options
    "qb": ["--balance", "qb"],
    "qb_ema": ["--balance", "qb", "--balance-ema", "0.9"],
    "qb_exact_ema": ["--balance", "qb", "--qb-iters", "64", "--balance-ema", "0.5"],
    "qb_refresh": ["--balance", "qb", "--qb-iters", "64", "--balance-refresh"],
    "deepseek": ["--balance", "deepseek"],
    "none": ["--balance", "none"],
}


def corpus(path: Path, max_bytes: int) -> Path:
    """Concatenated standard-library sources (the same bytes for every run on this Python)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for source in sorted(stdlib.glob("*.py")):
        text = source.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    path.write_text("".join(parts), encoding="utf-8")
    return path


def noise_floor(tokens: int, experts: int, k: int, trials: int = 200, seed: int = 0) -> float:
    """Mean max/mean load of uniformly random distinct top-k choices: the best a bias can do on one batch."""
    g = torch.Generator().manual_seed(seed)
    ratios = []
    for _ in range(trials):
        choice = torch.rand(tokens, experts, generator=g).topk(k, dim=1).indices
        loads = torch.bincount(choice.flatten(), minlength=experts).float()
        ratios.append(float(loads.max() / loads.mean()))
    return sum(ratios) / len(ratios)


def read_loads(path: Path) -> dict[int, list[torch.Tensor]]:
    """layer -> per-step loads [E], in step order."""
    out: dict[int, list[torch.Tensor]] = {}
    with path.open(newline="") as f:
        reader = csv.reader(f)
        next(reader)
        for _, layer, *loads in reader:
            out.setdefault(int(layer), []).append(torch.tensor([float(n) for n in loads]))
    return out


def summarise(run: Path, warmup: int, window: int) -> dict[str, float]:
    loads = read_loads(run / "loads.csv")
    per_step = []  # worst layer per step after warm-up
    layer_mean = []  # mean over layers per step after warm-up
    steps = len(next(iter(loads.values())))
    for s in range(warmup, steps):
        ratios = [float(v[s].max() / v[s].mean()) for v in loads.values()]
        per_step.append(max(ratios))
        layer_mean.append(sum(ratios) / len(ratios))
    pooled = []
    for start in range(warmup, steps - window + 1, window):
        ratios = []
        for v in loads.values():
            total = torch.stack(v[start : start + window]).sum(0)
            ratios.append(float(total.max() / total.mean()))
        pooled.append(max(ratios))
    tail = per_step[len(per_step) // 2 :]
    return {
        "worst_layer_max_over_mean": sum(per_step) / len(per_step),
        "layer_mean_max_over_mean": sum(layer_mean) / len(layer_mean),
        "worst_layer_max_over_mean_last_half": sum(tail) / len(tail),
        f"pooled_{window}_steps_worst_layer": sum(pooled) / len(pooled) if pooled else float("nan"),
    }


def final_model(run: Path):
    """(model, config, TrainConfig) of a `k3 train` run at its last checkpoint, in eval mode."""
    from k3.model import K3ForCausalLM
    from k3.train.state import list_checkpoints, load_model_state
    from k3.train.trainer import TrainConfig, load_model_config

    tc = TrainConfig(**json.loads((run / "train.json").read_text()))
    cfg = load_model_config(tc.preset)
    model = K3ForCausalLM.from_config(cfg, seed=tc.seed, quantized_experts=False)
    load_model_state(list_checkpoints(run)[-1][1], model)
    model.eval()
    return model, cfg, tc


def route(model, data, first_batch: int, batches: int) -> tuple[dict, dict]:
    """Router scores [N, E] and chosen experts [N, k] per MoE layer over `batches` batches of `data`."""
    from k3.model.routing import record_routing

    with torch.no_grad(), record_routing(model, weights=False) as trace:
        for index in range(first_batch, first_batch + batches):
            model(data.batch(index)[0])
    return (
        {layer: trace.scores(layer) for layer in trace.layers},
        {layer: trace.indices(layer) for layer in trace.layers},
    )


def held_out_balance(run: Path, eval_batches: int) -> dict[str, float]:
    """Route `eval_batches` held-out batches through the run's final model; max/mean of the summed loads."""
    from k3.train.routing import chosen_loads
    from k3.train.trainer import make_dataset

    model, cfg, tc = final_model(run)
    # the trainer's held-out stream: windows the run did not train on
    _, chosen = route(model, make_dataset(tc, cfg, stream=1), 0, eval_batches)
    loads = [chosen_loads(c, cfg.num_experts) for c in chosen.values()]
    ratios = [float(v.max() / v.mean()) for v in loads]
    return {"held_out_worst_layer": max(ratios), "held_out_layer_mean": sum(ratios) / len(ratios)}


def read_results(stem: str) -> tuple[list[dict], dict[str, dict[str, list[float]]]]:
    """An earlier run of this script: its CSV rows (values as floats) and its kept runs' logs."""
    from k3.train.plot import read_log

    path = RESULTS / f"{stem}.csv"
    if not path.is_file():
        raise SystemExit(f"--merge {stem}: no {path}")
    with path.open(newline="") as f:
        rows = [{k: v if k == "method" else float(v) for k, v in row.items()} for row in csv.DictReader(f)]
    return rows, {row["method"]: read_log(RESULTS / f"{stem}_runs" / row["method"]) for row in rows}


def merge_results(stems: list[str], floor: float) -> tuple[list[dict], dict]:
    """Earlier results side by side; refused unless they share tokens per step (noise floor) and schedule."""
    rows, logs = [], {}
    for stem in stems:
        stem_rows, stem_logs = read_results(stem)
        for row in stem_rows:
            if abs(row["noise_floor"] - floor) > 1e-4:
                raise SystemExit(f"--merge {stem}: noise floor {row['noise_floor']:.4f}, here {floor:.4f}")
        for method, log in stem_logs.items():
            if method in logs:
                raise SystemExit(f"--merge {stem}: {method} is already in an earlier stem")
            if logs and log["lr"] != next(iter(logs.values()))["lr"]:
                raise SystemExit(f"--merge {stem}: {method} ran another learning-rate schedule")
            logs[method] = log
        rows += stem_rows
    return rows, logs


def train_and_measure(args, cfg, floor: float, keep: Path) -> tuple[list[dict], dict]:
    """Run every method (`--jobs` at once), keep the logs, summarise them and route the held-out batch."""
    from k3.train.plot import read_log

    held_out_floor = noise_floor(  # the held-out set is eval_batches micro-batches
        args.batch_size * args.seq_len * args.eval_batches,
        cfg.num_experts,
        cfg.num_experts_per_token,
        trials=50,
    )
    with tempfile.TemporaryDirectory() as tmp:
        text = corpus(Path(tmp) / "stdlib.txt", max_bytes=2_000_000)
        running: list[tuple[str, subprocess.Popen]] = []
        for method in args.methods:
            command = [
                sys.executable, "-m", "k3.train.commands", "--preset", args.preset, "--data", str(text),
                "--out", str(Path(tmp) / method), "--steps", str(args.steps), "--warmup", str(args.warmup),
                "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--lr", str(args.lr),
                "--accum", str(args.accum),
                *METHODS[method], "--seed", str(args.seed), "--checkpoint-every", str(args.steps),
                "--no-export", "--quiet", "--threads", str(args.threads),
            ]  # fmt: skip
            while len(running) >= args.jobs:
                running.pop(0)[1].wait()
            print(f"start {method}", flush=True)
            running.append((method, subprocess.Popen(command, cwd=ROOT)))
        for method, process in running:
            if process.wait() != 0:
                raise SystemExit(f"the {method} run failed")
        logs = {}
        rows = []
        for method in args.methods:
            run = Path(tmp) / method
            target = keep / method
            target.mkdir(parents=True, exist_ok=True)
            for name in ("log.csv", "loads.csv"):
                shutil.copyfile(run / name, target / name)
            logs[method] = read_log(run)
            summary = summarise(run, args.warmup, args.window)
            final_loss = sum(logs[method]["loss"][-10:]) / len(logs[method]["loss"][-10:])
            held_out = held_out_balance(run, args.eval_batches)
            rows.append(
                {
                    "method": method,
                    **summary,
                    "loss_last_10": final_loss,
                    "noise_floor": floor,
                    **held_out,
                    "held_out_noise_floor": held_out_floor,
                }
            )
            print(f"{method}: held-out {held_out}", flush=True)
    return rows, logs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="mini", help="the model trained (a preset name)")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--eval-batches", type=int, default=16, help="held-out batches routed at the end")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--window", type=int, default=10, help="steps pooled for the pooled imbalance")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (--threads each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per step (one balance batch)")
    default_methods = ["qb", "qb_ema", "deepseek", "none"]
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=default_methods)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--name", default="", help="appended to the result files' names")
    parser.add_argument(
        "--merge", nargs="+", default=[], metavar="STEM", help="combine earlier results, no training"
    )
    args = parser.parse_args()

    from k3.config import K3Config
    from k3.train.plot import plot_comparison

    cfg = K3Config.preset(args.preset)
    stem = "train_balance" if args.preset == "mini" else f"train_balance_{args.preset}"
    if args.accum > 1:
        stem += f"_accum{args.accum}"
    if args.name:
        stem += f"_{args.name}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    batch_tokens = args.batch_size * args.seq_len * args.accum
    floor = noise_floor(batch_tokens, cfg.num_experts, cfg.num_experts_per_token)
    if stem in args.merge:  # the merged CSV would replace that stem's own, whose runs it no longer matches
        raise SystemExit(f"--merge {stem}: pick a --name that does not write over an input")
    if args.merge:
        rows, logs = merge_results(args.merge, floor)
    else:
        rows, logs = train_and_measure(args, cfg, floor, keep=RESULTS / f"{stem}_runs")

    plot_comparison(
        logs,
        "max_over_mean_load",
        RESULTS / f"{stem}.png",
        f"max / mean expert load (worst of {cfg.num_moe_layers} MoE layers)",
        f"{args.preset}, {batch_tokens} tokens/step: routing balance (noise floor {floor:.2f})",
    )
    with (RESULTS / f"{stem}.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: f"{v:.4f}" if isinstance(v, float) else v for k, v in row.items()})
    for row in rows:
        print(", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
