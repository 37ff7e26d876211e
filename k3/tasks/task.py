"""Tasks with verifiable rewards, as plug-ins with one small interface.

A task makes problems (a prompt and a reference answer) from a random generator, grades responses with a
reward in [0, 1], and holds out a fixed set of problems that training never draws:

    task = make_task("arithmetic")                               # k3.tasks.registry
    problems = task.problems(seed=0, iteration=3, count=16)      # never one of task.held_out(seed=0)
    rewards = task.grade(problems, ["579", "12"])                 # 1.0 right, 0.0 wrong

Prompts and answers are ASCII text; a task turns a prompt into ids (`prompt_ids`), names the id that ends a
model turn (`stop_id`) and reads the graded text back from the generated ids (`reply`): by default the
character codec's (k3.tasks.codec), the calculator task K3's chat format (k3.tasks.tool_task). `max_tokens`
is the task's token budget for an answer (its end-of-answer id included). Graders are pure functions of
(problem, response), except the code task's, which runs the program in a sandbox (k3.tasks.code_task).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from k3.errors import K3Error

TASK_NAMES = ("arithmetic", "arithmetic-either", "sort", "recall", "code", "calculator")


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
        """The environment the model may call between its turns (`Tool` below, driven by k3.rl.rollout);
        None: single-turn."""
        return None

    def prompt_ids(self, problem: Problem, codec) -> list[int]:
        """The ids the model is prompted with: the prompt's characters (k3.tasks.codec) by default."""
        return codec.encode(problem.prompt)

    def reference_ids(self, problem: Problem, codec) -> list[int]:
        """The reference answer as the model writes it, stop id included (what `k3 rl sft` trains on)."""
        return codec.encode(problem.answer) + [codec.eos]

    def stop_id(self, codec) -> int:
        """The id that ends a model turn (an answer, or a turn that calls the tool)."""
        return codec.eos

    def reply(self, tokens: list[int], env: list[bool], codec) -> str:
        """The text graded, from the generated ids (`env`: per id, written by the tool; empty: none was):
        by default the ids decoded (the stop id is no character)."""
        return codec.decode(tokens)

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


@dataclass(frozen=True)
class Tool:
    """An environment the model calls between its turns. A model turn ends on the task's stop id;
    `respond(turn)` (the ids of that turn, stop id included) gives the ids appended before the model's next
    turn (the tool's results and the opening of that turn), or None when the turn called no tool (the
    answer is finished); at most `max_calls` turns per answer are answered."""

    respond: Callable[[list[int]], list[int] | None]
    max_calls: int = 1
