"""Multi-teacher distillation experiment on tiny: specialists built with k3 (`k3 distill teachers`), one
student distilled from all of them on-policy, against off-policy distillation (SFT on the teachers'
samples), the teachers' averaged weights and each specialist on its own task.

    python benchmarks/distill.py --out runs/distill-exp [--steps 40 --iterations 12 ...]

Writes OUT/teachers/<task>/checkpoint, OUT/{on-policy,off-policy,average}/ (run folders), and
benchmarks/results/distill.csv (one row per model: held-out accuracy per task, teacher tokens, final
reverse KL per teacher) and benchmarks/results/distill.png (k3 distill plot of the two trained runs).
Everything is resumable: a rerun reuses finished teachers and resumes runs.
"""

from __future__ import annotations

import argparse
import csv
import os
from pathlib import Path

from k3.rl.distill_loop import DistillConfig, train_distill
from k3.rl.distill_plot import plot_distill
from k3.rl.distill_teachers import make_teachers
from k3.rl.trainer import held_out_accuracy

RESULTS = Path(__file__).parent / "results"


def specialist_accuracy(spec: str, tasks: list[str], held_out: int, digits: int, seed: int) -> dict:
    from k3.engine.generate import Engine
    from k3.rl.codec import CharCodec
    from k3.rl.distill import load_teacher, parse_teacher
    from k3.rl.distill_loop import make_tasks

    s = parse_teacher(spec)
    model = load_teacher(s.source)
    engine = Engine(model, max_batch=64)
    dc = DistillConfig(held_out=held_out, digits=digits)
    codec = CharCodec(model.config.vocab_size)
    return {
        f"acc_{t}": held_out_accuracy(engine, task, codec, seed) for t, task in make_tasks(dc, tasks).items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/distill-exp")
    ap.add_argument("--tasks", default="arithmetic,sort,recall")
    ap.add_argument("--steps", type=int, default=40, help="SFT steps per specialist")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--held-out", type=int, default=50)
    ap.add_argument("--digits", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="", help="run just one of on-policy, off-policy, average, table")
    args = ap.parse_args()
    out, tasks = Path(args.out), args.tasks.split(",")
    specs = make_teachers(
        out / "teachers",
        tasks,
        steps=args.steps,
        batch_size=args.batch_size,
        digits=args.digits,
        threads=args.threads,
    )
    common = dict(
        teachers=specs,
        iterations=args.iterations,
        prompts=args.prompts,
        samples=args.samples,
        lr=args.lr,
        held_out=args.held_out,
        eval_every=max(1, args.iterations // 4),
        eval_samples=8,
        digits=args.digits,
        threads=args.threads,
    )
    for method in ("on-policy", "off-policy", "average"):
        if args.only in ("", method):
            train_distill(DistillConfig(method=method, out=str(out / method), **common), on_iteration=print)
    if args.only not in ("", "table"):
        return
    rows = []
    for spec in specs:
        rows.append(
            {
                "model": f"specialist {spec.split('=')[0]}",
                **specialist_accuracy(spec, tasks, args.held_out, args.digits, 0),
            }
        )
    for method in ("on-policy", "off-policy", "average"):
        with (out / method / "log.csv").open(newline="") as f:
            last = [r for r in csv.DictReader(f) if r["acc_mean"]][-1]
        rkl = {k: last[k] for k in last if k.startswith("eval_rkl_")}
        accs = {k: float(last[k]) for k in last if k.startswith("acc_") and k != "acc_mean"}
        rows.append({"model": f"student {method}", **accs, "teacher_tokens": last["teacher_tokens"], **rkl})
    RESULTS.mkdir(exist_ok=True)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with (RESULTS / "distill.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    plot_distill([out / "on-policy", out / "off-policy"], RESULTS / "distill.png")
    for r in rows:
        print(r)
    print("load:", os.getloadavg())


if __name__ == "__main__":
    main()
