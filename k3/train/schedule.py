"""Learning-rate schedules: one function, `learning_rate`, and the four variants the commands use, side by
side.

A schedule is a pure function of the optimizer step (0-based), so resuming needs no scheduler state: each
trainer sets the learning rate of every parameter group from it before each optimizer step. The shape: a
linear warm-up to the peak over `warmup` steps (step s gets peak (s + 1) / warmup, never zero), then
`constant` (the peak), `cosine` (a half cosine from the peak down to a floor) or `wsd` (warm-up, stable,
decay: the peak, then a straight line down to the floor over the last `decay_fraction` of the steps).

    variant            command      warm-up        after the warm-up                    floor
    pretraining_rate   k3 train     --warmup (10)  --schedule cosine | wsd | constant   --min-lr-ratio x peak
    sft_rate           k3 rl sft    20 steps       cosine, its phase step / steps       0 (never reached)
    rl_rate            k3 rl        --warmup (10)  constant                             -
    distillation_rate  k3 distill   --warmup (10)  constant, or with --cosine a cosine  0 (at the last step)

Where they differ in more than their numbers, each variant keeps what its command always computed, bit for
bit (runs made before this module was shared resume and reproduce to the byte):
- the warm-up's rounding: `peak * ((s + 1) / warmup)` (`fraction_first`: k3 rl, k3 rl sft) or
  `peak * (s + 1) / warmup` (k3 train, k3 distill); the two differ in the last bit for about 3 steps in 10.
- where the cosine starts (`cosine_from`): `warmup-end` (k3 train: the first step after the warm-up at the
  peak, the last step at the floor), `after-warmup-end` (k3 distill: the first step after the warm-up
  already one step down, the last at the floor), `step-0` (k3 rl sft: the phase runs from step 0, the
  warm-up laid over its start, and the last step stays one step above the floor).
"""

from __future__ import annotations

import math

from k3.train.config import Schedule

SCHEDULES = tuple(Schedule)
COSINE_FROM = ("warmup-end", "after-warmup-end", "step-0")


def learning_rate(
    step: int,
    peak: float,
    total_steps: int,
    warmup_steps: int,
    kind: str = "cosine",
    min_ratio: float = 0.1,
    decay_fraction: float = 0.2,
    *,
    cosine_from: str = "warmup-end",
    fraction_first: bool = False,
) -> float:
    """The learning rate for optimizer step `step` (0-based) of `total_steps`: warm-up over `warmup_steps`,
    then `kind` (constant, cosine or wsd) down to the floor `min_ratio * peak` (see the module's table)."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r} (known: {', '.join(SCHEDULES)})")
    if cosine_from not in COSINE_FROM:
        raise ValueError(f"unknown cosine start {cosine_from!r} (known: {', '.join(COSINE_FROM)})")
    if step < warmup_steps:
        return peak * ((step + 1) / warmup_steps) if fraction_first else peak * (step + 1) / warmup_steps
    if kind == "constant":
        return peak
    floor = min_ratio * peak
    if kind == "cosine":
        if cosine_from == "step-0":
            phase = math.pi * step / total_steps
        elif cosine_from == "warmup-end":  # 0 at the end of warm-up, 1 at the last step
            phase = math.pi * ((step - warmup_steps) / max(total_steps - warmup_steps - 1, 1))
        else:  # 1 / (steps after the warm-up) at the end of warm-up, 1 at the last step (and after)
            phase = math.pi * min(1.0, (step - warmup_steps + 1) / max(1, total_steps - warmup_steps))
        return floor + (peak - floor) * 0.5 * (1 + math.cos(phase))
    decay_steps = max(1, round(decay_fraction * (total_steps - warmup_steps)))
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return peak
    progress = (step - decay_start + 1) / decay_steps  # reaches 1 at the last step
    return peak + (floor - peak) * progress


def pretraining_rate(
    step: int,
    peak: float,
    total_steps: int,
    warmup_steps: int,
    kind: str = "cosine",
    min_ratio: float = 0.1,
    decay_fraction: float = 0.2,
) -> float:
    """`k3 train`: warm-up, then `kind` to `min_ratio * peak` at the last step; steps outside the run and a
    warm-up longer than the run are errors."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r} (known: {', '.join(SCHEDULES)})")
    if total_steps < 1 or not 0 <= warmup_steps <= total_steps:
        raise ValueError(
            f"need 0 <= warmup_steps ({warmup_steps}) <= total_steps ({total_steps}), total >= 1"
        )
    if not 0 <= step < total_steps:
        raise ValueError(f"step {step} is outside 0..{total_steps - 1}")
    return learning_rate(step, peak, total_steps, warmup_steps, kind, min_ratio, decay_fraction)


def sft_rate(step: int, peak: float, total_steps: int, warmup_steps: int) -> float:
    """`k3 rl sft`: warm-up, then a cosine towards 0 whose phase is step / total_steps from step 0."""
    return learning_rate(
        step, peak, total_steps, warmup_steps, "cosine", 0.0, cosine_from="step-0", fraction_first=True
    )


def rl_rate(step: int, peak: float, warmup_steps: int) -> float:
    """`k3 rl`: warm-up, then constant (a run has no fixed length: it may be resumed for more iterations).

    A fresh AdamW's first updates are lr * sign(gradient) for every parameter (its second moment is the
    first squared gradient), whatever the gradient's size; on a policy fine-tuned to its current state,
    with the noisy gradient of a few dozen samples, that step alone moved the policy by a KL of 0.18
    nats per token at lr 1e-3 and cost 13 points of held-out accuracy (docs/rl.md, "Measured")."""
    return learning_rate(step, peak, 0, warmup_steps, "constant", fraction_first=True)


def distillation_rate(step: int, peak: float, total_steps: int, warmup_steps: int, cosine: bool) -> float:
    """`k3 distill`: warm-up (as `k3 rl`'s, for the same reason), then constant, or with `cosine` a cosine
    from the peak after the warm-up to 0 at the last step."""
    kind = "cosine" if cosine else "constant"
    return learning_rate(step, peak, total_steps, warmup_steps, kind, 0.0, cosine_from="after-warmup-end")
