"""Learning-rate schedules: linear warm-up, then cosine decay or warm-up-stable-decay (WSD).

A schedule is a pure function of the step, so resuming needs no scheduler state: the trainer sets the
learning rate of every parameter group from `learning_rate(step, ...)` before each optimizer step.
"""

from __future__ import annotations

import math

from k3.train.config import Schedule

SCHEDULES = tuple(Schedule)


def learning_rate(
    step: int,
    peak: float,
    total_steps: int,
    warmup_steps: int,
    kind: str = "cosine",
    min_ratio: float = 0.1,
    decay_fraction: float = 0.2,
) -> float:
    """The learning rate for optimizer step `step` (0-based) of `total_steps`.

    Warm-up rises linearly to `peak` over `warmup_steps` (step 0 gets peak / warmup_steps, never zero).
    Then `cosine` falls to `min_ratio * peak` at the last step; `wsd` stays at `peak` and decays linearly
    to `min_ratio * peak` over the last `decay_fraction` of the steps; `constant` stays at `peak`.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r} (known: {', '.join(SCHEDULES)})")
    if total_steps < 1 or not 0 <= warmup_steps <= total_steps:
        raise ValueError(
            f"need 0 <= warmup_steps ({warmup_steps}) <= total_steps ({total_steps}), total >= 1"
        )
    if not 0 <= step < total_steps:
        raise ValueError(f"step {step} is outside 0..{total_steps - 1}")
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    floor = min_ratio * peak
    if kind == "constant":
        return peak
    if kind == "cosine":
        span = total_steps - warmup_steps
        progress = (step - warmup_steps) / max(span - 1, 1)  # 0 at the end of warm-up, 1 at the last step
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_steps = max(1, round(decay_fraction * (total_steps - warmup_steps)))
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return peak
    progress = (step - decay_start + 1) / decay_steps  # reaches 1 at the last step
    return peak + (floor - peak) * progress
