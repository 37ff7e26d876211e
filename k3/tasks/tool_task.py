"""A multi-turn task in K3's chat format: multiplication with a calculator the model may call once.

Everything is written as the release writes it (k3.chat, docs/chat.md), so RL trains on the format K3
serves. The prompt is `encode_chat` of one user message, `347*29=`, with the calculator declared as an
OpenAI function, `calculate(expression: string)`, thinking on (effort `low`) or off (`thinking=False`):

    <|open|>message role="system" type="tool-declare"<|sep|># Tools ... <|end_of_msg|>
    <|open|>message role="system" type="thinking-effort"<|sep|>... <|end_of_msg|>
    <|open|>message role="user"<|sep|>347*29=<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|><|open|>think<|sep|>

A model turn ends at `<|end_of_msg|>` (the task's stop id). A turn with tool calls (read by
k3.chat.parser) is answered by the environment: the tool messages, `role="tool" tool="calculate"
index="1"` with the value (`10063`, or `error: ...`), then the next assistant opening, all as the encoder
writes them (loss mask 0: k3.tasks.task.Tool, k3.rl.policy.pack). The grade is the content (the response
channel) of the model's last turn against the product, so copying the tool's value is right and a direct
answer (no call) is graded the same way.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from k3.chat.encoder import chat_segments, encode_chat, segment_ids
from k3.chat.parser import ToolCall, parse_reply
from k3.tasks.codec import CharCodec
from k3.tasks.task import Problem, Task, TaskError, Tool, operands

NAME = "calculate"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": NAME,
            "description": "The value of a*b, a+b or a-b, for whole numbers a and b.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 347*29"}},
                "required": ["expression"],
            },
        },
    }
]
EFFORT = "low"  # the thinking effort the prompt asks for (thinking mode)
EXPRESSION = re.compile(r"\s*(\d{1,9})\s*([*+-])\s*(\d{1,9})\s*")


def calculate(expression: str) -> str:
    """The calculator's value of `a*b`, `a+b` or `a-b`, as text; `error: ...` for anything else."""
    m = EXPRESSION.fullmatch(expression)
    if m is None:
        return f"error: cannot evaluate {expression[:40]!r}"
    a, op, b = int(m[1]), m[2], int(m[3])
    return str(a * b if op == "*" else a + b if op == "+" else a - b)


def result(call: ToolCall) -> str:
    """The tool's answer to one parsed call."""
    if call.name != NAME:
        return f"error: no tool {call.name!r}"
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict) or not isinstance(arguments.get("expression"), str):
        return "error: calculate takes one string argument, expression"
    return calculate(arguments["expression"])


@dataclass(eq=False)
class Calculator(Task):
    digits: int = 3
    thinking: bool = True
    name = "calculator"

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 9:
            raise TaskError(f"task calculator: digits must be 1..9, got {self.digits}")
        self.max_tokens = self._budget()

    def _options(self) -> dict:
        return {"thinking": self.thinking, "thinking_effort": EFFORT if self.thinking else None}

    def _budget(self) -> int:
        """A bound on the ids of a call, its result and the answer with the largest operands, for any
        byte-level BPE: one id per marker, at most one per byte of every other segment, plus 8."""
        a = 10**self.digits - 1
        history = [{"role": "user", "content": f"{a}*{a}="}]
        call = {
            "id": f"functions.{NAME}:0",
            "function": {"name": NAME, "arguments": {"expression": f"{a}*{a}"}},
        }
        history += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": str(a * a)},
            {"role": "assistant", "content": str(a * a)},
        ]
        prompt = chat_segments(history[:1], TOOLS, **self._options())
        full = chat_segments(history, TOOLS, add_generation_prompt=False, **self._options())
        return sum(1 if s.special else len(s.text.encode()) for s in full[len(prompt) :]) + 8

    def sample(self, rng: np.random.Generator) -> Problem:
        a, b = operands(self.digits, rng)
        return Problem(f"{a}*{b}=", str(a * b))

    def prompt_ids(self, problem: Problem, codec: CharCodec) -> list[int]:
        messages = [{"role": "user", "content": problem.prompt}]
        return encode_chat(codec.tokenizer, messages, TOOLS, **self._options())

    def reference_ids(self, problem: Problem, codec: CharCodec) -> list[int]:
        """The reference as the model writes it: a direct answer (no call), to the end of its turn."""
        messages = [
            {"role": "user", "content": problem.prompt},
            {"role": "assistant", "content": problem.answer},
        ]
        whole = encode_chat(codec.tokenizer, messages, TOOLS, add_generation_prompt=False, **self._options())
        return whole[len(self.prompt_ids(problem, codec)) :]  # (the generation prompt opens that message)

    def stop_id(self, codec: CharCodec) -> int:
        return codec.tokenizer.special.end_of_msg

    def reply(self, tokens: list[int], env: list[bool], codec: CharCodec) -> str:
        """The content of the model's last turn (the ids after the last tool output)."""
        start = max((i + 1 for i, e in enumerate(env) if e), default=0)
        return parse_reply(codec.tokenizer, tokens[start:], self.thinking).content

    def tool(self, codec: CharCodec) -> Tool:
        tokenizer = codec.tokenizer

        def respond(turn: list[int]) -> list[int] | None:
            calls = parse_reply(tokenizer, turn, self.thinking).tool_calls
            if not calls:
                return None
            results = [
                {"role": "tool", "tool_call_id": c.id, "name": c.name, "content": result(c)} for c in calls
            ]
            # the tool messages and the next assistant opening, as encode_chat writes them after the turn
            return segment_ids(
                tokenizer, chat_segments(results, **{**self._options(), "thinking_effort": None})
            )

        return Tool(respond=respond)
