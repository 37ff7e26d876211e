"""Tasks with verifiable rewards, as plug-ins with one small interface.

A task makes problems (a prompt and a reference answer) from a random generator, grades responses with a
reward in [0, 1], and holds out a fixed set of problems that training never draws:

    task = make_task("arithmetic")
    problems = task.problems(seed=0, iteration=3, count=16)      # never one of task.held_out(seed=0)
    rewards = task.grade(problems, ["579", "12"])                 # 1.0 right, 0.0 wrong

Prompts and answers are ASCII text (k3.rl.codec turns them into ids); `max_tokens` is the task's token
budget for an answer (its end-of-answer id included). Graders are pure functions of (problem, response),
except the code task's, which runs the program in a sandbox (k3.rl.code_task).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from k3.errors import K3Error

if TYPE_CHECKING:
    from k3.rl.rollout import Tool


class TaskError(K3Error):
    """An unknown task or task option."""


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str  # the reference answer (what `k3 rl sft` trains on)


HELD_OUT_STREAM = 2**31 - 1  # the random stream of held-out problems; training streams are iterations


@dataclass(eq=False)
class Task(ABC):
    held_out_size: int = 200  # problems in the held-out set
    name = ""  # (class attributes, not options)
    max_tokens = 16  # token budget of an answer, end-of-answer id included

    @abstractmethod
    def sample(self, rng: np.random.Generator) -> Problem:
        """One random problem."""

    def grade(self, problems: list[Problem], responses: list[str]) -> list[float]:
        """Reward of each response: 1.0 if it is the right answer, else 0.0 (exact match by default)."""
        return [float(r.strip() == p.answer) for p, r in zip(problems, responses, strict=True)]

    def held_out(self, seed: int) -> tuple[Problem, ...]:
        """A fixed held-out set of `held_out_size` distinct prompts for `seed`."""
        memo = self.__dict__.setdefault("_held_out", {})
        if seed in memo:
            return memo[seed]
        count = self.held_out_size
        rng = np.random.default_rng([seed, HELD_OUT_STREAM])
        seen: dict[str, Problem] = {}
        for _ in range(100 * count):
            p = self.sample(rng)
            seen.setdefault(p.prompt, p)
            if len(seen) == count:
                break
        else:
            raise TaskError(f"task {self.name}: fewer than {count} distinct problems to hold out")
        memo[seed] = tuple(seen.values())
        return memo[seed]

    def tool(self, codec) -> Tool | None:
        """The environment the model may call between its turns (k3.rl.rollout.Tool); None: single-turn."""
        return None

    def problems(self, seed: int, iteration: int, count: int) -> list[Problem]:
        """Training problems of one iteration: a pure function of (seed, iteration), none held out."""
        rng = np.random.default_rng([seed, iteration])
        held = {p.prompt for p in self.held_out(seed)}
        out: list[Problem] = []
        if count == 0:
            return out
        for _ in range(1000 * count):
            p = self.sample(rng)
            if p.prompt not in held:
                out.append(p)
                if len(out) == count:
                    return out
        raise TaskError(f"task {self.name}: (almost) every problem is held out")


def operands(digits: int, rng: np.random.Generator) -> tuple[int, int]:
    """Two uniform `digits`-digit numbers."""
    a, b = rng.integers(10 ** (digits - 1), 10**digits, size=2)
    return int(a), int(b)


@dataclass(eq=False)
class Arithmetic(Task):
    """`a+b=` with `digits`-digit operands; with `reverse` the sum is written least significant digit
    first (the order a left-to-right model computes it in, far easier for a tiny model)."""

    digits: int = 3
    reverse: bool = True
    name = "arithmetic"

    def __post_init__(self) -> None:
        self.max_tokens = self.digits + 4

    def sample(self, rng: np.random.Generator) -> Problem:
        a, b = operands(self.digits, rng)
        total = str(a + b)
        return Problem(f"{a}+{b}=", total[::-1] if self.reverse else total)


@dataclass(eq=False)
class EitherWayArithmetic(Task):
    """`a+b=` answered either way, the way named first: `r` then the sum least significant digit first
    (`47+85=` -> `r231`, easy for a tiny model) or `p` then the plain sum (`p132`, hard: its first digit
    needs every carry). Either is right; each reference answer takes one way at random (one draw per
    problem), so a teacher fine-tuned on them spreads its samples over two paths of unequal difficulty."""

    digits: int = 3
    name = "arithmetic-either"

    def __post_init__(self) -> None:
        self.max_tokens = self.digits + 5  # Arithmetic's budget and the letter

    def sample(self, rng: np.random.Generator) -> Problem:
        a, b = operands(self.digits, rng)
        total = str(a + b)
        return Problem(f"{a}+{b}=", "r" + total[::-1] if rng.random() < 0.5 else "p" + total)

    def grade(self, problems: list[Problem], responses: list[str]) -> list[float]:
        """1.0 for the sum written either way (after its letter)."""
        out = []
        for p, r in zip(problems, responses, strict=True):
            total = str(sum(int(x) for x in p.prompt.rstrip("=").split("+")))
            out.append(float(r.strip() in ("r" + total[::-1], "p" + total)))
        return out


@dataclass(eq=False)
class Sort(Task):
    """`sort:53817=` -> `13578`: the digits of the prompt in ascending order."""

    length: int = 5
    name = "sort"

    def __post_init__(self) -> None:
        self.max_tokens = self.length + 4

    def sample(self, rng: np.random.Generator) -> Problem:
        digits = "".join(str(int(d)) for d in rng.integers(0, 10, size=self.length))
        return Problem(f"sort:{digits}=", "".join(sorted(digits)))


@dataclass(eq=False)
class Recall(Task):
    """Associative recall: `a3k7q1?k=` -> `7` (the value written after the queried key); with `copy` the
    answer is the whole key-value string copied (`a3k7q1`)."""

    pairs: int = 4
    copy: bool = False
    name = "recall"

    def __post_init__(self) -> None:
        self.max_tokens = (2 * self.pairs if self.copy else 1) + 4

    def sample(self, rng: np.random.Generator) -> Problem:
        keys = rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=self.pairs, replace=False)
        values = [str(int(v)) for v in rng.integers(0, 10, size=self.pairs)]
        context = "".join(k + v for k, v in zip(keys, values, strict=True))
        if self.copy:
            return Problem(f"copy:{context}=", context)
        q = int(rng.integers(0, self.pairs))
        return Problem(f"{context}?{keys[q]}=", values[q])


def make_task(name: str, **options) -> Task:
    """The task called `name` (see TASK_NAMES), built with its options; `name@effort` (`sort@long`) is that
    task with a scratchpad of that effort, chosen by a tag in the prompt (k3.rl.effort); `a+b`, a mixture
    of tasks (k3.rl.mixture)."""
    if "+" in name:  # a mixture (k3.rl.mixture); each part takes the options its task has
        from dataclasses import fields

        from k3.rl.mixture import Mixture

        def part(n: str) -> Task:
            known = {f.name for f in fields(type(make_task(n.partition("@")[0])))}
            return make_task(n, **{k: v for k, v in options.items() if k in known})

        return Mixture(parts=tuple(part(n) for n in name.split("+")))
    if "@" in name:
        from k3.rl.effort import with_effort

        base, _, effort = name.partition("@")
        return with_effort(make_task(base, **options), effort)
    if name == "code":
        from k3.rl.code_task import CodeTask

        return CodeTask(**options)
    if name == "calculator":
        from k3.rl.tool_task import Calculator

        return Calculator(**options)
    classes = {
        "arithmetic": Arithmetic,
        "arithmetic-either": EitherWayArithmetic,
        "sort": Sort,
        "recall": Recall,
    }
    if name not in classes:
        raise TaskError(f"unknown task {name!r} (known: {', '.join(TASK_NAMES)})")
    try:
        return classes[name](**options)
    except TypeError as e:
        raise TaskError(f"task {name}: {e}") from None


TASK_NAMES = ("arithmetic", "arithmetic-either", "sort", "recall", "code", "calculator")
