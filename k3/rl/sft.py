"""`k3 rl sft`: supervised fine-tuning on a task's reference answers, to make a base that is partly
competent (RL needs some initial success to learn from).

Each step trains on `batch_size` problems of the task (the training stream, never the held-out set):
`prompt answer [EOS]` as character ids, the loss on the answer and EOS only. The result is a policy
folder (`RUN/policy/`: config.json + policy.safetensors) that `k3 rl --init RUN/policy` starts from, and
RUN/log.csv (step, loss, lr, eval_acc) that `k3 train plot RUN` draws; each evaluation also keeps the
policy of that step (`RUN/policy-000150/`), to pick a base of the competence wanted.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from k3.rl.codec import CharCodec
from k3.rl.tasks import make_task

IGNORE = -100


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


def sft_batch(problems, codec: CharCodec) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) [B, L]: prompt + answer + EOS shifted by one; labels only on answer and EOS."""
    seqs = [(codec.encode(p.prompt), codec.encode(p.answer) + [codec.eos]) for p in problems]
    L = max(len(q) + len(a) for q, a in seqs) - 1
    inputs = torch.zeros(len(seqs), L, dtype=torch.long)
    labels = torch.full((len(seqs), L), IGNORE, dtype=torch.long)
    for b, (q, a) in enumerate(seqs):
        s = q + a
        inputs[b, : len(s) - 1] = torch.tensor(s[:-1])
        labels[b, len(q) - 1 : len(s) - 1] = torch.tensor(a)
    return inputs, labels


def sft(sc: SFTConfig, on_step=None) -> Path:
    from k3.engine.generate import Engine
    from k3.rl.policy_io import load_policy, save_policy
    from k3.rl.trainer import held_out_accuracy
    from k3.train.optim import build_optimizer

    if sc.threads:
        torch.set_num_threads(sc.threads)
    options = {"digits": sc.digits} if "arithmetic" in sc.task else {}  # also at an effort, mixed
    task = make_task(sc.task, held_out_size=sc.held_out, **options)
    model = load_policy(sc.init, sc.seed).train()
    codec = CharCodec(model.config.vocab_size)
    optimizer = build_optimizer(model, "adamw", sc.lr, 0.0, (0.9, 0.95))
    run = Path(sc.out)
    run.mkdir(parents=True, exist_ok=True)
    with (run / "log.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "loss", "lr", "eval_acc"])
        writer.writeheader()
        for step in range(sc.steps):
            lr = sc.lr * min(1.0, (step + 1) / max(1, sc.warmup))
            lr *= 0.5 * (1 + math.cos(math.pi * step / sc.steps)) if step >= sc.warmup else 1.0
            for group in optimizer.param_groups:
                group["lr"] = lr
            inputs, labels = sft_batch(task.problems(sc.seed, step, sc.batch_size), codec)
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
