"""A mixture of tasks: each problem drawn from one of its parts, uniformly; `make_task("sort+recall")`.

A base model fine-tuned on a mixture (`k3 distill teachers --base-steps`) is what specialists and the
distilled student start from. The mixture's held-out set is the union of its parts' held-out sets, so
training on a mixture never sees a problem any part holds out. A problem of a part at an effort (its prompt
starts with that part's tag) is graded by that part (k3.tasks.effort: the final answer, after the erasures
at `fix`); any other compares the final answer (after the last `;`) with the reference's, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from k3.tasks.effort import SEPARATOR
from k3.tasks.task import Problem, Task, TaskError


@dataclass(eq=False)
class Mixture(Task):
    parts: tuple[Task, ...] = field(default=())

    def __post_init__(self) -> None:
        if len(self.parts) < 2 or any(p.name in ("code", "calculator") for p in self.parts):
            raise TaskError(
                "a mixture takes two or more tasks, none of them code or calculator (whose prompts are in "
                "K3's chat format)"
            )
        self.name = "+".join(p.name for p in self.parts)
        self.max_tokens = max(p.max_tokens for p in self.parts)

    def sample(self, rng: np.random.Generator) -> Problem:
        return self.parts[int(rng.integers(len(self.parts)))].sample(rng)

    def held_out(self, seed: int) -> tuple[Problem, ...]:
        """Every part's held-out problems."""
        return tuple(p for part in self.parts for p in part.held_out(seed))

    def grade(self, problems: list[Problem], responses: list[str]) -> list[float]:
        tagged = [part for part in self.parts if getattr(part, "tag", "")]

        def one(p: Problem, r: str) -> float:
            for part in tagged:
                if p.prompt.startswith(part.tag):
                    return part.grade([p], [r])[0]
            return float(r.rpartition(SEPARATOR)[2].strip() == p.answer.rpartition(SEPARATOR)[2])

        return [one(p, r) for p, r in zip(problems, responses, strict=True)]
