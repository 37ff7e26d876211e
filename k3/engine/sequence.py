"""What the engine runs and returns: a `Sequence` (one request: prompt, sampling state, output, its cache
while waiting), the `Event`s a step emits, a finished request as a `Completion` (token-in/token-out), and
`EngineError` for a request the engine cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import torch

from k3.engine.prefix_cache import PromptImages
from k3.engine.sampling import SamplingParams
from k3.engine.state_store import SequenceState
from k3.errors import K3Error
from k3.model.cache import ModelCache

TopLogprobs = list[tuple[int, float]]  # (token id, log-prob), most likely first


class EngineError(K3Error):
    """A request the engine cannot run (empty prompt, too long for the model...)."""


class Status(StrEnum):
    WAITING = "waiting"  # prompt (partly) not yet prefilled
    RUNNING = "running"  # in the decode batch
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request: its prompt, sampling state, output so far and (while waiting) its own cache."""

    id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" (a stop id), "length" (max_tokens or context), "cancelled"
    prefilled: int = 0  # prompt tokens already in the cache
    cache: ModelCache | None = None  # own cache while waiting; None once in the batch (or finished)
    seen: set[int] = field(default_factory=set)  # ids for the repetition penalty (prompt + output)
    record_experts: bool = False
    stop_token: int | None = None  # the stop id that ended it (not in `output`: it is never fed)
    logprobs: list[float] = field(default_factory=list)  # per token of output (+ stop_token)
    versions: list[int] = field(default_factory=list)  # policy version per token of output (+ stop_token)
    top: list[TopLogprobs] = field(default_factory=list)  # alternatives per token (params.logprobs > 0)
    prompt_logprobs: list[float | None] = field(default_factory=list)  # params.prompt_logprobs set
    prompt_top: list[TopLogprobs | None] = field(default_factory=list)
    experts: list[torch.Tensor] = field(default_factory=list)  # [rows, n_moe, k] per forward it was in
    cached: int = 0  # prompt tokens restored (prefix cache or a given state), not prefilled
    block_key: bytes | None = None  # prefix cache: the key of its last stored boundary
    standard_chunks: bool = True  # every chunk so far was the engine's standard one (then it may store)
    keep_state: bool = False  # keep its state when it finishes (`Engine.state_of`)
    state: SequenceState | None = None  # given to submit, or kept at the end (keep_state)
    image_rows: torch.Tensor | None = None  # [pads, hidden]: its images' rows in prompt order
    prompt_images: PromptImages | None = None  # which images' rows its pads hold, for prefix cache keys

    @property
    def num_tokens(self) -> int:
        """Tokens in context: prompt + generated."""
        return len(self.prompt) + len(self.output)


@dataclass(frozen=True)
class Event:
    """What one step did to one sequence: a new token and/or the end (`finish_reason`)."""

    seq: Sequence
    token: int | None
    finish_reason: str | None = None
    logits: torch.Tensor | None = None  # [V] the token was drawn from (only with `record_logits`)
    logprob: float | None = None  # of `token`, or of `seq.stop_token` when it stopped on one
    top: TopLogprobs | None = None  # alternatives (params.logprobs > 0)


@dataclass
class Completion:
    """One finished request, token ids in and out (see docs/engine.md, "Token-in/token-out")."""

    prompt: list[int]
    tokens: list[int]  # generated ids; includes the stop id when finish_reason == "stop"
    logprobs: list[float]  # per token, under the distribution it was drawn from (greedy: log_softmax)
    versions: list[int]  # per token, Engine.policy_version of the weights that produced it
    finish_reason: str  # "stop" | "length" | "cancelled"
    experts: torch.Tensor | None  # [len(prompt) + len(tokens) - 1, n_moe_layers, k] int64, positions fed
    # in order (prompt, then tokens but the last), layers in sorted(model.routers()); record_experts only
    # ("cancelled": only the positions that were fed before the cancel)
    top_logprobs: list[TopLogprobs] | None = None  # per token (params.logprobs > 0)
    prompt_logprobs: list[float | None] | None = None  # per prompt token, first None (params.prompt_logprobs)

    @staticmethod
    def of(seq: Sequence) -> Completion:
        stop = [seq.stop_token] if seq.stop_token is not None else []
        return Completion(
            prompt=list(seq.prompt),
            tokens=seq.output + stop,
            logprobs=list(seq.logprobs),
            versions=list(seq.versions),
            finish_reason=seq.finish_reason or "cancelled",
            experts=recorded_experts(seq) if seq.record_experts else None,
            top_logprobs=list(seq.top) if seq.params.logprobs else None,
            prompt_logprobs=list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None,
        )


def recorded_experts(seq: Sequence) -> torch.Tensor:
    """[positions fed, n_moe, k]: the rows recorded for seq, in order (none if it never reached a forward)."""
    return torch.cat(seq.experts) if seq.experts else torch.empty(0, 0, 0, dtype=torch.long)
