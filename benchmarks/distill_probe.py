"""Where on-policy distillation's tokens land: the student's own samples of held-out prompts, measured
against the reference answer and the teacher (benchmarks/distill.py's runs, checkpoints kept with --keep).

For each student checkpoint and domain, K samples per held-out prompt at temperature 1 (what an on-policy
iteration trains on), and the greedy answer (what is graded):

- `acc`: share of samples graded right;
- `on_path`: share of the sampled tokens whose context is still the reference answer's prefix (every
  earlier token right): the contexts off-policy SFT trains on too (the teachers' samples are the reference,
  `teacher_acc`); `off_path`: the rest, contexts only on-policy training visits;
- `first_dev`: mean position (answer token index, 0-based) of the first deviation, over deviating samples;
  `dev_in_pad`: share of those deviations inside the scratchpad (before `;`), where a later answer can
  still be right;
- `recover`: of the deviating samples, the share the teacher, continuing greedily from the student's
  prefix up to and including its first wrong token, ends graded right (0 where the deviation is in the
  graded answer itself); `recover_pad`: the same over deviations in the scratchpad only;
- `self_recover_pad`: of the student's own samples that deviate inside the scratchpad, the share graded
  right (the student recovering by itself);
- `greedy_pad_dev`, `greedy_self_recover_pad`: the same for the greedy answers (share deviating inside
  the scratchpad; of those, the share graded right);
- `consistent` (arithmetic@long, sort@long): share of the student's samples whose answer is the one
  their own scratchpad implies, right or wrong (the readout step: `implied_answer`);
- `carry_dropped` (plain arithmetic): of the samples of carry problems, the share that is the answer
  with every carry dropped (the error `k3 rl sft --wrong-carry` plants);
- `teacher_right_at_dev`: share of deviations where the teacher's greedy token at that (on-path) context
  is the reference token (so the teacher's signal there points to the right token);
- `erasing`, `erasing_right` (arithmetic@fix): share of the student's samples that take a character back
  (k3.tasks.effort.ERASE) and, of those, the share graded right; `greedy_erasing`, `greedy_erasing_right`:
  the same for the greedy answers;
- `way_r`, `greedy_way_r` (arithmetic-either): share of the samples / greedy answers written the easy way
  (`r`, least significant digit first); `acc_r`, `acc_p`: the samples' accuracy by way.

    PYTHONPATH=. python benchmarks/distill_probe.py --out runs/distill-exp --runs off-policy,forward-cold \\
      --steps 60,100 [--seed 0]     # writes benchmarks/results/distill_probe.csv
"""

from __future__ import annotations

import argparse
import csv
import os
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def load_checkpoint(run: Path, step: int):
    """The student of `run` at `step` (RUN/keep/step-N, else RUN/checkpoints/step-N), fp32, eval mode."""
    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    from k3.train.state import load_model_state

    folder = next(
        d / f"step-{step:08d}"
        for d in (run / "keep", run / "checkpoints")
        if (d / f"step-{step:08d}").is_dir()
    )
    model = K3ForCausalLM.from_config(
        K3Config.from_pretrained(str(run / "config.json")), quantized_experts=False
    )
    load_model_state(folder, model)
    return model.eval().requires_grad_(False)


def implied_answer(task, text: str) -> str | None:
    """The answer a response's own scratchpad implies (arithmetic@long: each column total's last digit,
    then the top carry; sort@long: each digit as often as counted); None: no scratchpad to read."""
    pad, sep, _ = text.partition(";")
    if not sep:
        return None
    if task.name == "arithmetic@long":
        totals = pad.split(" ")
        if not all(len(t) == 2 and t.isdigit() for t in totals):
            return None
        return "".join(t[1] for t in totals) + (totals[-1][0] if totals[-1][0] != "0" else "")
    if task.name == "sort@long" and len(pad) == 10 and pad.isdigit():
        return "".join(str(d) * int(c) for d, c in enumerate(pad))
    return None


def _complete(
    engine, prompts: list[list[int]], max_tokens: list[int], temperature: float, eos: int, seed: int
):
    from k3.engine.sampling import SamplingParams

    params = [
        SamplingParams(temperature=temperature, max_tokens=m, stop_ids=frozenset({eos}), seed=seed + i)
        for i, m in enumerate(max_tokens)
    ]
    return [c.tokens for c in engine.complete(prompts, params)]  # the stop id kept where it stopped


