"""`k3 distill`'s settings (DistillConfig), without torch: the command builds its options from these
defaults (k3.distill.commands), so each default lives here only."""

from __future__ import annotations

from dataclasses import dataclass, field

from k3.errors import K3Error

METHODS = ("on-policy", "off-policy", "average", "rl")  # rl: the task reward the only advantage (a baseline)


class DistillError(K3Error):
    """A distillation setup that cannot run (teachers, tasks, vocabularies); the message names it."""


@dataclass
class DistillConfig:
    student: str = "tiny"  # preset, published checkpoint or policy folder
    teachers: list[str] = field(default_factory=list)  # NAME=CKPT[:task]
    tasks: list[str] = field(default_factory=list)  # extra domains, for a teacher without a task
    out: str = "runs/distill"
    method: str = "on-policy"  # one of METHODS
    iterations: int = 20
    prompts: int = 8  # new prompts per domain per iteration
    samples: int = 4  # K per prompt
    lr: float = 1e-3
    warmup: int = 10  # optimizer steps of linear learning-rate warm-up (0: none), as `k3 rl`'s
    cosine: bool = False  # after the warm-up, decay to 0 over the run's iterations x minibatches steps
    optimizer: str = "adamw"  # adamw | sgd
    minibatches: int = 1
    grad_clip: float = 1.0
    temperature: float = 1.0
    is_low: float = 0.0  # importance weight truncated to [is_low, is_high]
    is_high: float = 2.0
    alpha_reward: float = 0.0
    kl_discount: float = 0.0  # each token also credited with the rest of its sample's reverse KL, discounted
    kl_baseline: bool = False  # with full_vocab and kl_discount: the other samples' mean subtracted (RLOO)
    kl_length_norm: bool = False  # with kl_discount: the rest's mean KL per token, not its sum (MiniLLM)
    warm_start: int = 0  # the first N iterations off-policy (SFT on the teachers' samples), at warm_lr
    warm_lr: float | None = None  # the warm-start iterations' peak learning rate (None: lr)
    full_vocab: bool = False  # the exact full-vocabulary divergence (GKD; off-policy: supervised KD)
    divergence: str = "reverse"  # with full_vocab: reverse KL(student || teacher) or forward (GKD beta = 0)
    eval_every: int = 5
    held_out: int = 100
    eval_samples: int = 16  # held-out prompts per domain sampled for eval_rkl_<teacher>
    digits: int = 3  # arithmetic
    seed: int = 0
    max_batch: int = 64
    checkpoint_every: int = 1
    threads: int = 0
    stop_after: int | None = None
    progress: bool = True

    def check(self) -> None:
        def bad(option: str, problem: str) -> None:
            raise DistillError(f"--{option.replace('_', '-')}: {problem}")

        if not self.teachers:
            bad("teacher", "give at least one NAME=CKPT[:task]")
        for name in ("iterations", "prompts", "samples", "minibatches", "eval_every", "held_out"):
            if getattr(self, name) < 1:
                bad(name, f"must be at least 1, got {getattr(self, name)}")
        if self.method not in METHODS:
            bad("method", f"unknown method {self.method!r} (known: {', '.join(METHODS)})")
        if self.optimizer not in ("adamw", "sgd"):
            bad("optimizer", f"adamw or sgd, got {self.optimizer!r}")
        if self.temperature <= 0:
            bad("temperature", f"must be > 0, got {self.temperature}")
        if not 0 <= self.is_low <= 1 <= self.is_high:
            bad("is_low", f"the interval [{self.is_low}, {self.is_high}] must hold 1 and start at >= 0")
        for name in ("lr", "warmup", "warm_lr"):
            if (getattr(self, name) or 0) < 0:
                bad(name, f"must be >= 0, got {getattr(self, name)}")
        if self.minibatches > self.prompts * self.samples:
            bad("minibatches", f"at most --prompts x --samples ({self.prompts * self.samples})")
        if not 0.0 <= self.kl_discount <= 1.0:
            bad("kl_discount", f"a discount in [0, 1], got {self.kl_discount}")
        if self.kl_discount and (self.method != "on-policy" or self.divergence != "reverse"):
            bad("kl_discount", "only with --method on-policy and the reverse KL (sampled or --full-vocab)")
        if self.kl_baseline and not (self.kl_discount and self.full_vocab):
            bad("kl_baseline", "only with --full-vocab --kl-discount (the sequence-level term it centres)")
        if self.kl_length_norm and not self.kl_discount:
            bad("kl_length_norm", "only with --kl-discount (it normalizes the rest-of-sample term)")
        if self.alpha_reward and self.method != "on-policy":
            bad("alpha_reward", "only with --method on-policy")
        if self.warm_start < 0 or self.warm_start > self.iterations:
            bad("warm_start", f"between 0 and --iterations ({self.iterations}), got {self.warm_start}")
        if self.warm_start and self.method == "average":
            bad("warm_start", "not with --method average (no training)")
        if self.divergence not in ("reverse", "forward"):
            bad("divergence", f"reverse or forward, got {self.divergence!r}")
        if self.divergence == "forward" and not self.full_vocab:
            bad("divergence", "forward needs --full-vocab (the teacher's whole distribution)")
        if self.method == "rl" and self.full_vocab:
            bad("full_vocab", "not with --method rl (no teacher scores its samples)")
        if self.method == "rl" and self.samples < 2:
            bad("samples", "--method rl needs at least 2 (the advantage: reward minus its group's mean)")
