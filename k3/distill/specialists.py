"""`k3 distill teachers`: specialist teachers built with k3 itself, one per task.

Each specialist starts from the same weights: the preset's (seeded), or with `base_steps` a base fine-tuned
that many steps on the mixture of all the tasks (OUT/base/policy, k3.tasks.mixture: format-competent, the
student's natural start); it is fine-tuned on its task's reference answers with `k3 rl sft` (k3.rl.sft)
and, with `rl_iterations`, improved by `k3 rl` on the same
task; it is then exported in the published layout (MXFP4 experts, the built-in tokenizer) as
OUT/<task>/checkpoint, which `k3 distill --teacher <task>=OUT/<task>/checkpoint:<task>` loads. A task may
be at an effort (`arithmetic@long`, k3.tasks.effort); `rl_iterations` needs plain tasks (`k3 rl`'s).
"""

from __future__ import annotations

from pathlib import Path

from k3.distill.config import DistillError
from k3.tasks.effort import is_task_name


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
    base_steps: int = 0,
    on_step=None,
) -> list[str]:
    """Build (or reuse, when OUT/<task>/checkpoint exists) one specialist per task; returns the
    `NAME=CKPT:task` teacher specs (NAME: the task, `@` and `-` as `_`)."""
    from k3.rl.export import export_run
    from k3.rl.sft import SFTConfig, sft
    from k3.rl.trainer import RLConfig, train_rl

    for task in tasks:
        if not is_task_name(task) or task == "code":
            raise DistillError(f"--tasks: {task!r} is no task a specialist can be fine-tuned on here")

    def fine_tune(start: str, task: str, run: Path, steps: int) -> Path:
        config = SFTConfig(init=start, task=task, out=str(run), steps=steps, batch_size=batch_size, lr=lr,
                           warmup=min(20, steps), digits=digits, seed=seed, eval_every=max(1, steps // 3),
                           held_out=held_out, threads=threads)  # fmt: skip
        if not (run / "policy" / "config.json").is_file():
            sft(config, on_step=on_step)
        return run / "policy"

    if base_steps:
        init = str(fine_tune(init, "+".join(tasks), Path(out) / "base", base_steps))
    specs = []
    for task in tasks:
        root = Path(out) / task
        checkpoint = root / "checkpoint"
        if not (checkpoint / "config.json").is_file():
            policy = fine_tune(init, task, root / "sft", steps)
            if rl_iterations:
                rc = RLConfig(init=str(policy), task=task, out=str(root / "rl"), iterations=rl_iterations,
                              digits=digits, seed=seed, threads=threads, progress=False)  # fmt: skip
                policy = train_rl(rc)
            export_run(policy, checkpoint)
        specs.append(f"{task.replace('@', '_').replace('-', '_')}={checkpoint}:{task}")
    return specs
