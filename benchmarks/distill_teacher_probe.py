"""A distillation teacher's own samples (round 5 of benchmarks/distill.py): what off-policy SFT on them can
and cannot teach. For each checkpoint, on the task's held-out prompts:

- greedy accuracy, and at temperature 1 (4 samples per prompt) the accuracy and, per way of answering
  (`arithmetic-either`: `r` / `p`), the share of samples and their accuracy;
- at `fix`: the share of T = 1 samples that take a character back (k3.tasks.effort.ERASE) and, of those, how
  many had a wrong character before the first erasure (a real correction, not a right digit taken back);
  and after a planted wrong digit (the reference answer up to a uniformly chosen digit, that digit
  replaced by another, one per prompt), the share of greedy continuations that erase at once and that
  end graded right.

    PYTHONPATH=. python benchmarks/distill_teacher_probe.py --task arithmetic@fix CKPT [CKPT ...]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch


def main() -> None:
    from k3.distill.teachers import load_teacher
    from k3.engine.generate import Engine
    from k3.engine.sampling import SamplingParams
    from k3.tasks.codec import CharCodec
    from k3.tasks.effort import ERASE
    from k3.tasks.registry import make_task

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--task", default="arithmetic@fix")
    ap.add_argument("--digits", type=int, default=2)
    ap.add_argument("--held-out", type=int, default=100)
    ap.add_argument("--samples", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    task = make_task(args.task, digits=args.digits, held_out_size=args.held_out)
    codec = CharCodec(1024)
    problems = list(task.held_out(0))

    def complete(engine, prompts: list[str], temperature: float) -> list[str]:
        params = [
            SamplingParams(
                temperature=temperature, max_tokens=task.max_tokens, stop_ids=frozenset({codec.eos}), seed=i
            )  # fmt: skip
            for i in range(len(prompts))
        ]
        return [codec.decode(c.tokens) for c in engine.complete([codec.encode(p) for p in prompts], params)]

    for source in args.checkpoints:
        engine = Engine(load_teacher(source), max_batch=64)
        greedy = task.grade(problems, complete(engine, [p.prompt for p in problems], 0.0))
        rows = [p for p in problems for _ in range(args.samples)]
        outs = complete(engine, [p.prompt for p in rows], 1.0)
        right = task.grade(rows, outs)
        line = f"{source}: greedy {np.mean(greedy):.3f}, T = 1 {np.mean(right):.3f}"
        if args.task == "arithmetic-either":
            for way in "rp":
                mine = [r for r, o in zip(right, outs, strict=True) if o[:1] == way]
                line += (
                    f"; way {way}: {len(mine) / len(outs):.3f} of samples, {np.mean(mine or [0]):.3f} right"
                )
        if args.task.endswith("@fix"):
            erasing = [(p, o) for p, o in zip(rows, outs, strict=True) if ERASE in o]
            corrections = sum(o[: o.index(ERASE)] != p.answer[: o.index(ERASE)] for p, o in erasing)
            rng = np.random.default_rng(0)
            prefixes = []
            for p in problems:  # the reference up to one planted wrong digit
                digits = [i for i, c in enumerate(p.answer) if c.isdigit()]
                i = digits[int(rng.integers(len(digits)))]
                prefixes.append(p.answer[:i] + str((int(p.answer[i]) + 1 + int(rng.integers(9))) % 10))
            conts = complete(engine, [p.prompt + x for p, x in zip(problems, prefixes, strict=True)], 0.0)
            at_once = np.mean([c.startswith(ERASE) for c in conts])
            ends_right = np.mean(task.grade(problems, [x + c for x, c in zip(prefixes, conts, strict=True)]))
            line += (
                f"; T = 1 samples erasing {len(erasing) / len(outs):.3f} ({corrections} of {len(erasing)} "
                f"after a wrong character); after a planted wrong digit: erases at once {at_once:.3f}, "
                f"ends right {ends_right:.3f}"
            )
        print(line, flush=True)


if __name__ == "__main__":
    main()
