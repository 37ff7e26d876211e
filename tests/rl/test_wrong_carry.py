"""`k3 rl sft --wrong-carry P`: a corpus where a documented share of the carry problems is answered with
the carry dropped, checked against sums and counts computed here from the operands."""

from __future__ import annotations

import numpy as np
import pytest

import k3.rl.sft
from k3.rl.sft import SFTConfig, carry_dropped, plant_wrong_carry, sft
from k3.tasks.exact_match import Arithmetic
from k3.tasks.task import TaskError


def operands(prompt: str) -> tuple[int, int]:
    a, b = prompt.rstrip("=").split("+")
    return int(a), int(b)


def no_carry_two_digit(a: int, b: int) -> int:
    """Tens column in full, units column mod 10 (two-digit operands)."""
    return (a // 10 + b // 10) * 10 + (a % 10 + b % 10) % 10


def test_carry_dropped_on_planted_values():
    assert carry_dropped("47+85=", reverse=False) == "122"  # 4+8=12 in full, 7+5=12 -> 2
    assert carry_dropped("47+85=") == "221"
    assert carry_dropped("12+34=") == "64"  # no carry: the sum itself, reversed
    assert carry_dropped("999+1=", reverse=False) == "990"
    assert carry_dropped("95+17=", reverse=False) == "102"  # the sum is 112


def test_planted_share_matches_the_count_of_draws_below_it():
    task = Arithmetic(digits=2, held_out_size=50)
    problems = task.problems(seed=0, iteration=0, count=4000)
    share = 0.6
    planted = plant_wrong_carry(problems, share, np.random.default_rng(7), reverse=True)
    draws = np.random.default_rng(7).random(len(problems))
    expected, carries, wrong = 0, 0, 0
    for p, q, u in zip(problems, planted, draws, strict=True):
        a, b = operands(p.prompt)
        carry = a % 10 + b % 10 >= 10
        carries += carry
        expected += carry and u < share
        assert q.prompt == p.prompt
        if q.answer != str(a + b)[::-1]:
            wrong += 1
            assert carry, p.prompt  # only carry problems are ever changed
            assert q.answer == str(no_carry_two_digit(a, b))[::-1]
    assert wrong == expected
    assert abs(wrong - share * carries) < 4 * (carries * share * (1 - share)) ** 0.5
    assert 0.40 < carries / len(problems) < 0.50  # 2-digit operands: a units carry in 45 of 100 pairs


def test_sft_trains_on_the_planted_answers(monkeypatch, tmp_path):
    seen = []
    real = k3.rl.sft.sft_batch
    monkeypatch.setattr(
        k3.rl.sft,
        "sft_batch",
        lambda problems, codec, skip=None, task=None: (
            seen.append(problems) or real(problems, codec, skip, task)
        ),
    )
    sc = SFTConfig(
        out=str(tmp_path), steps=2, batch_size=64, digits=2, held_out=3, eval_every=9, wrong_carry=1.0
    )
    sft(sc)
    task = Arithmetic(digits=2, held_out_size=3)
    for step, problems in enumerate(seen):
        assert [p.prompt for p in problems] == [p.prompt for p in task.problems(0, step, 64)]
        for p in problems:
            a, b = operands(p.prompt)
            assert p.answer == str(no_carry_two_digit(a, b) if a % 10 + b % 10 >= 10 else a + b)[::-1]


def test_wrong_carry_needs_plain_arithmetic_and_a_share(tmp_path):
    with pytest.raises(TaskError, match="plain arithmetic"):
        sft(SFTConfig(task="sort", out=str(tmp_path), steps=1, wrong_carry=0.5))
    with pytest.raises(TaskError, match="share"):
        sft(SFTConfig(out=str(tmp_path), steps=1, wrong_carry=1.5))