def probe(student, teacher, task, codec, seed: int, samples: int) -> dict:
    """The figures of the module doc for one student on one domain."""
    from k3.engine.generate import Engine
    from k3.tasks.effort import ERASE, SEPARATOR

    s_engine, t_engine = Engine(student, max_batch=64), Engine(teacher, max_batch=64)
    problems = list(task.held_out(seed))
    prompts = [codec.encode(p.prompt) for p in problems]
    refs = [codec.encode(p.answer) + [codec.eos] for p in problems]
    t_outs = _complete(t_engine, prompts, [task.max_tokens] * len(prompts), 0.0, codec.eos, seed)
    teacher_acc = sum(task.grade(problems, [codec.decode(o) for o in t_outs])) / len(problems)
    rows = [i for i in range(len(problems)) for _ in range(samples)]
    outs = _complete(
        s_engine, [prompts[i] for i in rows], [task.max_tokens] * len(rows), 1.0, codec.eos, seed
    )
    right = task.grade([problems[i] for i in rows], [codec.decode(o) for o in outs])
    on = off = 0
    devs = []  # (sample row, position of the first wrong token)
    for r, (i, out) in enumerate(zip(rows, outs, strict=True)):
        ref = refs[i]
        d = next((k for k, tok in enumerate(out) if k >= len(ref) or tok != ref[k]), None)
        if d is None and len(out) < len(ref):  # stopped by the budget on the reference path
            d = len(out)
        reach = len(out) if d is None else min(d + 1, len(out))
        on, off = on + reach, off + len(out) - reach
        if d is not None and d < len(out):
            devs.append((r, d))
    in_pad = [SEPARATOR in codec.decode(refs[rows[r]][d:]) for r, d in devs]
    recovered = []
    teacher_right = []
    if devs:
        prefixes = [prompts[rows[r]] + outs[r][: d + 1] for r, d in devs]
        budgets = [max(1, task.max_tokens - d - 1) for _, d in devs]
        conts = _complete(t_engine, prefixes, budgets, 0.0, codec.eos, seed)
        answers = [codec.decode(outs[r][: d + 1] + c) for (r, d), c in zip(devs, conts, strict=True)]
        recovered = task.grade([problems[rows[r]] for r, _ in devs], answers)
        at_dev = _complete(t_engine, [prompts[rows[r]] + outs[r][:d] for r, d in devs], [1] * len(devs), 0.0,
                           codec.eos, seed)  # fmt: skip
        teacher_right = [c[:1] == refs[rows[r]][d : d + 1] for (r, d), c in zip(devs, at_dev, strict=True)]
    consistent = []  # the student's answer is what its own scratchpad implies
    for o in outs:
        text = codec.decode(o)
        implied = implied_answer(task, text)
        if implied is not None:
            consistent.append(text.rpartition(";")[2] == implied)
    dropped = []  # plain arithmetic: the sample is the carry-dropped answer (k3 rl sft --wrong-carry's)
    if task.name == "arithmetic":
        from k3.rl.sft import carry_dropped

        for i, o in zip(rows, outs, strict=True):
            wrong = carry_dropped(problems[i].prompt, task.reverse)
            if wrong != problems[i].answer:
                dropped.append(codec.decode(o) == wrong)
    greedy = _complete(s_engine, prompts, [task.max_tokens] * len(prompts), 0.0, codec.eos, seed)
    greedy_right = task.grade(problems, [codec.decode(o) for o in greedy])
    greedy_pad_dev = [  # greedy answers whose first deviation is inside the scratchpad: right or not
        r
        for o, ref, r in zip(greedy, refs, greedy_right, strict=True)
        if (d := next((k for k, tok in enumerate(o) if k >= len(ref) or tok != ref[k]), None)) is not None
        and SEPARATOR in codec.decode(ref[d:])
    ]

    def share(xs) -> str:
        return f"{sum(xs) / len(xs):.4f}" if len(xs) else ""

    erasing = [ERASE in codec.decode(o) for o in outs]
    ways = [codec.decode(o)[:1] for o in outs]
    greedy_erasing = [ERASE in codec.decode(o) for o in greedy]

    pad_rec = [x for x, p in zip(recovered, in_pad, strict=True) if p]
    self_rec = [right[r] for (r, _), p in zip(devs, in_pad, strict=True) if p]
    return {
        "greedy_acc": share(greedy_right),
        "greedy_pad_dev": share([1] * len(greedy_pad_dev) + [0] * (len(problems) - len(greedy_pad_dev))),
        "greedy_self_recover_pad": share(greedy_pad_dev),
        "acc": share(right),
        "teacher_acc": f"{teacher_acc:.4f}",
        "on_path": f"{on / max(1, on + off):.4f}",
        "off_path": f"{off / max(1, on + off):.4f}",
        "deviating": share([1] * len(devs) + [0] * (len(rows) - len(devs))),
        "first_dev": f"{sum(d for _, d in devs) / len(devs):.2f}" if devs else "",
        "dev_in_pad": share(in_pad),
        "recover": share(recovered),
        "recover_pad": share(pad_rec),
        "self_recover_pad": share(self_rec),
        "teacher_right_at_dev": share(teacher_right),
        "consistent": share(consistent),
        "carry_dropped": share(dropped),
        "answer_tokens": f"{(on + off) / len(rows):.2f}",
        "erasing": share(erasing),
        "erasing_right": share([r for r, e in zip(right, erasing, strict=True) if e]),
        "greedy_erasing": share(greedy_erasing),
        "greedy_erasing_right": share([r for r, e in zip(greedy_right, greedy_erasing, strict=True) if e]),
        **(
            {
                "way_r": share([w == "r" for w in ways]),
                "greedy_way_r": share([codec.decode(o)[:1] == "r" for o in greedy]),
                "acc_r": share([r for r, w in zip(right, ways, strict=True) if w == "r"]),
                "acc_p": share([r for r, w in zip(right, ways, strict=True) if w == "p"]),
            }
            if task.name == "arithmetic-either"
            else {}
        ),
    }


