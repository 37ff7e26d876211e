"""Held-out accuracy of a policy on a task, through the engine: what `k3 rl`, `k3 rl sft` and `k3 distill`
log as eval_acc (greedy) and eval_sampled (seeded samples at the rollout temperature). A task with a tool
is evaluated as it is trained: through k3.rl.rollout, its calls answered."""

from __future__ import annotations

import torch

from k3.engine.sampling import SamplingParams
from k3.rl.rollout import Trajectory, generate
from k3.tasks.codec import CharCodec
from k3.tasks.task import Task


@torch.no_grad()
def held_out_accuracy(
    engine, task: Task, codec: CharCodec, seed: int, temperature: float = 0.0, samples: int = 1
) -> float:
    """The share of answers to the task's held-out problems graded right: greedy (temperature 0), or
    `samples` seeded samples per problem at `temperature` (what the RL objective is the expectation of)."""
    problems = [p for p in task.held_out(seed) for _ in range(samples if temperature else 1)]
    prompts = [task.prompt_ids(p, codec) for p in problems]
    tool = task.tool(codec)
    if tool is not None:
        trajs = [Trajectory(i, 0, ids) for i, ids in enumerate(prompts)]
        generate(engine, trajs, seed=seed, temperature=temperature, stop_id=task.stop_id(codec),
                 max_tokens=task.max_tokens, tool=tool)  # fmt: skip
        texts = [task.reply(t.tokens, t.env, codec) for t in trajs]
    else:
        stop = frozenset({task.stop_id(codec)})
        params = [
            SamplingParams(temperature=temperature, max_tokens=task.max_tokens, stop_ids=stop, seed=seed + i)
            for i in range(len(problems))
        ]
        texts = [task.reply(o, [], codec) for o in engine.generate(prompts, params)]
    return sum(task.grade(problems, texts)) / len(problems)
