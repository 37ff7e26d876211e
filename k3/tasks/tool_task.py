"""A multi-turn task: multiplication with one call to a calculator, whose answer comes back as tokens.

The prompt `347*29=` asks for the product. The model may call the calculator once: it writes an expression
and `?` (its turn ends there, the call id); the environment appends `=10063;` as token ids (loss mask 0:
k3.tasks.task.Tool, k3.rl.policy.pack) and the model's next turn writes the answer after it. The grade
is the text after the last `;` against the product, so copying the tool's value is right and a direct
answer (no call) is graded the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from k3.tasks.codec import CharCodec
from k3.tasks.task import Problem, Task, Tool, operands

CALL = "?"  # ends a tool call
EXPRESSION = re.compile(r"(\d{1,9})([*+-])(\d{1,9})$")


def calculate(text: str) -> str:
    """The calculator's reply to a turn ending in `expression?`: `=value;`, or `=error;`."""
    m = EXPRESSION.search(text.rpartition(";")[2].removesuffix(CALL))
    if m is None:
        return "=error;"
    a, op, b = int(m[1]), m[2], int(m[3])
    return f"={a * b if op == '*' else a + b if op == '+' else a - b};"


@dataclass(eq=False)
class Calculator(Task):
    digits: int = 3
    name = "calculator"

    def __post_init__(self) -> None:
        self.max_tokens = 6 * self.digits + 8  # call, reply and answer

    def sample(self, rng: np.random.Generator) -> Problem:
        a, b = operands(self.digits, rng)
        return Problem(f"{a}*{b}=", str(a * b))

    def grade(self, problems: list[Problem], responses: list[str]) -> list[float]:
        return [
            float(r.rpartition(";")[2].strip() == p.answer) for p, r in zip(problems, responses, strict=True)
        ]

    def tool(self, codec: CharCodec) -> Tool:
        return Tool(
            call_id=codec.encode(CALL)[0], respond=lambda ids: codec.encode(calculate(codec.decode(ids)))
        )