def main() -> None:
    from k3.distill.config import DistillConfig
    from k3.distill.loop import make_tasks
    from k3.distill.teachers import load_teacher
    from k3.tasks.codec import CharCodec

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/distill-exp")
    ap.add_argument("--runs", required=True, help="run folders under OUT, comma-separated")
    ap.add_argument("--steps", required=True, help="iterations whose checkpoints to probe")
    ap.add_argument("--tasks", default="arithmetic@no,arithmetic@long,sort,recall")
    ap.add_argument("--samples", type=int, default=4, help="student samples per held-out prompt")
    ap.add_argument("--held-out", type=int, default=100)
    ap.add_argument("--digits", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="the runs' seed (their held-out set)")
    ap.add_argument("--teacher", action="append", default=[], help="TASK=CKPT: another teacher (a label)")
    ap.add_argument("--setting", default="four", help="the setting column's value (four, plain, robust)")
    ap.add_argument("--csv", default=str(RESULTS / "distill_probe.csv"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    out, tasks = Path(args.out), args.tasks.split(",")
    dc = DistillConfig(held_out=args.held_out, digits=args.digits)
    sources = {t: str(out / "teachers" / t / "checkpoint") for t in tasks}
    sources.update(dict(spec.split("=", 1) for spec in args.teacher))
    teachers = {t: load_teacher(sources[t]) for t in tasks}
    domains = make_tasks(dc, tasks)
    path, rows = Path(args.csv), []
    if path.is_file():
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    for run in args.runs.split(","):
        for step in (int(s) for s in args.steps.split(",")):
            student = load_checkpoint(out / run, step)
            codec = CharCodec(student.config.vocab_size)
            for name, task in domains.items():
                row = {
                    "run": run,
                    "iteration": step,
                    "seed": args.seed,
                    "domain": name,
                    "setting": args.setting,
                }
                row.update(probe(student, teachers[name], task, codec, args.seed, args.samples))
                print(row, flush=True)
                key = (args.setting, run, str(step), str(args.seed), name)
                rows = [
                    r for r in rows if (r["setting"], r["run"], r["iteration"], r["seed"], r["domain"]) != key
                ]
                rows.append(row)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    path.parent.mkdir(exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    print("load:", os.getloadavg())


if __name__ == "__main__":
    main()
