"""Reasoning efforts: a task with no, a short or a long scratchpad, chosen by a tag in the prompt.

`make_task("arithmetic@long")` is the arithmetic task whose prompts start with the tag `<long>` and whose
reference answers write a scratchpad, then `;`, then the task's answer:

    <no>47+85=      ->  231                  (reversed sum, as the plain task)
    <short>47+85=   ->  11;231               (the carry out of each column, least significant first)
    <long>47+85=    ->  12 13;231            (each column's total, carry in included)
    <short>sort:53813=  ->  1358;13358       (the distinct digits)
    <long>sort:53813=   ->  0102010110;13358 (how often each digit 0-9 occurs)
    <short>a3k7q1?k=    ->  k7;7             (the queried pair)
    <long>a3k7q1?k=     ->  a3,k7,q1;7       (every pair)
    <fix>47+85=     ->  12 13;231            (long's, where a `<` erases the character before it:
                                              `12 14<3;231` is the same answer)

Only the final answer (the text after the last `;`, or the whole response without one) is graded, by the
task's own grader: the scratchpad is what the effort spends, not what is checked. The held-out set is the
task's own held-out problems, tagged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from k3.tasks.task import TASK_NAMES, Problem, Task, TaskError

EFFORTS = ("no", "short", "long", "fix")
SEPARATOR = ";"
ERASE = "<"  # at the `fix` effort: takes back the character before it
ERASE_BUDGET = 4  # `fix`'s extra answer tokens: two corrections (`wrong digit`, ERASE)


def erase(text: str) -> str:
    """`text` with each ERASE applied, left to right: it and the character before it removed."""
    kept: list[str] = []
    for c in text:
        if c != ERASE:
            kept.append(c)
        elif kept:
            kept.pop()
    return "".join(kept)


def is_task_name(name: str) -> bool:
    """A task of TASK_NAMES, or one of them at an effort (`sort@long`)."""
    base, at, effort = name.partition("@")
    return base in TASK_NAMES and (not at or effort in EFFORTS)


def _arithmetic_pad(task, problem: Problem, effort: str) -> str:
    a, b = problem.prompt.rstrip("=").split("+")
    carry, carries, totals = 0, [], []
    for x, y in zip(reversed(a.zfill(len(b))), reversed(b.zfill(len(a))), strict=True):
        total = int(x) + int(y) + carry
        carry = total // 10
        carries.append(str(carry))
        totals.append(f"{total:02d}")
    return "".join(carries) if effort == "short" else " ".join(totals)  # long (and fix)


def _sort_pad(task, problem: Problem, effort: str) -> str:
    digits = problem.prompt[len("sort:") : -1]
    if effort == "short":
        return "".join(sorted(set(digits)))
    return "".join(str(digits.count(str(d))) for d in range(10))


def _recall_pad(task, problem: Problem, effort: str) -> str:
    context, _, key = problem.prompt.rstrip("=").partition("?")
    pairs = [context[i : i + 2] for i in range(0, len(context), 2)]
    if effort == "short":
        return next(p for p in pairs if p[0] == key)
    return ",".join(pairs)


def _pad_bound(task: Task, effort: str) -> int:
    """The longest scratchpad of `task` at `effort` (characters)."""
    if task.name == "arithmetic":
        return task.digits if effort == "short" else 3 * task.digits - 1
    if task.name == "sort":
        return task.length if effort == "short" else 10
    return 2 if effort == "short" else 3 * task.pairs - 1


def _pad_effort(effort: str) -> str:
    """The scratchpad an effort writes: `fix` writes long's."""
    return "long" if effort == "fix" else effort


PADS = {"arithmetic": _arithmetic_pad, "sort": _sort_pad, "recall": _recall_pad}


@dataclass(eq=False)
class EffortTask(Task):
    """`base` with its prompts tagged `<effort>` and a scratchpad before the answer (none for `no`)."""

    base: Task = field(default=None)  # type: ignore[assignment]
    effort: str = "no"

    def __post_init__(self) -> None:
        if self.effort not in EFFORTS:
            raise TaskError(f"unknown effort {self.effort!r} (known: {', '.join(EFFORTS)})")
        if self.base.name not in PADS:
            raise TaskError(
                f"task {self.base.name} has no scratchpad efforts (tasks with: {', '.join(PADS)})"
            )
        if self.base.name == "sort" and self.effort == "long" and self.base.length > 9:
            raise TaskError("sort@long counts each digit in one character: --length at most 9")
        if self.base.name == "recall" and getattr(self.base, "copy", False) and self.effort != "no":
            raise TaskError("recall with copy has no scratchpad efforts")
        self.name = f"{self.base.name}@{self.effort}"
        self.tag = f"<{self.effort}>"
        pad = 0 if self.effort == "no" else _pad_bound(self.base, _pad_effort(self.effort)) + len(SEPARATOR)
        self.max_tokens = self.base.max_tokens + pad + (ERASE_BUDGET if self.effort == "fix" else 0)

    def sample(self, rng: np.random.Generator) -> Problem:
        p = self.base.sample(rng)
        if self.effort == "no":
            return Problem(self.tag + p.prompt, p.answer)
        pad = PADS[self.base.name](self.base, p, _pad_effort(self.effort))
        return Problem(self.tag + p.prompt, pad + SEPARATOR + p.answer)

    def grade(self, problems: list[Problem], responses: list[str]) -> list[float]:
        """The base task's grade of each final answer (after the last separator; at `fix`, of the response
        after its erasures)."""
        base = [Problem(p.prompt[len(self.tag) :], p.answer.rpartition(SEPARATOR)[2]) for p in problems]
        if self.effort == "fix":
            responses = [erase(r) for r in responses]
        return self.base.grade(base, [r.rpartition(SEPARATOR)[2] for r in responses])


def plant_pad_noise(
    problems: list[Problem], share: float, rng: np.random.Generator, corrected: bool = False
) -> tuple[list[Problem], list[int | None]]:
    """`problems` (an effort task's, with scratchpads) with each one's scratchpad given, with probability
    `share` (one uniform draw per problem, in order), one wrong digit: a uniformly chosen digit of the
    scratchpad replaced by one of the 9 others. Returns the problems and, per problem, the index in its
    answer of the planted digit (None: untouched), so that fine-tuning skips it: the model learns to
    continue right (the true scratchpad's later columns, the true answer) after a wrong digit, as a
    teacher must on a student's mistakes, without learning to write one.

    With `corrected` (the `fix` effort) the wrong digit may be any digit of the answer and is followed by
    ERASE and then the true digit onwards (`12 14<3;231`): the model learns to take back a wrong digit."""
    out, planted = [], []
    for p in problems:
        pad = p.answer if corrected else p.answer.partition(SEPARATOR)[0] if SEPARATOR in p.answer else ""
        digits = [i for i, c in enumerate(pad) if c.isdigit()]
        if rng.random() < share and digits:
            i = digits[int(rng.integers(len(digits)))]
            wrong = str((int(pad[i]) + 1 + int(rng.integers(9))) % 10)
            rest = ERASE + p.answer[i:] if corrected else p.answer[i + 1 :]
            out.append(Problem(p.prompt, p.answer[:i] + wrong + rest))
            planted.append(i)
        else:
            out.append(p)
            planted.append(None)
    return out, planted


def with_effort(base: Task, effort: str) -> EffortTask:
    return EffortTask(held_out_size=base.held_out_size, base=base, effort=effort)
