"""Multi-teacher distillation experiment on tiny: specialists built with k3 (`k3 distill teachers`: a base
fine-tuned on the mixture of all tasks, then one specialist per task and effort), one student (the base)
distilled from all of them on-policy, against off-policy distillation (SFT on the teachers' samples) at
about equal teacher tokens, RL on all tasks at once at equal samples, and the teachers' averaged weights.

    nice -n 10 python benchmarks/distill.py --out runs/distill-exp [--only M] [--iterations 200 ...]

Writes OUT/teachers/ (base + specialists), OUT/{on-policy,off-policy,rl,average}/ (run folders),
benchmarks/results/distill.csv (one row per model: held-out accuracy per task, teacher tokens, elapsed
seconds, final reverse KL per teacher), distill_<method>_log.csv (each run's log) and distill.png.
Everything is resumable: a rerun reuses finished teachers and resumes runs.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import time
from pathlib import Path

from k3.rl.distill_config import DistillConfig
from k3.rl.distill_loop import train_distill
from k3.rl.distill_teachers import make_teachers

RESULTS = Path(__file__).parent / "results"
METHODS = ("on-policy", "off-policy", "rl", "average")


def accuracy(source: str, tasks: list[str], held_out: int, digits: int) -> dict:
    """Greedy held-out accuracy of a checkpoint or policy folder on each task."""
    from k3.engine.generate import Engine
    from k3.rl.codec import CharCodec
    from k3.rl.distill import load_teacher
    from k3.rl.distill_loop import make_tasks
    from k3.rl.trainer import held_out_accuracy

    model = load_teacher(source)
    engine, codec = Engine(model, max_batch=64), CharCodec(model.config.vocab_size)
    dc = DistillConfig(held_out=held_out, digits=digits)
    return {
        f"acc_{t}": held_out_accuracy(engine, task, codec, 0) for t, task in make_tasks(dc, tasks).items()
    }


def last_eval(run: Path) -> dict:
    with (run / "log.csv").open(newline="") as f:
        return [r for r in csv.DictReader(f) if r["acc_mean"]][-1]


def plot(out: Path, png: Path, teachers: list[str]) -> None:
    from k3.rl.distill_plot import _points
    from k3.train.plot import _pyplot, read_log

    def line(ax, log, x, y, **style):
        pts = _points(log, x, y)
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", ms=3, **style)

    plt = _pyplot()
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.5))
    on = read_log(out / "on-policy")
    for t in teachers:
        line(a, on, "step", f"eval_rkl_{t}", label=t)
    a.set(title="on-policy: reverse KL to each teacher", xlabel="iteration", ylabel="nats / token (held out)")
    for method, ls in (("on-policy", "-"), ("off-policy", "--"), ("rl", ":")):
        log = read_log(out / method)
        if method != "rl":  # RL spends no teacher tokens
            line(b, log, "teacher_tokens", "acc_mean", ls=ls, label=method)
        line(c, log, "elapsed_s", "acc_mean", ls=ls, label=method)
    b.set(title="mean held-out accuracy vs teacher tokens", xlabel="teacher tokens", ylabel="accuracy")
    c.set(title="mean held-out accuracy vs compute", xlabel="training seconds (2 shared cores)")
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/distill-exp")
    ap.add_argument("--tasks", default="arithmetic@no,arithmetic@long,sort,recall")
    ap.add_argument("--base-steps", type=int, default=150, help="SFT steps of the base on the task mixture")
    ap.add_argument("--steps", type=int, default=300, help="SFT steps per specialist, from the base")
    ap.add_argument("--sft-lr", type=float, default=1e-2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=64, help="per domain per iteration (rl: half, K = 2)")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--rl-lr", type=float, default=1e-3, help="--method rl's (at 1e-2 it collapsed)")
    ap.add_argument("--constant", action="store_true", help="no cosine decay of the lr after the warm-up")
    ap.add_argument("--minibatches", type=int, default=4, help="optimizer steps per iteration")
    ap.add_argument("--warmup", type=int, default=DistillConfig.warmup, help="optimizer steps of lr warm-up")
    ap.add_argument("--divergence", default="forward", help="on-policy GKD: reverse (beta 1) or forward KL")
    ap.add_argument("--sampled", action="store_true", help="on-policy with the sampled-token estimate")
    ap.add_argument("--held-out", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--digits", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default="", help="one of teachers, on-policy, off-policy, rl, average, table")
    args = ap.parse_args()
    out, tasks = Path(args.out), args.tasks.split(",")
    specs = make_teachers(
        out / "teachers", tasks, steps=args.steps, batch_size=args.batch_size, lr=args.sft_lr,
        digits=args.digits, threads=args.threads, base_steps=args.base_steps, held_out=args.held_out,
    )  # fmt: skip
    base = str(out / "teachers" / "base" / "policy")
    common = dict(
        student=base, teachers=specs, iterations=args.iterations, lr=args.lr, warmup=args.warmup,
        minibatches=args.minibatches, cosine=not args.constant,
        held_out=args.held_out, eval_every=args.eval_every, eval_samples=16, digits=args.digits,
        threads=args.threads,
    )  # fmt: skip
    per_method = {
        "on-policy": dict(
            prompts=args.prompts, samples=1, full_vocab=not args.sampled, divergence=args.divergence
        ),
        "off-policy": dict(prompts=args.prompts, samples=1),
        "rl": dict(prompts=args.prompts // 2, samples=2, lr=args.rl_lr),
        "average": dict(prompts=args.prompts, samples=1),
    }
    for method in METHODS:
        if args.only in ("", method):
            began = time.time()
            dc = DistillConfig(method=method, out=str(out / method), **{**common, **per_method[method]})
            train_distill(dc, on_iteration=lambda r, m=method: print(m, r, flush=True))
            print(f"{method}: {time.time() - began:.0f} s wall, load {os.getloadavg()}", flush=True)
    if args.only not in ("", "table"):
        return
    teachers = [s.split("=")[0] for s in specs]
    rows = [{"model": "base (the student at step 0)", **accuracy(base, tasks, args.held_out, args.digits)}]
    for spec in specs:
        name, source = spec.split("=")[0], spec.split("=", 1)[1].rsplit(":", 1)[0]
        rows.append({"model": f"specialist {name}", **accuracy(source, tasks, args.held_out, args.digits)})
    RESULTS.mkdir(exist_ok=True)
    for method in METHODS:
        last = last_eval(out / method)
        rows.append(
            {
                "model": f"student {method}" if method != "average" else "teachers' weights averaged",
                **{k: last[k] for k in last if k.startswith("acc_") and k != "acc_mean"},
                "acc_mean": last["acc_mean"],
                "iterations": last["step"],
                "teacher_tokens": last["teacher_tokens"],
                "student_tokens": last["student_tokens"],
                "elapsed_s": last["elapsed_s"],
                **{k: last[k] for k in last if k.startswith("eval_rkl_")},
            }
        )
        shutil.copy(out / method / "log.csv", RESULTS / f"distill_{method.replace('-', '_')}_log.csv")
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with (RESULTS / "distill.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    plot(out, RESULTS / "distill.png", teachers)
    for r in rows:
        print(r)
    print("load:", os.getloadavg())


if __name__ == "__main__":
    main()
