"""Reasoning efforts and task mixtures: every scratchpad against a computation of its own (integer carries,
Counter, dict), only the final answer graded, held-out sets shared with the plain task and never trained
on; a mixture's parts, options and held-out union; the teacher spec and the RL baseline's advantage."""

from collections import Counter

import numpy as np
import pytest
import torch

from k3.distill.config import DistillError
from k3.distill.losses import reward_advantages
from k3.distill.teachers import assign_domains, parse_teacher
from k3.tasks.effort import is_task_name
from k3.tasks.registry import make_task
from k3.tasks.task import Problem, TaskError


def _carries_and_totals(a: int, b: int, digits: int) -> tuple[str, str]:
    """Column i's carry out: whether the low i + 1 digits overflow; its total: digit sum + carry in."""
    carries, totals = "", []
    for i in range(digits):
        m = 10 ** (i + 1)
        carries += str(int(a % m + b % m >= m))
        carry_in = int(a % (m // 10) + b % (m // 10) >= m // 10)
        totals.append(f"{(a // (m // 10)) % 10 + (b // (m // 10)) % 10 + carry_in:02d}")
    return carries, " ".join(totals)


def test_arithmetic_scratchpads_and_final_answer_grading():
    for effort in ("no", "short", "long"):
        task = make_task(f"arithmetic@{effort}", digits=3, held_out_size=20)
        plain = make_task("arithmetic", digits=3, held_out_size=20)
        for p, q in zip(task.problems(0, 4, 30), plain.problems(0, 4, 30), strict=True):
            a, b = (int(x) for x in q.prompt.rstrip("=").split("+"))
            assert p.prompt == f"<{effort}>{q.prompt}"
            short, long = _carries_and_totals(a, b, 3)
            pad = {"no": "", "short": short + ";", "long": long + ";"}[effort]
            assert p.answer == pad + str(a + b)[::-1]
            assert len(p.answer) < task.max_tokens  # the budget holds the answer and its end id
            wrong_pad = "9" * len(pad.rstrip(";")) + ";" if pad else ""
            right, wrong = str(a + b)[::-1], str(a + b + 1)[::-1]
            assert task.grade([p] * 3, [p.answer, wrong_pad + right, pad + wrong]) == [1.0, 1.0, 0.0]
        assert [p.prompt for p in task.held_out(0)] == [f"<{effort}>{q.prompt}" for q in plain.held_out(0)]
        held = {p.prompt for p in task.held_out(0)}
        assert not held & {p.prompt for it in range(20) for p in task.problems(0, it, 10)}


def test_sort_and_recall_scratchpads():
    rng = np.random.default_rng(5)
    for effort in ("short", "long"):
        sort = make_task(f"sort@{effort}", length=6)
        for p in sort.problems(1, 0, 20):
            digits = p.prompt.removeprefix(f"<{effort}>sort:").removesuffix("=")
            counts = Counter(digits)
            pad = (
                "".join(sorted(counts))
                if effort == "short"
                else "".join(str(counts[str(d)]) for d in range(10))
            )
            assert p.answer == f"{pad};{''.join(sorted(digits))}"
        recall = make_task(f"recall@{effort}", pairs=4)
        for p in recall.problems(1, 0, 20):
            context, key = p.prompt.removeprefix(f"<{effort}>").rstrip("=").split("?")
            value = dict(zip(context[::2], context[1::2], strict=True))[key]
            pad = key + value if effort == "short" else ",".join(context[i : i + 2] for i in range(0, 8, 2))
            assert p.answer == f"{pad};{value}"
            assert recall.grade([p, p], [f"x;{value}", f"{pad};{(int(value) + 1) % 10}"]) == [1.0, 0.0]
    with pytest.raises(TaskError, match="effort"):
        make_task("sort@huge")
    with pytest.raises(TaskError, match="no scratchpad"):
        make_task("recall@long", copy=True)
    assert make_task("sort@no").sample(rng).prompt.startswith("<no>sort:")


def test_mixture_parts_options_and_held_out_union():
    mix = make_task("arithmetic@long+sort+recall", digits=2, held_out_size=15)
    parts = [make_task("arithmetic@long", digits=2, held_out_size=15), make_task("sort"), make_task("recall")]
    assert mix.max_tokens == max(p.max_tokens for p in parts)
    held = [p.prompt for p in mix.held_out(0)]
    assert held == [p.prompt for part in parts for p in part.held_out(0)[:15]]
    drawn = [p for it in range(30) for p in mix.problems(0, it, 20)]
    assert not set(held) & {p.prompt for p in drawn}
    kinds = Counter("arith" if p.prompt.startswith("<long>") else p.prompt[:5] == "sort:" for p in drawn)
    assert min(kinds.values()) > 150  # 600 draws, each part about a third
    arith = [p for p in drawn if p.prompt.startswith("<long>")]
    assert all(len(p.prompt) == len("<long>12+34=") for p in arith)  # digits reached the arithmetic part
    p = Problem("<long>12+34=", "06 04;64")
    assert mix.grade([p, p, p], ["06 04;64", "64", "06 04;65"]) == [1.0, 1.0, 0.0]
    with pytest.raises(TaskError, match="mixture"):
        make_task("sort+code")


def test_teacher_specs_at_an_effort():
    assert is_task_name("arithmetic@long") and is_task_name("sort") and not is_task_name("sort@huge")
    spec = parse_teacher("ar_long=runs/t/arithmetic@long/checkpoint:arithmetic@long")
    assert (spec.source, spec.task) == ("runs/t/arithmetic@long/checkpoint", "arithmetic@long")
    generalist = parse_teacher("gen=ckpt")
    assert assign_domains([generalist], ["arithmetic@no", "arithmetic@long"]) == {
        "arithmetic@long": "gen",
        "arithmetic@no": "gen",
    }
    with pytest.raises(DistillError, match="unknown task"):
        assign_domains([generalist], ["arithmetic@huge"])


def test_reward_advantages_are_group_centred_rewards():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])  # two groups of three
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float)
    expected = [2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3]
    adv = reward_advantages(rewards, mask, 3)
    for b, e in enumerate(expected):
        assert torch.allclose(adv[b], e * mask[b])


