"""Multi-teacher distillation experiment on tiny: specialists built with k3 (`k3 distill teachers`: a base
fine-tuned on the mixture of all tasks, then one specialist per task and effort), one student (the base)
distilled from all of them. The arms share a short off-policy warm start (`--warm-start` iterations of
SFT on the teachers' samples: the on-policy recipe's SFT'd start), then go on off-policy, or on-policy with
the reverse KL (full vocabulary, GKD beta = 1; or the sampled-token policy gradient), or the forward KL;
beside them the reverse KL from the base without a warm start (`reverse-cold`), RL on all tasks at once
at equal samples, and the teachers' averaged weights. Round 4 (on-policy vs off-policy at equal teacher
tokens): `kd` (off-policy, the forward KL to the teacher's whole distribution at its own samples) and
`forward-cold` (on-policy forward KL) from the base, `--seed N` replicates; arithmetic@long alone
(`--tasks arithmetic@long --teachers OUT/teachers`), with `--robust` its teacher one that continues right
after a wrong scratchpad digit (`--only robust-teacher` builds it); benchmarks/distill_onoff.py counts
the comparisons and benchmarks/distill_probe.py measures where the on-policy tokens land. Round 5:
`--tasks arithmetic@fix --robust` (a `<` takes back a digit; the robust teacher takes back wrong ones),
`--tasks arithmetic-either` (two ways to answer, one hard) with `sampled-seq` (`--kl-discount 1`), and
`--eval-samples 100` for the T = 1 accuracy of every evaluation. Round 6: `reverse-seq-bn` (the
full-vocabulary sequence-level reverse KL with a baseline, length-normalized); `--warm-start` per seed
where distill_onoff.rule_branch puts it.

    PYTHONPATH=. nice -n 10 python benchmarks/distill.py --out runs/distill-exp --only RUN   # each RUN
    PYTHONPATH=. python benchmarks/distill.py --out runs/distill-exp --only table
    PYTHONPATH=. python benchmarks/distill.py --out runs/distill-exp/along-robust --teachers \
      runs/distill-exp/teachers --tasks arithmetic@long --robust --warm-start 60 --only forward

Writes OUT/teachers/ (base + specialists), OUT/<run>/ (run folders), benchmarks/results/distill.csv (one
row per model: held-out accuracy per task, teacher tokens, elapsed seconds, final reverse KL per
teacher), distill_<run>_log.csv (each run's log), distill_equal_tokens.csv and
distill_equal_tokens_long.csv (the arms' accuracy at each shared evaluation, with their teacher tokens)
and distill.png. Everything is resumable: a rerun reuses finished teachers and resumes runs.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import time
from pathlib import Path

from k3.distill.config import DistillConfig
from k3.distill.loop import train_distill
from k3.distill.specialists import make_teachers

RESULTS = Path(__file__).parent / "results"


def accuracy(source: str, tasks: list[str], held_out: int, digits: int) -> dict:
    """Greedy held-out accuracy of a checkpoint or policy folder on each task."""
    from k3.distill.loop import make_tasks
    from k3.distill.teachers import load_teacher
    from k3.engine.generate import Engine
    from k3.rl.evaluation import held_out_accuracy
    from k3.tasks.codec import CharCodec

    model = load_teacher(source)
    engine, codec = Engine(model, max_batch=64), CharCodec(model.config.vocab_size)
    dc = DistillConfig(held_out=held_out, digits=digits)
    return {
        f"acc_{t}": held_out_accuracy(engine, task, codec, 0) for t, task in make_tasks(dc, tasks).items()
    }


def evals(run: Path) -> list[dict]:
    """The log rows that hold a held-out evaluation."""
    with (run / "log.csv").open(newline="") as f:
        return [r for r in csv.DictReader(f) if r["acc_mean"]]


def robust_teacher(teachers: Path, task: str, args) -> Path:
    """TEACHERS/<task>-robust/checkpoint (built once): the specialist of `task` (arithmetic@long or @fix)
    fine-tuned `--robust-steps` more steps with `--pad-noise` of its problems given one wrong digit that is
    not trained on (k3.tasks.effort.plant_pad_noise), so that it continues right after a wrong digit, as the
    student's own mistakes will have it: at @long the true columns and sum after a wrong scratchpad digit,
    at @fix an erasure of the wrong digit and the true one."""
    from k3.rl.export import export_run
    from k3.rl.sft import SFTConfig, sft

    root = teachers / f"{task}-robust"
    if not (root / "checkpoint" / "config.json").is_file():
        config = SFTConfig(
            init=str(teachers / task / "sft" / "policy"), task=task, out=str(root),
            steps=args.robust_steps, batch_size=args.batch_size, lr=3e-3, warmup=20, digits=args.digits,
            eval_every=args.robust_steps // 2, held_out=args.held_out, threads=args.threads,
            pad_noise=args.pad_noise,
        )  # fmt: skip
        run = sft(config, on_step=lambda r: print(r, flush=True) if r.get("eval_acc") else None)
        export_run(run / "policy", root / "checkpoint")
    return root / "checkpoint"


def keep_and_print(run: Path, row: dict, keep: set[int]) -> None:
    """Print the log row; copy the checkpoint of an iteration in `keep` to RUN/keep (the run keeps only
    its newest two: at iteration N + 1's row, N's is the older one)."""
    print(run.name, row, flush=True)
    step = int(row["step"]) - 1
    src, dst = run / "checkpoints" / f"step-{step:08d}", run / "keep" / f"step-{step:08d}"
    if step in keep and src.is_dir() and not dst.exists():
        shutil.copytree(src, dst)


def equal_tokens(out: Path, runs: list[str], path: Path) -> None:
    """One row per evaluated iteration that every run shares: each run's teacher tokens so far and its
    mean and per-task held-out accuracy (the runs draw the same prompts, so their teacher tokens agree to
    within the answers' lengths)."""
    logs = {run: {r["step"]: r for r in evals(out / run)} for run in runs}
    steps = [s for s in logs[runs[0]] if all(s in log for log in logs.values())]
    rows = []
    for step in steps:
        row = {"iteration": step}
        for run in runs:
            r = logs[run][step]
            row[f"{run}_teacher_tokens"] = r["teacher_tokens"]
            row.update({f"{run}_{k}": r[k] for k in r if k.startswith("acc_")})
        rows.append(row)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plot(out: Path, png: Path, runs: list[str], teachers: list[str]) -> None:
    """The reverse-KL student's reverse KL to each teacher; mean held-out accuracy against teacher tokens
    for the runs branching at the warm start, at the late one (and without one), and the 300-iteration
    runs; accuracy against training seconds for every run."""
    from k3.distill.plot import _points
    from k3.train.plot import _pyplot, read_log

    def line(ax, run, x, y, **style):
        pts = _points(read_log(out / run), x, y)
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", ms=2.5, **style)

    plt = _pyplot()

    def color(run: str):  # one colour per run in every panel: tab20's dark shades, then its light ones
        i = list(RUNS).index(run)
        return plt.get_cmap("tab20")((2 * i) % 20 + (2 * i) // 20)

    fig, ((a, b, c), (d, e, f)) = plt.subplots(2, 3, figsize=(20, 10))
    for t in teachers:
        line(a, "reverse", "step", f"eval_rkl_{t}", label=t)
    a.set(title="reverse-KL student (warm start 40): reverse KL to each teacher", xlabel="iteration",
          ylabel="nats / token (held out)")  # fmt: skip
    groups = {
        b: ("branching at the warm start (iteration 40)",
            ("off-policy", "reverse", "sampled", "reverse-slow", "off-policy-slow", "forward")),
        c: ("late warm start (iteration 100), and none (round 4: forward-cold, kd)",
            ("off-policy", "reverse-late", "sampled-late", "reverse-cold", "reverse-cold-slow",
             "forward-cold", "kd")),
        d: ("300 iterations, branching at 100, lr 3e-3 after it",
            ("off-policy-long", "sampled-long", "reverse-long")),
    }  # fmt: skip
    for ax, (title, group) in groups.items():
        for run in group:
            if run in runs:
                line(ax, run, "teacher_tokens", "acc_mean", label=RUNS[run][0], color=color(run))
        ax.set(title=title, xlabel="teacher tokens", ylabel="mean held-out accuracy")
    for run in runs:
        if run != "average":
            line(e, run, "elapsed_s", "acc_mean", label=RUNS[run][0], color=color(run))
    e.set(title="mean held-out accuracy vs compute", xlabel="training seconds (2 shared cores, loaded)")
    f.axis("off")
    for ax in (a, b, c, d, e):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


ROBUST = ("arithmetic@long", "arithmetic@fix")  # the tasks that have a robust teacher (robust_teacher)


def _sequence_level(a, **extra) -> dict:
    """The full-vocabulary sequence-level reverse KL branching at the warm start, plus `extra`."""
    return dict(full_vocab=True, divergence="reverse", warm_start=a.warm_start, kl_discount=1.0, **extra)


# run name -> (label, its settings beyond the common ones); W: the shared off-policy warm start
RUNS = {
    "off-policy": ("off-policy (SFT on teacher samples)", lambda a: dict(method="off-policy")),
    "reverse": (
        "on-policy reverse KL, full vocabulary (GKD beta 1), warm start",
        lambda a: dict(full_vocab=True, divergence="reverse", warm_start=a.warm_start),
    ),
    "sampled": (
        "on-policy reverse KL, sampled-token policy gradient, warm start",
        lambda a: dict(warm_start=a.warm_start, lr=a.sampled_lr, warm_lr=a.lr),
    ),
    "reverse-late": (
        "on-policy reverse KL, full vocabulary, late warm start",
        lambda a: dict(full_vocab=True, divergence="reverse", warm_start=a.late_warm_start),
    ),
    "sampled-late": (
        "on-policy reverse KL, sampled tokens, late warm start",
        lambda a: dict(warm_start=a.late_warm_start, lr=a.sampled_lr, warm_lr=a.lr),
    ),
    "reverse-slow": (
        "on-policy reverse KL, full vocabulary, warm start, then lr 3e-3",
        lambda a: dict(
            full_vocab=True, divergence="reverse", warm_start=a.warm_start, lr=a.slow_lr, warm_lr=a.lr
        ),
    ),
    "off-policy-slow": (
        "off-policy, after the warm start lr 3e-3",
        lambda a: dict(method="off-policy", warm_start=a.warm_start, lr=a.slow_lr, warm_lr=a.lr),
    ),
    "forward": (
        "on-policy forward KL (GKD beta 0), warm start",
        lambda a: dict(full_vocab=True, divergence="forward", warm_start=a.warm_start),
    ),
    "reverse-cold": (
        "on-policy reverse KL, full vocabulary, from the base",
        lambda a: dict(full_vocab=True, divergence="reverse", iterations=a.cold_iterations, eval_every=20),
    ),
    "sampled-long": (
        "on-policy reverse KL, sampled tokens, late warm start, 300 iterations",
        lambda a: dict(
            warm_start=a.late_warm_start, lr=a.sampled_lr, warm_lr=a.lr, iterations=a.long_iterations
        ),
    ),
    "reverse-long": (
        "on-policy reverse KL, full vocabulary, late warm start, 300 iterations",
        lambda a: dict(
            full_vocab=True,
            divergence="reverse",
            warm_start=a.late_warm_start,
            lr=a.sampled_lr,
            warm_lr=a.lr,
            iterations=a.long_iterations,
        ),  # fmt: skip
    ),
    "off-policy-long": (
        "off-policy, 300 iterations, lr 3e-3 after iteration 100",
        lambda a: dict(
            method="off-policy",
            warm_start=a.late_warm_start,
            lr=a.sampled_lr,
            warm_lr=a.lr,
            iterations=a.long_iterations,
        ),  # fmt: skip
    ),
    "reverse-cold-slow": (
        "on-policy reverse KL, full vocabulary, from the base, lr 3e-3",
        lambda a: dict(
            full_vocab=True, divergence="reverse", iterations=a.cold_iterations, eval_every=20, lr=a.slow_lr
        ),
    ),
    "rl": (
        "RL on all tasks (reward only), warm start",
        lambda a: dict(
            method="rl", prompts=a.prompts // 2, samples=2, lr=a.rl_lr, warm_lr=a.lr, warm_start=a.warm_start
        ),
    ),
    "average": ("teachers' weights averaged", lambda a: dict(method="average")),
    # round 4: contexts (teacher's samples / student's) x target (one-hot / the teacher's distribution)
    "forward-cold": (
        "on-policy forward KL (GKD beta 0), from the base",
        lambda a: dict(full_vocab=True, divergence="forward"),
    ),
    "kd": (
        "off-policy forward KL to the teacher's distribution (supervised KD), from the base",
        lambda a: dict(method="off-policy", full_vocab=True, divergence="forward"),
    ),
    # round 5: each token credited with the rest of its sample's reverse KL (--kl-discount 1)
    "sampled-seq": (
        "on-policy reverse KL, sampled tokens, sequence-level (kl_discount 1), warm start",
        lambda a: dict(warm_start=a.warm_start, lr=a.sampled_lr, warm_lr=a.lr, kl_discount=1.0),
    ),
    "reverse-seq": (
        "on-policy reverse KL, full vocabulary, sequence-level (kl_discount 1), warm start",
        lambda a: _sequence_level(a),
    ),
    "reverse-seq-b": (
        "on-policy reverse KL, full vocabulary, sequence-level with a leave-one-out baseline, warm start",
        lambda a: _sequence_level(a, kl_baseline=True),
    ),
    # round 6: the same with MiniLLM's length normalization (seeds 6, 7 and 10 collapsed to 2-token answers)
    "reverse-seq-bn": (
        "on-policy reverse KL, full vocabulary, sequence-level, baseline, length-normalized, warm start",
        lambda a: _sequence_level(a, kl_baseline=True, kl_length_norm=True),
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/distill-exp")
    ap.add_argument("--tasks", default="arithmetic@no,arithmetic@long,sort,recall")
    ap.add_argument("--base-steps", type=int, default=150, help="SFT steps of the base on the task mixture")
    ap.add_argument("--steps", type=int, default=300, help="SFT steps per specialist, from the base")
    ap.add_argument("--sft-lr", type=float, default=1e-2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--warm-start", type=int, default=40, help="off-policy iterations the arms share first")
    ap.add_argument("--late-warm-start", type=int, default=100, help="the *-late runs' warm start")
    ap.add_argument("--long-iterations", type=int, default=300, help="sampled-long's")
    ap.add_argument("--cold-iterations", type=int, default=400, help="reverse-cold's (no warm start)")
    ap.add_argument("--prompts", type=int, default=64, help="per domain per iteration (rl: half, K = 2)")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--sampled-lr", type=float, default=3e-3, help="sampled-token runs' (1e-2 collapsed)")
    ap.add_argument("--slow-lr", type=float, default=3e-3, help="the *-slow runs' after the warm start")
    ap.add_argument("--rl-lr", type=float, default=1e-3, help="--method rl's (at 1e-2 it collapsed)")
    ap.add_argument("--constant", action="store_true", help="no cosine decay of the lr after the warm-up")
    ap.add_argument("--minibatches", type=int, default=4, help="optimizer steps per iteration")
    ap.add_argument("--warmup", type=int, default=DistillConfig.warmup, help="optimizer steps of lr warm-up")
    ap.add_argument("--held-out", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-samples", type=int, default=16, help="held-out prompts sampled per evaluation")
    ap.add_argument("--digits", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="problems, held-out set, sampling; run folder RUN-sN")
    ap.add_argument("--keep", default="", help="iterations whose checkpoints to keep (RUN/keep/step-N)")
    ap.add_argument("--teachers", default="", help="the teachers' folder (default OUT/teachers)")
    ap.add_argument("--robust", action="store_true", help="arithmetic@long's, @fix's teacher: the robust one")
    ap.add_argument("--pad-noise", type=float, default=0.5, help="the robust teacher's planted share")
    ap.add_argument("--robust-steps", type=int, default=400, help="the robust teacher's SFT steps")
    ap.add_argument("--only", default="", help=f"teachers, robust-teacher, table or a run: {', '.join(RUNS)}")
    args = ap.parse_args()
    out, tasks = Path(args.out), args.tasks.split(",")
    teachers_dir = Path(args.teachers or out / "teachers")
    specs = make_teachers(
        teachers_dir, tasks, steps=args.steps, batch_size=args.batch_size, lr=args.sft_lr,
        digits=args.digits, threads=args.threads, base_steps=args.base_steps, held_out=args.held_out,
    )  # fmt: skip
    if args.only == "robust-teacher" or args.robust:  # the teachers of arithmetic@long and @fix
        robust = {t: robust_teacher(teachers_dir, t, args) for t in ROBUST if t in tasks}
        specs = [
            next((f"{s.split('=')[0]}={robust[t]}:{t}" for t in robust if s.endswith(f":{t}")), s)
            for s in specs
        ]
    base = str(teachers_dir / "base" / "policy")
    common = dict(
        student=base, teachers=specs, iterations=args.iterations, lr=args.lr, warmup=args.warmup,
        minibatches=args.minibatches, cosine=not args.constant, prompts=args.prompts, samples=1,
        held_out=args.held_out, eval_every=args.eval_every, eval_samples=args.eval_samples,
        digits=args.digits, threads=args.threads, seed=args.seed,
    )  # fmt: skip
    keep = {int(k) for k in args.keep.split(",") if k}
    for run, (_, settings) in RUNS.items():
        if args.only == run:
            began = time.time()
            folder = out / (run + (f"-s{args.seed}" if args.seed else ""))
            dc = DistillConfig(out=str(folder), **{**common, **settings(args)})
            train_distill(dc, on_iteration=lambda r, f=folder: keep_and_print(f, r, keep))
            print(f"{run}: {time.time() - began:.0f} s wall, load {os.getloadavg()}", flush=True)
    if args.only != "table":
        return
    teachers = [s.split("=")[0] for s in specs]
    rows = [
        {"model": "base (the student at iteration 0)", **accuracy(base, tasks, args.held_out, args.digits)}
    ]
    for spec in specs:
        name, source = spec.split("=")[0], spec.split("=", 1)[1].rsplit(":", 1)[0]
        rows.append({"model": f"specialist {name}", **accuracy(source, tasks, args.held_out, args.digits)})
    RESULTS.mkdir(exist_ok=True)
    done = [run for run in RUNS if (out / run / "log.csv").is_file()]
    for run in done:
        last = evals(out / run)[-1]
        rows.append(
            {
                "model": RUNS[run][0],
                **{k: last[k] for k in last if k.startswith("acc_") and k != "acc_mean"},
                "acc_mean": last["acc_mean"],
                "iterations": last["step"],
                "teacher_tokens": last["teacher_tokens"],
                "student_tokens": last["student_tokens"],
                "elapsed_s": last["elapsed_s"],
                **{k: last[k] for k in last if k.startswith("eval_rkl_")},
            }
        )
        shutil.copy(out / run / "log.csv", RESULTS / f"distill_{run.replace('-', '_')}_log.csv")
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with (RESULTS / "distill.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    plot(out, RESULTS / "distill.png", done, teachers)
    arms = [
        r
        for r in (
            "off-policy",
            "reverse",
            "sampled",
            "reverse-late",
            "sampled-late",
            "reverse-slow",
            "off-policy-slow",
            "forward",
        )
        if r in done
    ]
    equal_tokens(out, arms, RESULTS / "distill_equal_tokens.csv")
    long = [r for r in ("off-policy-long", "sampled-long", "reverse-long") if r in done]
    if len(long) > 1:
        equal_tokens(out, long, RESULTS / "distill_equal_tokens_long.csv")
    for r in rows:
        print(r)
    print("load:", os.getloadavg())


if __name__ == "__main__":
    main()
