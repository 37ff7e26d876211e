"""A code task graded by running the model's program in a sandbox (k3.sandbox).

The prompt names a function of x (`f:7x+3;`), the reference answer is a one-line Python program defining
it (`def f(x):return 7*x+3`). Grading appends unit tests to the response and runs it with `python3` inside
one sandbox per batch, each program under its own timeout; the reward is 1.0 only if the program printed
the grader's one-off nonce after the tests and exited 0. A crash, a wrong value, a timeout, a fork bomb
(the sandbox's pids limit) or a sandbox that fails to run the program at all gives 0.0: the model's
program can never stop the trainer.
A sandbox that cannot even be created is a setup error (TaskError), not a reward of 0.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

import numpy as np

from k3.tasks.task import Problem, Task, TaskError

TEST_INPUTS = (0, 1, 2, 5, -3, 11)
_FORMS = (
    ("{a}x+{b}", "{a}*x+{b}", lambda x, a, b: a * x + b),
    ("{a}x-{b}", "{a}*x-{b}", lambda x, a, b: a * x - b),
    ("xx+{b}", "x*x+{b}", lambda x, a, b: x * x + b),
    ("x%{a}", "x%{a}", lambda x, a, b: x % a),
    ("max(x,{b})", "max(x,{b})", lambda x, a, b: max(x, b)),
)


def harness(program: str, expected: list[int], nonce: str) -> str:
    """The response followed by its unit tests: prints `nonce` when f gives `expected` on TEST_INPUTS
    (a program that prints something and exits before the tests cannot know the nonce)."""
    return f"{program}\nassert [f(x) for x in {list(TEST_INPUTS)}] == {expected}\nprint({nonce!r})\n"


@dataclass(eq=False)
class CodeTask(Task):
    backend: str = "bwrap"  # k3.sandbox backend: bwrap (fast, stateless) or gvisor
    held_out_size: int = 50  # of 350 distinct problems
    timeout_s: float = 5.0  # per program
    memory_mb: int = 256
    pids: int = 16
    name = "code"
    max_tokens = 32

    def sample(self, rng: np.random.Generator) -> Problem:
        spec, body, _ = _FORMS[int(rng.integers(0, len(_FORMS)))]
        a, b = int(rng.integers(2, 10)), int(rng.integers(1, 20))
        return Problem(f"f:{spec.format(a=a, b=b)};", f"def f(x):return {body.format(a=a, b=b)}")

    def expected(self, problem: Problem) -> list[int]:
        """The values the reference program gives on TEST_INPUTS (from the problem's spec, not by running
        the reference)."""
        spec = problem.prompt.removeprefix("f:").removesuffix(";")
        for pattern, _, fn in _FORMS:
            numbers = _numbers(pattern, spec)
            if numbers is not None:
                return [fn(x, *numbers) for x in TEST_INPUTS]
        raise TaskError(f"code task: {problem.prompt!r} is not one of its prompts")

    def grade(self, problems: list[Problem], responses: list[str]) -> list[float]:
        from k3.sandbox import Limits, Sandbox

        limits = Limits(cpus=0.5, memory_mb=self.memory_mb, pids=self.pids, disk_mb=64, output_mb=1)
        try:
            sbx = Sandbox.create(template="python", timeout=300, limits=limits, backend=self.backend)
        except Exception as e:  # the setup, not the model: say so
            raise TaskError(f"code task: the sandbox could not be created ({e})") from e
        rewards = []
        try:
            for i, (problem, response) in enumerate(zip(problems, responses, strict=True)):
                nonce = secrets.token_hex(8)
                source = harness(response, self.expected(problem), nonce)
                rewards.append(self._run_one(sbx, i, source, nonce))
        finally:
            try:
                sbx.kill()
            except Exception:  # noqa: S110 (already dead: a fork bomb may take the sandbox with it)
                pass
        return rewards

    def _run_one(self, sbx, index: int, source: str, nonce: str) -> float:
        path = f"p{index}.py"
        try:
            sbx.files.write(path, source)
            result = sbx.commands.run(f"python3 {path}", timeout=self.timeout_s)
        except Exception:  # the program broke the sandbox: reward 0, never a crashed trainer
            return 0.0
        passed = result.killed_by is None and result.exit_code == 0 and result.stdout.strip() == nonce
        return float(passed)


def _numbers(pattern: str, spec: str) -> tuple[int, int] | None:
    """(a, b) read back from `spec` if it is written with `pattern` (absent ones are 0), else None."""
    regex = re.escape(pattern).replace(r"\{a\}", r"(?P<a>\d+)").replace(r"\{b\}", r"(?P<b>\d+)")
    m = re.fullmatch(regex, spec)
    if m is None:
        return None
    found = m.groupdict()
    return int(found.get("a") or 0), int(found.get("b") or 0)
