"""The code task's grader runs programs in k3.sandbox: right programs pass, wrong ones, crashes, an
infinite loop and a fork bomb score 0 (killed by the sandbox), and the grader keeps going after each."""

import time

import numpy as np
import pytest

from k3.tasks.code_task import TEST_INPUTS, CodeTask
from k3.tasks.task import Problem, TaskError

FORK_BOMB = "import os\nwhile True:\n    os.fork()"
LOOP = "def f(x):\n    while True:\n        pass"


@pytest.fixture(scope="module")
def task():
    return CodeTask(timeout_s=3.0)


def test_expected_values_from_the_spec(task):
    p = Problem("f:7x+3;", "def f(x):return 7*x+3")
    assert task.expected(p) == [7 * x + 3 for x in TEST_INPUTS]
    assert task.expected(Problem("f:max(x,4);", "")) == [max(x, 4) for x in TEST_INPUTS]
    with pytest.raises(TaskError):
        task.expected(Problem("f:x**2;", ""))


def test_planted_programs(task):
    p = Problem("f:7x+3;", "def f(x):return 7*x+3")
    programs = [
        p.answer,  # right
        "def f(x):\n    return 3 + x * 7",  # right, written differently
        "def f(x):return 7*x+4",  # wrong value
        "def f(x) return",  # syntax error
        "def f(x):return 1/0",  # crash
        LOOP,  # infinite loop: timeout
        FORK_BOMB,  # pids limit (or timeout)
        'print("PASS")\nimport sys\nsys.exit(0)',  # exits before the tests: cannot print the nonce
        p.answer,  # the sandbox still works after the bomb
    ]
    began = time.monotonic()
    rewards = task.grade([p] * len(programs), programs)
    assert rewards == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert time.monotonic() - began < 60  # the loop and the bomb were cut by their timeouts


def test_reference_answers_pass(task):
    problems = task.problems(seed=0, iteration=0, count=6)
    assert task.grade(problems, [p.answer for p in problems]) == [1.0] * 6
    assert task.grade(problems, [p.answer + "+1" for p in problems]) == [0.0] * 6


def test_a_missing_backend_is_a_setup_error():
    with pytest.raises(TaskError, match="sandbox could not be created"):
        CodeTask(backend="nonesuch").grade([Problem("f:x%3;", "")], ["def f(x):return x%3"])


def test_sample_is_deterministic():
    a = CodeTask().sample(np.random.default_rng(5))
    assert a == CodeTask().sample(np.random.default_rng(5))
