"""`k3 distill teachers`: specialist teachers built with k3 itself, one per task.

Each specialist starts from the same preset (the same random weights), is fine-tuned on its task's
reference answers with `k3 rl sft` (k3.rl.sft) and, with `rl_iterations`, improved by `k3 rl` on the same
task; it is then exported in the published layout (MXFP4 experts, the built-in tokenizer) as
OUT/<task>/checkpoint, which `k3 distill --teacher <task>=OUT/<task>/checkpoint:<task>` loads.
"""

from __future__ import annotations

from pathlib import Path

from k3.rl.distill import DistillError
from k3.rl.tasks import TASK_NAMES


def make_teachers(
    out: str | Path,
    tasks: list[str],
    *,
    init: str = "tiny",
    steps: int = 300,
    batch_size: int = 64,
    lr: float = 3e-3,
    rl_iterations: int = 0,
    digits: int = 3,
    held_out: int = 100,
    seed: int = 0,
    threads: int = 0,
    on_step=None,
) -> list[str]:
    """Build (or reuse, when OUT/<task>/checkpoint exists) one specialist per task; returns the
    `NAME=CKPT:task` teacher specs."""
    from k3.rl.export import export_run
    from k3.rl.sft import SFTConfig, sft
    from k3.rl.trainer import RLConfig, train_rl

    specs = []
    for task in tasks:
        if task not in TASK_NAMES or task == "code":
            raise DistillError(f"--tasks: {task!r} is no task a specialist can be fine-tuned on here")
        root = Path(out) / task
        checkpoint = root / "checkpoint"
        if not (checkpoint / "config.json").is_file():
            eval_every = max(1, steps // 3)
            run = sft(
                SFTConfig(init, task, str(root / "sft"), steps, batch_size, lr, min(20, steps), digits, seed,
                          eval_every, held_out, threads),
                on_step=on_step,
            )  # fmt: skip
            policy = run / "policy"
            if rl_iterations:
                rc = RLConfig(init=str(policy), task=task, out=str(root / "rl"), iterations=rl_iterations,
                              digits=digits, seed=seed, threads=threads, progress=False)  # fmt: skip
                policy = train_rl(rc)
            export_run(policy, checkpoint)
        specs.append(f"{task}={checkpoint}:{task}")
    return specs
