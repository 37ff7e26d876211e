"""Sampling against slow reference implementations written from the definitions."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from k3.engine.sampling import (
    SamplingError,
    SamplingParams,
    draw,
    inverse_cdf_draw,
    next_token_probs,
    nucleus,
    sample_token,
    sampling_logprobs,
)


def reference_probs(logits: list[float], p: SamplingParams, seen: list[int]) -> list[float]:
    """Plain-Python loops: penalty, temperature, top-k, top-p, one token at a time."""
    x = list(logits)
    for i in set(seen):
        x[i] = x[i] / p.repetition_penalty if x[i] > 0 else x[i] * p.repetition_penalty
    if p.temperature == 0:
        best = max(range(len(x)), key=lambda i: (x[i], -i))
        return [1.0 if i == best else 0.0 for i in range(len(x))]
    x = [v / p.temperature for v in x]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    allowed = set(order[: p.top_k]) if p.top_k else set(order)
    z = sum(math.exp(x[i]) for i in allowed)
    probs = [math.exp(x[i]) / z if i in allowed else 0.0 for i in range(len(x))]
    if p.top_p < 1:
        kept, mass = set(), 0.0
        for i in sorted(range(len(x)), key=lambda i: -probs[i]):
            if mass >= p.top_p:
                break
            kept.add(i)
            mass += probs[i]
        total = sum(probs[i] for i in kept)
        probs = [probs[i] / total if i in kept else 0.0 for i in range(len(x))]
    return probs


CASES = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=10, top_p=0.5, repetition_penalty=1.3),
    SamplingParams(temperature=0, repetition_penalty=2.0),
]


@pytest.mark.parametrize("params", CASES)
def test_distribution_matches_reference(params: SamplingParams) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        logits = torch.randn(50, generator=g) * 3
        seen = torch.randint(0, 50, (12,), generator=g)
        got = next_token_probs(logits, params, seen)
        want = torch.tensor(reference_probs(logits.tolist(), params, seen.tolist()))
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("params", CASES)
def test_logprobs_are_those_of_the_drawn_distribution(params: SamplingParams) -> None:
    """Sampled: log of the reference distribution (-inf outside it); greedy: log_softmax of the penalised
    logits (the distribution whose argmax is taken)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(50, generator=g) * 3
    seen = torch.randint(0, 50, (12,), generator=g)
    got = sampling_logprobs(logits, params, seen)
    if params.greedy:
        penalised = dataclasses.replace(params, temperature=1.0)  # the reference at T=1 is the softmax
        want = torch.tensor(reference_probs(logits.tolist(), penalised, seen.tolist())).log()
    else:
        want = torch.tensor(reference_probs(logits.tolist(), params, seen.tolist())).log()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    token, logp = draw(logits, params, torch.Generator().manual_seed(2), seen)
    assert torch.equal(logp, got) and logp[token] > float("-inf")


@pytest.mark.parametrize(
    ("scale", "top_p", "size"),
    [(6.0, 0.9, range(1, 256)), (4.0, 0.99, range(256, 2048)), (2.0, 0.9, range(2048, 20000))],
)
def test_the_nucleus_of_a_large_vocabulary_is_the_references(scale, top_p, size) -> None:
    """20,000 tokens, logits peaked enough for the top 256 to decide, then the top 2,048, then only the
    full sort (the nucleus sizes say which): the kept tokens those of the plain-Python reference."""
    g = torch.Generator().manual_seed(int(scale * 10))
    logp = torch.log_softmax(torch.randn(20000, generator=g, dtype=torch.float64) * scale, -1).float()
    got = nucleus(logp, top_p)
    want = reference_probs(logp.tolist(), SamplingParams(temperature=1.0, top_p=top_p), [])
    assert int(got.sum()) in size
    assert got.tolist() == [p > 0 for p in want]


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([3.0, 2.0, -1.0])
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample_token(logits, p, torch.Generator(), seen=torch.tensor([0])) == 1  # 3/2 < 2


def test_frequencies_follow_the_distribution() -> None:
    """20k draws: every frequency within 5 sigma of its probability; excluded tokens never drawn."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    p = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    probs = next_token_probs(logits, p)
    g = torch.Generator().manual_seed(123)
    n = 20000
    counts = torch.bincount(torch.tensor([sample_token(logits, p, g) for _ in range(n)]), minlength=6)
    freq = counts.double() / n
    sigma = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert bool(((freq - probs.double()).abs() <= 5 * sigma + 1e-12).all()), (freq, probs)
    assert counts[probs == 0].sum() == 0


def test_inverse_cdf_draw_is_the_first_token_whose_running_sum_passes_the_uniform() -> None:
    """The draw against a plain loop over the probabilities, fed the same uniform (taken from a copy of the
    generator): the same token for 300 draws, zero-probability tokens first, inside and last never drawn."""
    g = torch.Generator().manual_seed(5)
    probs = torch.rand(40, generator=g, dtype=torch.float64).float()
    probs[[0, 7, 8, 39]] = 0.0
    probs /= probs.sum()
    drawn = set()
    for seed in range(300):
        generator, copy = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        u = torch.rand((), dtype=torch.float64, generator=copy).item() * sum(float(p) for p in probs)
        running, want = 0.0, None
        for i, p in enumerate(probs.tolist()):
            running += p
            if running > u:
                want = i
                break
        token = inverse_cdf_draw(probs, generator)
        assert token == want
        drawn.add(token)
    assert drawn.isdisjoint({0, 7, 8, 39}) and len(drawn) > 25


def test_seed_reproducible() -> None:
    logits = torch.randn(100)
    p = SamplingParams(temperature=1.0, seed=7)
    a = [sample_token(logits, p, g) for g in [p.make_generator()] for _ in range(20)]
    b = [sample_token(logits, p, g) for g in [p.make_generator()] for _ in range(20)]
    assert a == b


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"max_tokens": -1},
        {"max_tokens": 1.5},
        {"logprobs": 21},
        {"prompt_logprobs": -1},
        {"repetition_penalty": 0},
    ],
)
def test_invalid_params(kwargs) -> None:
    with pytest.raises(SamplingError):
        SamplingParams(**kwargs)