def test_pad_noise_plants_one_wrong_scratchpad_digit_and_sft_skips_it(tmp_path):
    from k3.rl.sft import IGNORE, SFTConfig, sft, sft_batch
    from k3.tasks.codec import CharCodec
    from k3.tasks.effort import SEPARATOR, plant_pad_noise

    for name in ("arithmetic@long", "arithmetic@short", "sort@long", "recall@long"):
        clean = make_task(name, held_out_size=5).problems(0, 1, 200)
        noisy, planted = plant_pad_noise(clean, 1.0, np.random.default_rng(3))
        for p, q, i in zip(clean, noisy, planted, strict=True):
            diff = [k for k, (a, b) in enumerate(zip(p.answer, q.answer, strict=True)) if a != b]
            assert diff == [i] and i < p.answer.index(SEPARATOR)  # one character, inside the scratchpad
            assert p.answer[i].isdigit() and q.answer[i].isdigit() and q.prompt == p.prompt
        assert plant_pad_noise(clean, 0.0, np.random.default_rng(3)) == (clean, [None] * len(clean))
    many = make_task("arithmetic@long", held_out_size=5).problems(0, 2, 2000)
    share = sum(i is not None for i in plant_pad_noise(many, 0.3, np.random.default_rng(4))[1]) / 2000
    assert abs(share - 0.3) < 0.04  # binomial sd ~0.01
    no_pad = make_task("arithmetic@no", held_out_size=5).problems(0, 1, 20)
    assert plant_pad_noise(no_pad, 1.0, np.random.default_rng(3))[1] == [None] * 20
    codec = CharCodec(1024)
    noisy, planted = plant_pad_noise(clean[:8], 0.5, np.random.default_rng(5))
    assert 0 < sum(i is not None for i in planted) < 8
    _, plain_labels = sft_batch(noisy, codec)
    inputs, labels = sft_batch(noisy, codec, planted)
    for b, (p, i) in enumerate(zip(noisy, planted, strict=True)):
        changed = (labels[b] != plain_labels[b]).nonzero().flatten().tolist()
        # the label predicting answer character i sits at prompt length - 1 + i
        assert changed == ([] if i is None else [len(p.prompt) - 1 + i]) and (
            i is None or labels[b, changed[0]] == IGNORE
        )
    with pytest.raises(TaskError, match="--pad-noise"):
        sft(SFTConfig(task="arithmetic@no", out=str(tmp_path), steps=1, pad_noise=0.5))


