"""Tasks graded by exact match of the answer: arithmetic (one or either digit order), sort, and key-value
recall (or copy). Each is a `k3.tasks.task.Task`; `k3.tasks.registry.make_task` builds them by name."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from k3.tasks.task import Problem, Task, operands


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
