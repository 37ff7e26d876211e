"""Held-out accuracy of a policy on a task, through the engine: what `k3 rl`, `k3 rl sft` and `k3 distill`
log as eval_acc (greedy) and eval_sampled (seeded samples at the rollout temperature)."""

from __future__ import annotations

import torch

from k3.engine.sampling import SamplingParams
from k3.tasks.codec import CharCodec
from k3.tasks.task import Task


@torch.no_grad()
def held_out_accuracy(
    engine, task: Task, codec: CharCodec, seed: int, temperature: float = 0.0, samples: int = 1
) -> float:
    """The share of answers to the task's held-out problems graded right: greedy (temperature 0), or
    `samples` seeded samples per problem at `temperature` (what the RL objective is the expectation of)."""
    problems = [p for p in task.held_out(seed) for _ in range(samples if temperature else 1)]
    stop = frozenset({codec.eos})
    params = [
        SamplingParams(temperature=temperature, max_tokens=task.max_tokens, stop_ids=stop, seed=seed + i)
        for i in range(len(problems))
    ]
    outs = engine.generate([codec.encode(p.prompt) for p in problems], params)
    return sum(task.grade(problems, [codec.decode(o) for o in outs])) / len(problems)
