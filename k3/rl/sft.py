"""`k3 rl sft`: supervised fine-tuning on a task's reference answers, to make a base that is partly
competent (RL needs some initial success to learn from).

Each step trains on `batch_size` problems of the task (the training stream, never the held-out set):
`prompt answer [EOS]` as character ids (the calculator: its chat-format prompt and a direct answer to the
end of the turn, k3.tasks.tool_task), the loss on the answer and EOS only. The result is a policy
folder (`RUN/policy/`: config.json + policy.safetensors) that `k3 rl --init RUN/policy` starts from, and
RUN/log.csv (step, loss, lr, eval_acc) that `k3 train plot RUN` draws; each evaluation also keeps the
policy of that step (`RUN/policy-000150/`), to pick a base of the competence wanted.

`wrong_carry` (plain arithmetic only) plants a systematic error in the corpus: each problem whose sum has
a carry that changes the answer gets, with probability `wrong_carry` (drawn anew at every step), the
answer with every carry dropped (`carry_dropped`: `47+85=` -> 122, not 132), the common human slip. The
base then holds both answers to such problems and, at a share above one half, prefers the wrong one:
the skill is there (samples find it), the choice is not. The held-out grading is always against the sum.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from k3.tasks.codec import CharCodec
from k3.tasks.effort import plant_pad_noise
from k3.tasks.exact_match import Arithmetic
from k3.tasks.registry import make_task
from k3.tasks.task import Problem, Task, TaskError

IGNORE = -100
WRONG_CARRY_STREAM = 2**31 - 2  # the random stream of the planted errors (beside k3.tasks.task's streams)
PAD_NOISE_STREAM = 2**31 - 3  # the planted scratchpad digits' (pad_noise)


@dataclass
class SFTConfig:
    init: str = "tiny"
    task: str = "arithmetic"
    out: str = "runs/sft"
    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    warmup: int = 20
    digits: int = 3
    seed: int = 0
    eval_every: int = 100
    held_out: int = 100
    threads: int = 0
    wrong_carry: float = 0.0  # share of carry problems answered with the carry dropped (plain arithmetic)
    # share of problems with one wrong scratchpad digit, not trained on (k3.tasks.effort; at the `fix` effort
    # a wrong digit of the answer, followed by its erasure and the true digit)
    pad_noise: float = 0.0


def carry_dropped(prompt: str, reverse: bool = True) -> str:
    """The answer to `a+b=` written column by column with no carry: each column's digit sum mod 10, the
    top column's sum in full (`47+85=` -> `122`); reversed (least significant digit first) with `reverse`."""
    a, b = prompt.rstrip("=").split("+")
    width = max(len(a), len(b))
    a, b = a.zfill(width), b.zfill(width)
    columns = [int(x) + int(y) for x, y in zip(a, b, strict=True)]  # most significant first
    text = str(columns[0]) + "".join(str(c % 10) for c in columns[1:])
    return text[::-1] if reverse else text


def plant_wrong_carry(
    problems: list[Problem], share: float, rng: np.random.Generator, reverse: bool
) -> list[Problem]:
    """`problems` with each one whose carry-dropped answer differs from the sum given that wrong answer
    with probability `share` (one uniform draw per problem, in order)."""
    out = []
    for p, u in zip(problems, rng.random(len(problems)), strict=True):
        wrong = carry_dropped(p.prompt, reverse)
        out.append(Problem(p.prompt, wrong) if wrong != p.answer and u < share else p)
    return out


