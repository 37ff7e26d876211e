"""Each grader on planted right and wrong answers; held-out problems never drawn for training."""

import pytest

from k3.tasks.codec import CharCodec, CodecError
from k3.tasks.registry import make_task
from k3.tasks.task import Problem, TaskError


def test_arithmetic_grader():
    task = make_task("arithmetic", digits=3, reverse=False)
    p = Problem("123+456=", "579")
    assert task.grade([p, p, p, p], ["579", " 579", "578", "5790"]) == [1.0, 1.0, 0.0, 0.0]
    rev = make_task("arithmetic", digits=3)
    for q in rev.problems(seed=0, iteration=0, count=20):
        a, b = (int(x) for x in q.prompt.rstrip("=").split("+"))
        assert q.answer == str(a + b)[::-1]  # the sum computed here, independently of the task
        assert rev.grade([q], [q.answer]) == [1.0]
        assert rev.grade([q], [str(a + b + 1)[::-1]]) == [0.0]


def test_sort_and_recall_graders():
    sort = make_task("sort", length=5)
    p = sort.sample(__import__("numpy").random.default_rng(0))
    digits = p.prompt.removeprefix("sort:").removesuffix("=")
    assert sort.grade([p, p], ["".join(sorted(digits)), digits[::-1] + "x"]) == [1.0, 0.0]
    recall = make_task("recall", pairs=4)
    q = Problem("a3k7q1z0?k=", "7")
    assert recall.grade([q, q, q], ["7", "3", ""]) == [1.0, 0.0, 0.0]
    for r in recall.problems(0, 0, 10):
        context, key = r.prompt.rstrip("=").split("?")
        assert r.answer == dict(zip(context[::2], context[1::2], strict=True))[key]
    copy = make_task("recall", copy=True)
    c = copy.sample(__import__("numpy").random.default_rng(1))
    assert copy.grade([c, c], [c.prompt[5:-1], c.prompt[5:-2]]) == [1.0, 0.0]


def test_held_out_is_fixed_and_never_trained_on():
    task = make_task("arithmetic", digits=1)  # 81 prompts only: collisions are certain
    task.held_out_size = 40
    held = {p.prompt for p in task.held_out(seed=3)}
    assert len(held) == 40
    assert held == {p.prompt for p in make_task("arithmetic", digits=1, held_out_size=40).held_out(seed=3)}
    for it in range(5):
        assert not held & {p.prompt for p in task.problems(3, it, 50)}
    assert task.problems(3, 1, 8) == task.problems(3, 1, 8)
    assert task.problems(3, 1, 8) != task.problems(3, 2, 8)


def test_too_few_problems_is_an_error_not_a_hang():
    with pytest.raises(TaskError, match="distinct"):
        make_task("arithmetic", digits=1, held_out_size=100).held_out(0)
    with pytest.raises(TaskError, match="held out"):
        make_task("arithmetic", digits=1, held_out_size=81).problems(0, 0, 4)


def test_unknown_task_and_option():
    with pytest.raises(TaskError, match="unknown task"):
        make_task("chess")
    with pytest.raises(TaskError, match="arithmetic"):
        make_task("arithmetic", base=7)


def test_codec_round_trip_and_eos():
    codec = CharCodec(1024)
    assert codec.encode("12+3=") == [ord(c) for c in "12+3="]
    assert codec.eos == 769  # the built-in tokenizer's [EOS]: 768 BPE ranks, then [BOS], [EOS]
    assert codec.decode([*codec.encode("ok"), codec.eos]) == "ok"
    with pytest.raises(CodecError):
        codec.encode("é")
    with pytest.raises(CodecError):
        CharCodec(300)
