"""What a training run computes: `TrainConfig` (saved as RUN/train.json) and its named choices.

Light on purpose (no torch): `k3 train`'s options are read from these fields and their defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Schedule(StrEnum):
    """Learning rate after warm-up (k3.train.schedule)."""

    COSINE = "cosine"
    WSD = "wsd"
    CONSTANT = "constant"


class Optimizer(StrEnum):
    """AdamW, or Muon for the hidden matrices with AdamW for embeddings, head and vectors (k3.train.optim)."""

    ADAMW = "adamw"
    MUON = "muon"


class Balance(StrEnum):
    """Routing balance (k3.train.routing): quantile balancing, DeepSeek's sign update, or none."""

    QB = "qb"
    DEEPSEEK = "deepseek"
    NONE = "none"


class DType(StrEnum):
    """fp32, or bf16 autocast."""

    FP32 = "fp32"
    BF16 = "bf16"


class EPPolicy(StrEnum):
    """Where the (token, expert) pairs are computed with several processes (k3.dist.planner)."""

    NONE = "none"
    EPLB = "eplb"
    MOONEP = "moonep"


class TrainError(ValueError):
    """A training setup that cannot run; the message says which option and why."""


@dataclass
class TrainConfig:
    preset: str = "tiny"  # a preset name, a config.json path or a checkpoint directory
    data: str = "mqar"  # mqar | copy | PATH.txt
    out: str = "runs/tiny"
    steps: int = 100
    batch_size: int = 8
    seq_len: int = 64
    accum: int = 1  # micro-batches per optimizer step
    lr: float = 1e-3
    optimizer: Optimizer = Optimizer.ADAMW  # Muon: hidden matrices; AdamW for the rest
    muon_fp32: bool = False  # Muon's Newton-Schulz iteration in fp32 (torch.optim.Muon: bf16)
    min_lr_ratio: float = 0.1
    warmup: int = 10
    schedule: Schedule = Schedule.COSINE
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    clip: float = 1.0  # max gradient norm; 0 = no clipping
    dtype: DType = DType.FP32
    seed: int = 0
    balance: Balance = Balance.QB
    qb_iters: int = 1
    balance_ema: float = 0.0
    balance_refresh: bool = False  # QB: refit on the step's batch routed by the updated model
    gamma: float = 1e-3  # DeepSeek step
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    num_kv_pairs: int = 8  # MQAR
    tokenizer: str | None = None  # tokenizer directory for text data (default: the built-in one)
    eval_every: int = 0  # steps between held-out evaluations (0: none); MQAR/copy accuracy
    eval_batches: int = 4
    export: bool = True
    threads: int = 0  # torch CPU threads (0: torch's default); on a busy machine 1 is often fastest
    stop_after: int | None = None  # leave after this step as if killed (tests, time slicing)
    progress: bool = True
    nproc: int = 1  # processes on this machine (> 1: launched through torch.distributed.run)
    expert_parallel: int = 0  # ranks the routed experts are sharded over: 0 = all processes (the only layout)
    ep_policy: EPPolicy = EPPolicy.NONE  # none | eplb | moonep
    ep_slots: int = 1  # replicas of other ranks' experts a rank may host, per layer
    ep_replan_every: int = 10  # eplb: steps between placements, from the loads of the steps before
    ep_timeout: float = 60.0  # seconds a collective waits for every rank before naming the missing one
    ep_threshold: bool = True  # skip replicas whose token traffic is below the weight bytes they cost

    def check(self) -> None:
        def bad(option: str, problem: str) -> None:
            raise TrainError(f"--{option.replace('_', '-')}: {problem}")

        for name in (
            "steps",
            "batch_size",
            "seq_len",
            "accum",
            "checkpoint_every",
            "keep_checkpoints",
            "qb_iters",
        ):
            if getattr(self, name) < 1:
                bad(name, f"must be at least 1, got {getattr(self, name)}")
        if self.schedule not in tuple(Schedule):
            bad("schedule", f"unknown schedule {self.schedule!r} (known: {', '.join(Schedule)})")
        if self.balance not in tuple(Balance):
            bad("balance", f"unknown method {self.balance!r} (known: {', '.join(Balance)})")
        if self.balance_refresh and self.balance != "qb":
            bad("balance-refresh", f"applies to --balance qb only, not {self.balance}")
        if self.optimizer not in tuple(Optimizer):
            bad("optimizer", f"unknown optimizer {self.optimizer!r} (known: {', '.join(Optimizer)})")
        if self.dtype not in tuple(DType):
            bad("dtype", f"must be fp32 or bf16, got {self.dtype!r}")
        if self.warmup < 0:
            bad("warmup", f"must be at least 0, got {self.warmup}")
        if self.lr <= 0:
            bad("lr", f"must be positive, got {self.lr}")
        for name in ("nproc", "ep_replan_every"):
            if getattr(self, name) < 1:
                bad(name, f"must be at least 1, got {getattr(self, name)}")
        if self.expert_parallel < 0:
            bad("expert-parallel", f"must be at least 0 (0: all processes), got {self.expert_parallel}")
        if self.ep_policy not in tuple(EPPolicy):
            bad("ep-policy", f"unknown policy {self.ep_policy!r} (known: {', '.join(EPPolicy)})")
        if self.ep_slots < 0:
            bad("ep-slots", f"must be at least 0, got {self.ep_slots}")
        if self.nproc > 1 and self.expert_parallel not in (0, self.nproc):
            bad(
                "expert-parallel",
                f"shards the experts over all {self.nproc} processes (0 or {self.nproc}), "
                f"got {self.expert_parallel}",
            )
