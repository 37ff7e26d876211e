"""Rollouts through k3's engine: K samples per prompt, token ids end to end, partial rollouts.

A `Trajectory` is one sample of one prompt: its prompt ids, the ids generated so far and, per generated
token, the behaviour log-prob (of the distribution it was drawn from: temperature T, top_p 1) and the
policy version that drew it; with `record_experts`, the experts every MoE router chose at every position
fed (from the engine's last segment, which fed the whole sequence). Nothing is re-tokenised: the ids the
engine produced are the ids trained on.

Partial rollouts (Kimi K1.5 section 2.6.2): each iteration a trajectory may generate at most `budget`
tokens; one that is still unfinished then waits in the replay buffer and is continued in the next
iteration by the current weights (the engine is given prompt + tokens so far as its prompt), so its
tokens carry several versions. A trajectory ends on the task's stop id ("stop"), on the task's token budget
("length", a truncation) or when its tail is a loop ("loop", see `loop_length`).

Multi-turn (a `Tool`): every model turn ends on the stop id; the tool reads the turn and, if it called
the tool, answers with token ids that are appended (the tool's results and the opening of the model's next
turn; `env` marks them: behaviour log-prob 0, version -1, loss mask 0 in k3.rl.policy.pack) and the
model's next turn is generated in the same call, from prompt + everything so far, up to the tool's
`max_calls` answered turns; a turn that called nothing ends the trajectory ("stop").

Draws are keyed by (run seed, group, sample, position) (`SamplingParams.seed_position`): a rerun of an
iteration draws the same tokens, and a trajectory continued over several segments draws at each position
what one uninterrupted generation would have drawn there, sampled (T > 0) as well as greedy, so at
learning rate 0 partial rollouts give exactly the tokens of one generation.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from k3.engine.generate import Engine
from k3.engine.sampling import SamplingParams
from k3.tasks.task import Tool

FINISHED = ("stop", "length", "loop")


@dataclass
class Trajectory:
    group: int  # the prompt it samples (its K samples share the group)
    sample: int  # 0..K-1
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # generated ids (the stop id included)
    logprobs: list[float] = field(default_factory=list)  # behaviour log-prob per token
    versions: list[int] = field(default_factory=list)  # policy version per token
    finish_reason: str | None = None  # None while unfinished; else one of FINISHED
    segments: int = 0  # engine calls that generated for it
    experts: torch.Tensor | None = None  # [len(prompt) + len(tokens) - 1, n_moe, k] (record_experts)
    env: list[bool] = field(default_factory=list)  # per token: inserted by a tool (empty: none ever was)
    tool_calls: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def partial(self) -> bool:
        """Generated over more than one iteration."""
        return self.segments > 1

    def to_json(self) -> dict:
        """Everything but the experts (a resumed run recomputes them when it continues the trajectory)."""
        return {
            "group": self.group,
            "sample": self.sample,
            "prompt": self.prompt,
            "tokens": self.tokens,
            "logprobs": self.logprobs,  # json writes floats with repr: they round-trip exactly
            "versions": self.versions,
            "finish_reason": self.finish_reason,
            "segments": self.segments,
            "env": self.env,
            "tool_calls": self.tool_calls,
            "experts": None if self.experts is None else self.experts.tolist(),
        }

    @staticmethod
    def from_json(d: dict) -> Trajectory:
        experts = d.pop("experts")
        t = Trajectory(**d)
        t.experts = None if experts is None else torch.tensor(experts, dtype=torch.long)
        return t


def trajectory_seed(seed: int, group: int, sample: int) -> int:
    """A 62-bit seed per (run, group, sample), independent of batch composition; positions key the draws."""
    digest = hashlib.blake2b(f"{seed}/{group}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def loop_length(tokens: list[int], repeats: int, max_period: int = 8) -> int:
    """Tokens at the end of `tokens` that are one block of <= max_period ids repeated `repeats` times or
    more (the smallest such period wins), or 0 when the tail is no such loop (or `repeats` < 2)."""
    if repeats < 2:
        return 0
    for period in range(1, max_period + 1):
        span = period * repeats
        if len(tokens) < span:
            break
        tail = tokens[-span:]
        if all(tail[i] == tail[i % period] for i in range(span)):
            return span
    return 0


def generate(
    engine: Engine,
    trajectories: list[Trajectory],
    *,
    seed: int,
    temperature: float,
    stop_id: int,
    max_tokens: int,
    budget: int | None = None,
    loop_repeats: int = 0,
    record_experts: bool = False,
    tool: Tool | None = None,
) -> int:
    """Continue every unfinished trajectory by one segment (in place): at most `budget` new tokens per
    model turn (None: until done), never past `max_tokens` in all (tool output included); with a `tool`,
    each call is answered and the model's next turn generated in the same segment. Returns the number of
    tokens generated."""
    todo = [t for t in trajectories if not t.finished]
    for t in todo:
        t.segments += 1
    generated = 0
    while todo:
        generated += _turn(engine, todo, seed, temperature, stop_id, max_tokens, budget, loop_repeats,
                           record_experts, tool)  # fmt: skip
        todo = [t for t in todo if _answer_tool(t, tool, max_tokens)]
    return generated


def _answer_tool(t: Trajectory, tool: Tool | None, max_tokens: int) -> bool:
    """If t's turn called the tool, append the tool's answer (env tokens) and reopen t."""
    if tool is None or t.finish_reason != "call":
        return False
    start = max((i + 1 for i, e in enumerate(t.env) if e), default=0)  # the turn: after the last env id
    ids = tool.respond(t.tokens[start:])
    if ids is None:  # no call: the answer is finished
        t.finish_reason = "stop"
        return False
    if len(t.tokens) + len(ids) >= max_tokens:  # no room for another turn: cut here, the reply unfed
        t.finish_reason = "length"
        return False
    t.env = (t.env or [False] * len(t.tokens)) + [True] * len(ids)
    t.tokens += ids
    t.logprobs += [0.0] * len(ids)
    t.versions += [-1] * len(ids)
    t.tool_calls += 1
    t.finish_reason = None
    return True


def _turn(
    engine, todo, seed, temperature, stop_id, max_tokens, budget, loop_repeats, record_experts, tool
) -> int:
    """One engine call continuing every trajectory of `todo` by one model turn."""
    params = []
    for t in todo:
        room = max_tokens - len(t.tokens)
        params.append(
            SamplingParams(
                temperature=temperature,
                max_tokens=room if budget is None else min(room, budget),
                stop_ids=frozenset({stop_id}),
                seed=trajectory_seed(seed, t.group, t.sample),
                seed_position=len(t.tokens),  # position-keyed: a continuation draws as one generation would
            )
        )
    done = engine.complete([t.prompt + t.tokens for t in todo], params, record_experts=record_experts)
    generated = 0
    for t, c in zip(todo, done, strict=True):
        t.tokens += c.tokens
        t.logprobs += c.logprobs
        t.versions += c.versions
        if t.env:
            t.env += [False] * len(c.tokens)
        t.experts = c.experts
        generated += len(c.tokens)
        if c.finish_reason == "stop" and tool is not None and t.tool_calls < tool.max_calls:
            t.finish_reason = "call"  # (for _answer_tool: answered and reopened, or ended as "stop")
        elif c.finish_reason == "stop":
            t.finish_reason = "stop"
        elif loop_length(t.tokens, loop_repeats):
            t.finish_reason = "loop"
        elif len(t.tokens) >= max_tokens or c.finish_reason != "length" or not c.tokens:
            t.finish_reason = "length"  # the task's budget (or the model's context) is used up
    return generated
