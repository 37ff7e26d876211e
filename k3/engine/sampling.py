"""Choosing the next token: greedy, temperature, top-k, top-p, repetition penalty, per-request seeds.

Order of operations (as in most engines): repetition penalty on the raw logits, then temperature, then
top-k, then top-p (nucleus) on the resulting distribution, then a draw with the request's own
`torch.Generator` (one uniform number a token against the running sum: `inverse_cdf_draw`), so a seeded
request gives the same tokens whatever else shares its batch.

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
        logp = logp.masked_fill(~nucleus(logp, params.top_p), float("-inf"))
        logp = logp - torch.logsumexp(logp, dim=-1)
    return logp


NUCLEUS_VIEWS = (256, 2048)  # how many of the most likely tokens `nucleus` looks at before sorting them all


def nucleus(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """The tokens top-p keeps, bool [V] for log-probabilities logp [V]: in order of probability, every token
    whose mass before it is < top_p (the smallest prefix whose mass reaches top_p). It looks at the 256, then
    the 2,048 most likely tokens (torch.topk) and sorts all V only when their mass is still short of top_p: a
    sort of K3's 163,840 takes 17 ms on an AVX2 EPYC (Zen 3), a top 2,048 under 1 ms. The same tokens
    whichever view decides (the views' running sums are the sort's first ones)."""
    kept = torch.zeros(logp.numel(), dtype=torch.bool)
    for view in (k for k in NUCLEUS_VIEWS if k < logp.numel()):
        top, order = torch.topk(logp, view)  # the view's log-probabilities, descending
        in_view = _kept_prefix(top, top_p)
        if not in_view[-1]:  # the view's last token is out, and so is every less likely one
            return kept.scatter(0, order, in_view)
    top, order = torch.sort(logp, descending=True)
    return kept.scatter(0, order, _kept_prefix(top, top_p))


def _kept_prefix(top: torch.Tensor, top_p: float) -> torch.Tensor:
    """Of log-probabilities in descending order, the ones whose mass before them is < top_p (bool)."""
    probs = top.exp()
    return torch.cumsum(probs, dim=-1) - probs < top_p


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
    token = int(torch.argmax(logp)) if params.greedy else inverse_cdf_draw(logp.exp(), generator)
    if params.seed_position is not None:  # the next draw's own stream (its position's seed)
        generator.manual_seed((generator.initial_seed() + 1) % 2**64)
    return token, logp


def inverse_cdf_draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token drawn from probs [V] (>= 0, summing to about 1): the first whose running sum, in fp64,
    passes one uniform draw from `generator` scaled to the total. A zero-probability token is never drawn (its
    running sum equals the one before it). `torch.multinomial` draws V exponentials instead: 0.83 ms a draw at
    V = 32,768 on an AVX2 EPYC (Zen 3), against 0.07-0.10 ms here (benchmarks/sampling.py)."""
    running = torch.cumsum(probs, 0, dtype=torch.float64)  # [V]
    u = torch.rand((), dtype=torch.float64, generator=generator) * running[-1]
    return min(int(torch.searchsorted(running, u, right=True)), probs.numel() - 1)  # u < total: in range


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, seen: torch.Tensor | None = None
) -> int:
    """Draw the next token for one sequence. logits: [V]."""
    return draw(logits, params, generator, seen)[0]
