"""Choosing the next token: greedy, temperature, top-k, top-p, repetition penalty, per-request seeds.

Order of operations (as in most engines): repetition penalty on the raw logits, then temperature, then
top-k, then top-p (nucleus) on the resulting distribution, then a draw with the request's own
`torch.Generator`, so a seeded request gives the same tokens whatever else shares its batch.

With `seed_position = n` the draws are keyed by position instead of one stream: the request's i-th draw
uses a generator seeded with `seed + n + i` (fresh for each draw), so a request that continues a sequence
from its n-th generated token (the tokens so far appended to its prompt) draws exactly what one
uninterrupted request of the same seed would have drawn there (RL's partial rollouts, k3.rl.rollout).
Two seeds' streams overlap only where they are less than the tokens generated apart (RL's seeds are
62-bit hashes).

The log-probability reported for a token is the one of the distribution it was drawn from
(`sampling_logprobs`: after penalty, temperature, top-k and top-p; -inf outside the kept tokens). Greedy
decoding takes the argmax of `log_softmax(logits)` and reports that: with temperature 0 (or 1) and top_p 1
the reported values are the model's own log-softmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3.errors import K3Error

MAX_LOGPROBS = 20  # most alternatives per position (OpenAI's top_logprobs limit)


class SamplingError(K3Error):
    """Sampling parameters k3 cannot use."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages tokens already in the prompt or output
    max_tokens: int = 256
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    seed: int | None = None
    logprobs: int = 0  # per generated token, also return this many most likely alternatives (0..20)
    prompt_logprobs: int | None = None  # None: off; n >= 0: each prompt token's log-prob under the model
    # (raw log_softmax, the first one None) and n alternatives per position, e.g. for `echo` scoring
    seed_position: int | None = None  # None: one stream; n: draws keyed by position, the first at n

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k must be a non-negative integer, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise SamplingError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise SamplingError(f"max_tokens must be a non-negative integer, got {self.max_tokens}")
        if not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SamplingError(f"logprobs must be an integer in 0..{MAX_LOGPROBS}, got {self.logprobs}")
        if self.prompt_logprobs is not None and not (
            isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise SamplingError(
                f"prompt_logprobs must be None or an integer in 0..{MAX_LOGPROBS}, got {self.prompt_logprobs}"
            )
        if self.seed_position is not None and not (
            isinstance(self.seed_position, int) and self.seed_position >= 0
        ):
            raise SamplingError(
                f"seed_position must be None or a non-negative integer, got {self.seed_position}"
            )
        object.__setattr__(self, "stop_ids", frozenset(self.stop_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def make_generator(self) -> torch.Generator:
        g = torch.Generator()
        seed = self.seed if self.seed is not None else int(torch.randint(0, 2**62, ()).item())
        g.manual_seed((seed + (self.seed_position or 0)) % 2**64)  # keyed: the stream of the first position
        return g


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty on tokens in `seen` (ids, any order, repeats allowed): positive logits are
    divided by `penalty`, negative ones multiplied. logits: [V]."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    ids = torch.unique(seen)
    picked = logits[ids]
    out = logits.clone()
    out[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return out


def sampling_logprobs(
    logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None
) -> torch.Tensor:
    """Log-probabilities of the distribution the next token is drawn from, fp32 [V] (-inf where top-k /
    top-p removed a token). Greedy: `log_softmax` of the (penalised) logits, whose argmax is taken."""
    logits = logits.float()
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logp = torch.log_softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_logp, order = torch.sort(logp, descending=True)
        sorted_probs = sorted_logp.exp()
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep = torch.zeros_like(mass_before, dtype=torch.bool).scatter(0, order, mass_before < params.top_p)
        logp = logp.masked_fill(~keep, float("-inf"))
        logp = logp - torch.logsumexp(logp, dim=-1)
    return logp


def next_token_probs(
    logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None
) -> torch.Tensor:
    """The distribution the next token is drawn from, fp32 [V] (one-hot for greedy)."""
    logp = sampling_logprobs(logits, params, seen)
    if params.greedy:
        probs = torch.zeros_like(logp)
        probs[torch.argmax(logp)] = 1.0
        return probs
    return logp.exp()


def draw(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, seen: torch.Tensor | None = None
) -> tuple[int, torch.Tensor]:
    """The next token for one sequence and the log-probabilities [V] it was drawn from. logits: [V]."""
    logp = sampling_logprobs(logits, params, seen)
    if params.greedy:
        token = int(torch.argmax(logp))
    else:
        token = int(torch.multinomial(logp.exp(), 1, generator=generator))
    if params.seed_position is not None:  # the next draw's own stream (its position's seed)
        generator.manual_seed((generator.initial_seed() + 1) % 2**64)
    return token, logp


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, seen: torch.Tensor | None = None
) -> int:
    """Draw the next token for one sequence. logits: [V]."""
    return draw(logits, params, generator, seen)[0]
