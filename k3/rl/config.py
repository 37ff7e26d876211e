"""What an RL run computes: `RLConfig` (saved as RUN/rl.json) and its checks.

Light on purpose (no torch): `k3 rl`'s options are read from these fields and their defaults
(k3/rl/commands.py), so each default lives here only.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3.errors import K3Error
from k3.tasks.task import TASK_NAMES

LOSSES = ("k2", "grpo", "rest")
STALE_MODES = ("mask", "tis")
RESUMABLE_CHANGES = {"stop_after", "progress", "threads"}  # options a resumed run may change


class RLError(K3Error):
    """An RL setup that cannot run; the message names the option."""


@dataclass
class RLConfig:
    init: str = "tiny"  # preset, published checkpoint or policy folder (k3 rl sft)
    task: str = "arithmetic"  # arithmetic | sort | recall | code | calculator (a+b: k3.tasks.mixture)
    out: str = "runs/rl"
    iterations: int = 20
    prompts: int = 16  # new prompts per iteration
    samples: int = 8  # K per prompt
    loss: str = "k2"  # k2 | grpo | rest
    tau: float = 0.1  # K2's KL weight
    clip: float = 0.2  # GRPO's ratio clip
    lr: float = 1e-3
    warmup: int = 10  # optimizer steps of linear learning-rate warm-up (0: none)
    minibatches: int = 2  # optimizer steps per iteration
    reset_optimizer: bool = False  # a fresh optimizer every iteration (K1.5)
    grad_clip: float = 1.0
    temperature: float = 1.0
    partial_budget: int = 0  # tokens per trajectory per iteration (0: no partial rollouts)
    partial_cap: float = 0.5  # most samples of a batch from partial rollouts
    stale_versions: int = 2
    stale: str = "mask"  # mask | tis
    tis_cap: float = 2.0
    length_coef: float = 0.0  # K1.5 length penalty weight
    truncation_penalty: float = 0.0
    loop_repeats: int = 0  # a tail block repeated this often ends the sample as a loop (0: off)
    routing_replay: bool = False
    ptx_coef: float = 0.0  # weight of the pretraining (PTX) cross-entropy mixed into the loss (0: off)
    ptx_data: str = "task"  # task (reference answers of fresh problems) or an ASCII text file
    ptx_batch: int = 16  # PTX sequences per optimizer step
    eval_every: int = 5
    held_out: int = 100  # held-out problems
    digits: int = 3  # arithmetic
    seed: int = 0
    max_batch: int = 256  # engine slots
    checkpoint_every: int = 1
    threads: int = 0
    stop_after: int | None = None
    progress: bool = True

    def check(self) -> None:
        def bad(option: str, problem: str) -> None:
            raise RLError(f"--{option.replace('_', '-')}: {problem}")

        for name in ("iterations", "prompts", "samples", "minibatches", "eval_every", "held_out",
                     "checkpoint_every", "max_batch", "ptx_batch"):  # fmt: skip
            if getattr(self, name) < 1:
                bad(name, f"must be at least 1, got {getattr(self, name)}")
        if self.samples < 2:
            bad("samples", "needs at least 2 samples per prompt (the baseline is their mean)")
        unknown = [n for n in self.task.split("+") if n.partition("@")[0] not in TASK_NAMES]
        if unknown:
            bad("task", f"unknown task {unknown[0]!r} (known: {', '.join(TASK_NAMES)})")
        if self.loss not in LOSSES:
            bad("loss", f"unknown loss {self.loss!r} (known: {', '.join(LOSSES)})")
        if self.stale not in STALE_MODES:
            bad("stale", f"must be one of {', '.join(STALE_MODES)}, got {self.stale!r}")
        if self.prompts % self.minibatches:
            bad("minibatches", f"must divide --prompts ({self.prompts})")
        if self.tau <= 0:
            bad("tau", f"must be positive, got {self.tau}")
        for name in ("lr", "warmup", "partial_budget", "ptx_coef"):
            if getattr(self, name) < 0:
                bad(name, f"must be >= 0, got {getattr(self, name)}")
        if self.temperature <= 0:
            bad("temperature", f"RL samples need a temperature > 0, got {self.temperature}")
        if not 0 <= self.partial_cap <= 1:
            bad("partial-cap", f"must be in [0, 1], got {self.partial_cap}")