def test_erasures_are_read_before_grading_at_the_fix_effort():
    from k3.tasks.effort import ERASE, erase

    # erase against a slow reading: each ERASE removes the nearest kept character to its left
    rng = np.random.default_rng(7)
    for _ in range(200):
        text = "".join(rng.choice(list("0123;" + ERASE), size=int(rng.integers(0, 12))))
        kept = [True] * len(text)
        for j, c in enumerate(text):
            kept[j] = c != ERASE
            if c == ERASE:
                left = [k for k in range(j) if kept[k]]
                if left:
                    kept[left[-1]] = False
        assert erase(text) == "".join(c for c, k in zip(text, kept, strict=True) if k)
    fix, long = make_task("arithmetic@fix", digits=2), make_task("arithmetic@long", digits=2)
    assert fix.max_tokens == long.max_tokens + 4
    for p, q in zip(fix.problems(0, 3, 20), long.problems(0, 3, 20), strict=True):
        assert (p.prompt, p.answer) == ("<fix>" + q.prompt.removeprefix("<long>"), q.answer)
        i = p.answer.index(";") + 1  # the first digit of the final answer
        wrong = str((int(p.answer[i]) + 1) % 10)
        taken_back = p.answer[:i] + wrong + ERASE + p.answer[i:]
        left = p.answer[:i] + wrong + p.answer[i + 1 :]
        assert fix.grade([p] * 3, [taken_back, left, p.answer + ERASE]) == [1.0, 0.0, 0.0]
        assert long.grade([q], [taken_back])[0] == 0.0  # only fix reads erasures
    mixed = make_task("arithmetic@fix+sort@long", digits=2, length=5)
    p, s = fix.problems(0, 4, 1)[0], make_task("sort@long", length=5).problems(0, 4, 1)[0]
    assert mixed.grade([p, p, s], [p.answer[:2] + "7" + ERASE + p.answer[2:], "x", s.answer]) == [1, 0, 1]


def test_corrected_pad_noise_plants_a_wrong_digit_and_its_erasure():
    from k3.rl.sft import IGNORE, sft_batch
    from k3.tasks.codec import CharCodec
    from k3.tasks.effort import ERASE, erase, plant_pad_noise

    clean = make_task("arithmetic@fix", digits=2).problems(0, 1, 400)
    noisy, planted = plant_pad_noise(clean, 1.0, np.random.default_rng(3), corrected=True)
    in_answer = 0
    for p, q, i in zip(clean, noisy, planted, strict=True):
        assert q.answer[:i] == p.answer[:i] and q.answer[i + 1 :] == ERASE + p.answer[i:]
        assert q.answer[i].isdigit() and q.answer[i] != p.answer[i] and erase(q.answer) == p.answer
        in_answer += i > p.answer.index(";")
    assert 0.2 < in_answer / 400 < 0.5  # 3 of the 8 digits are the final answer's: some land there
    _, labels = sft_batch(noisy[:4], CharCodec(1024), planted[:4])
    for b, (q, i) in enumerate(zip(noisy[:4], planted[:4], strict=True)):
        at = len(q.prompt) - 1 + i
        assert labels[b, at] == IGNORE and labels[b, at + 1] == ord(ERASE)  # the erasure is learned


def test_either_way_arithmetic_takes_both_ways_and_its_references_use_both():
    task = make_task("arithmetic-either", digits=2, held_out_size=20)
    problems = task.problems(0, 1, 400)
    ways = Counter(p.answer[0] for p in problems)
    assert set(ways) == {"r", "p"} and abs(ways["r"] - 200) < 40  # one fair draw per problem (sd 10)
    for p in problems[:50]:
        a, b = (int(x) for x in p.prompt.rstrip("=").split("+"))
        assert p.answer in ("r" + str(a + b)[::-1], "p" + str(a + b))
        both = ["r" + str(a + b)[::-1], "p" + str(a + b), "p" + str(a + b)[::-1], "r" + str(a + b + 1)[::-1]]
        right = [1.0, 1.0, float(str(a + b) == str(a + b)[::-1]), 0.0]  # a palindrome is right either way
        assert task.grade([p] * 4, both) == right
        assert len(p.answer) < task.max_tokens
    assert not {p.prompt for p in task.held_out(0)} & {p.prompt for p in problems}
