"""Learning-rate schedules against values worked out by hand, and each command's variant against the formula
that command computed before the schedules were one module (bit for bit)."""

from __future__ import annotations

import math

import pytest

from k3.train.schedule import distillation_rate, learning_rate, pretraining_rate, rl_rate, sft_rate


def test_warmup_is_linear_and_never_zero() -> None:
    assert [pretraining_rate(s, 1.0, 100, 4) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_cosine_runs_from_peak_to_the_floor() -> None:
    lr = [pretraining_rate(s, 2.0, 11, 0, "cosine", min_ratio=0.1) for s in range(11)]
    assert lr[0] == pytest.approx(2.0) and lr[-1] == pytest.approx(0.2)
    assert lr[5] == pytest.approx(0.2 + 1.8 * 0.5 * (1 + math.cos(math.pi / 2)))  # halfway
    assert all(a > b for a, b in zip(lr, lr[1:], strict=False))


def test_wsd_holds_then_decays_linearly_over_the_last_fraction() -> None:
    lr = [pretraining_rate(s, 1.0, 20, 0, "wsd", min_ratio=0.0, decay_fraction=0.2) for s in range(20)]
    assert lr[:16] == [1.0] * 16
    assert lr[16:] == pytest.approx([0.75, 0.5, 0.25, 0.0])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown schedule"):
        pretraining_rate(0, 1.0, 10, 0, "step")
    with pytest.raises(ValueError, match="outside"):
        pretraining_rate(10, 1.0, 10, 0)
    with pytest.raises(ValueError, match="warmup_steps"):
        pretraining_rate(0, 1.0, 10, 11)


# The formulas as k3 rl sft, k3 rl and k3 distill wrote them before k3.train.schedule held all four (828e584).
def _sft_before(step, lr, steps, warmup):
    rate = lr * min(1.0, (step + 1) / max(1, warmup))
    rate *= 0.5 * (1 + math.cos(math.pi * step / steps)) if step >= warmup else 1.0
    return rate


def _rl_before(step, lr, warmup):
    return lr * min(1.0, (step + 1) / warmup) if warmup else lr


def _distill_before(step, peak, total, warmup, cosine):
    if step < warmup:
        return peak * (step + 1) / warmup
    if not cosine:
        return peak
    progress = min(1.0, (step - warmup + 1) / max(1, total - warmup))
    return peak * 0.5 * (1 + math.cos(math.pi * progress))


PEAKS = (1e-3, 3e-3, 1e-2, 0.02, 0.3, 7e-5)


def test_each_variant_is_its_command_s_old_formula_bit_for_bit():
    for peak in PEAKS:
        for total in (1, 2, 3, 7, 24, 300):
            for warmup in (0, 1, 3, 10, 20):
                for step in range(total):
                    assert sft_rate(step, peak, total, warmup) == _sft_before(step, peak, total, warmup)
                    assert rl_rate(step, peak, warmup) == _rl_before(step, peak, warmup)
                    for cosine in (False, True):
                        got = distillation_rate(step, peak, total, warmup, cosine)
                        assert got == _distill_before(step, peak, total, warmup, cosine)


def test_the_variants_are_learning_rate_with_named_options():
    """The rounding of the warm-up differs between the variants (so they keep their bytes): planted here,
    3e-3 * (1 / 7) and 3e-3 * 1 / 7 are two different floats, and k3 train's last warm-up step of 3 at
    3e-3 is 3e-3 * 3 / 3 = 0.0030000000000000005, not the peak."""
    assert 3e-3 * (1 / 7) != 3e-3 * 1 / 7
    assert (
        rl_rate(0, 3e-3, 7) == 3e-3 * (1 / 7) == learning_rate(0, 3e-3, 0, 7, "constant", fraction_first=True)
    )
    assert sft_rate(0, 3e-3, 100, 7) == 3e-3 * (1 / 7)
    assert distillation_rate(0, 3e-3, 9, 7, True) == pretraining_rate(0, 3e-3, 9, 7) == 3e-3 * 1 / 7
    assert pretraining_rate(2, 3e-3, 9, 3) == 0.0030000000000000005 != rl_rate(2, 3e-3, 3) == 3e-3
    with pytest.raises(ValueError, match="cosine start"):
        learning_rate(5, 1.0, 10, 0, cosine_from="middle")
