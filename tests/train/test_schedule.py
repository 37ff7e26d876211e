"""Learning-rate schedules against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from k3.train.schedule import learning_rate


def test_warmup_is_linear_and_never_zero() -> None:
    assert [learning_rate(s, 1.0, 100, 4) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_cosine_runs_from_peak_to_the_floor() -> None:
    lr = [learning_rate(s, 2.0, 11, 0, "cosine", min_ratio=0.1) for s in range(11)]
    assert lr[0] == pytest.approx(2.0) and lr[-1] == pytest.approx(0.2)
    assert lr[5] == pytest.approx(0.2 + 1.8 * 0.5 * (1 + math.cos(math.pi / 2)))  # halfway
    assert all(a > b for a, b in zip(lr, lr[1:], strict=False))


def test_wsd_holds_then_decays_linearly_over_the_last_fraction() -> None:
    lr = [learning_rate(s, 1.0, 20, 0, "wsd", min_ratio=0.0, decay_fraction=0.2) for s in range(20)]
    assert lr[:16] == [1.0] * 16
    assert lr[16:] == pytest.approx([0.75, 0.5, 0.25, 0.0])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown schedule"):
        learning_rate(0, 1.0, 10, 0, "step")
    with pytest.raises(ValueError, match="outside"):
        learning_rate(10, 1.0, 10, 0)
    with pytest.raises(ValueError, match="warmup_steps"):
        learning_rate(0, 1.0, 10, 11)