def sft_batch(
    problems, codec: CharCodec, skip=None, task: Task | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) [B, L]: prompt + answer + EOS shifted by one; labels only on answer and EOS, but
    not on answer character `skip[b]` of problem b where given (a planted digit: k3.tasks.effort). With a
    `task`, its own prompt and reference ids (the calculator's: K3's chat format, k3.tasks.tool_task)."""
    if task is None:
        seqs = [(codec.encode(p.prompt), codec.encode(p.answer) + [codec.eos]) for p in problems]
    else:
        seqs = [(task.prompt_ids(p, codec), task.reference_ids(p, codec)) for p in problems]
    L = max(len(q) + len(a) for q, a in seqs) - 1
    inputs = torch.zeros(len(seqs), L, dtype=torch.long)
    labels = torch.full((len(seqs), L), IGNORE, dtype=torch.long)
    for b, (q, a) in enumerate(seqs):
        s = q + a
        inputs[b, : len(s) - 1] = torch.tensor(s[:-1])
        labels[b, len(q) - 1 : len(s) - 1] = torch.tensor(a)
        if skip is not None and skip[b] is not None:
            labels[b, len(q) - 1 + skip[b]] = IGNORE
    return inputs, labels


def sft(sc: SFTConfig, on_step=None) -> Path:
    from k3.engine.generate import Engine
    from k3.rl.evaluation import held_out_accuracy
    from k3.rl.policy_io import load_policy, save_policy
    from k3.train.optim import build_optimizer
    from k3.train.schedule import sft_rate

    if sc.threads:
        torch.set_num_threads(sc.threads)
    digits = "arithmetic" in sc.task or sc.task == "calculator"  # arithmetic also at an effort, mixed
    options = {"digits": sc.digits} if digits else {}
    task = make_task(sc.task, held_out_size=sc.held_out, **options)
    if sc.wrong_carry and not isinstance(task, Arithmetic):
        raise TaskError(f"--wrong-carry needs the plain arithmetic task, not {sc.task!r}")
    if not 0.0 <= sc.wrong_carry <= 1.0:
        raise TaskError(f"--wrong-carry is a share in [0, 1], not {sc.wrong_carry}")
    if sc.pad_noise and not (0.0 < sc.pad_noise <= 1.0 and getattr(task, "effort", "no") != "no"):
        raise TaskError(
            f"--pad-noise {sc.pad_noise}: needs a share in (0, 1] and a task with a scratchpad "
            f"(TASK@short|long), not {sc.task!r}"
        )
    model = load_policy(sc.init, sc.seed).train()
    codec = CharCodec(model.config.vocab_size)
    optimizer = build_optimizer(model, "adamw", sc.lr, 0.0, (0.9, 0.95))
    run = Path(sc.out)
    run.mkdir(parents=True, exist_ok=True)
    with (run / "log.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "loss", "lr", "eval_acc"])
        writer.writeheader()
        for step in range(sc.steps):
            lr = sft_rate(step, sc.lr, sc.steps, sc.warmup)
            for group in optimizer.param_groups:
                group["lr"] = lr
            problems = task.problems(sc.seed, step, sc.batch_size)
            if sc.wrong_carry:
                rng = np.random.default_rng([sc.seed, step, WRONG_CARRY_STREAM])
                problems = plant_wrong_carry(problems, sc.wrong_carry, rng, task.reverse)
            skip = None
            if sc.pad_noise:
                rng = np.random.default_rng([sc.seed, step, PAD_NOISE_STREAM])
                problems, skip = plant_pad_noise(problems, sc.pad_noise, rng, task.effort == "fix")
            inputs, labels = sft_batch(problems, codec, skip, task)
            logits = model(inputs)
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            row = {"step": step + 1, "loss": f"{float(loss.detach()):.6f}", "lr": f"{lr:.6g}"}
            if (step + 1) % sc.eval_every == 0 or step + 1 == sc.steps:
                engine = Engine(model.eval(), max_batch=64)
                row["eval_acc"] = f"{held_out_accuracy(engine, task, codec, sc.seed):.6f}"
                save_policy(model, run / f"policy-{step + 1:06d}")  # to pick a partly competent base
                model.train()
            writer.writerow(row)
            f.flush()
            if on_step is not None:
                on_step(row)
    save_policy(model, run / "policy")
    return run
