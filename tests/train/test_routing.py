"""Quantile balancing against an exact solver, the exact solver against brute force, the DeepSeek update
against its formula."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.train.routing import (
    RoutingBalancer,
    balanced_assignment,
    deepseek_bias_update,
    expert_loads,
    max_over_mean,
    quantile_balance_bias,
    topk_assignment,
)


def random_scores(tokens: int, experts: int, seed: int, skew: float = 0.5) -> torch.Tensor:
    """Sigmoid router scores with a per-expert offset, so plain top-k is clearly unbalanced."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g, dtype=torch.float64)
    offset = skew * torch.randn(1, experts, generator=g, dtype=torch.float64)
    return torch.sigmoid(logits) + offset


def dual_objective(scores: torch.Tensor, k: int, bias: torch.Tensor) -> float:
    """D(beta) = q sum beta + sum_t (sum of the k largest of s_t - beta), with beta = -bias: an upper bound
    on every balanced assignment's objective (weak duality), equal to the optimum only at optimal beta."""
    tokens, experts = scores.shape
    beta = -bias
    q = tokens * k / experts
    return float(q * beta.sum() + torch.topk(scores - beta, k, dim=1).values.sum())


def brute_force_balanced(scores: torch.Tensor, k: int) -> float:
    """The best balanced assignment by enumerating every choice of k experts for every token."""
    tokens, experts = scores.shape
    q = tokens * k // experts
    best = float("-inf")
    subsets = list(itertools.combinations(range(experts), k))
    for choice in itertools.product(subsets, repeat=tokens):
        loads = [0] * experts
        for subset in choice:
            for e in subset:
                loads[e] += 1
        if all(load == q for load in loads):
            best = max(best, sum(float(scores[t, e]) for t, subset in enumerate(choice) for e in subset))
    return best


@pytest.mark.parametrize("tokens,experts,k", [(4, 2, 1), (4, 4, 2), (6, 3, 1), (5, 5, 2)])
def test_exact_solver_matches_brute_force(tokens: int, experts: int, k: int) -> None:
    scores = random_scores(tokens, experts, seed=tokens * 10 + experts)
    x, objective = balanced_assignment(scores, k)
    assert objective == pytest.approx(brute_force_balanced(scores, k), abs=1e-9)
    assert torch.equal(x.sum(1), torch.full((tokens,), float(k), dtype=x.dtype))
    assert torch.equal(x.sum(0), torch.full((experts,), float(tokens * k // experts), dtype=x.dtype))
    assert float((x * scores).sum()) == pytest.approx(objective, abs=1e-9)


@pytest.mark.parametrize(
    "tokens,experts,k,seed", [(16, 4, 1, 0), (32, 8, 2, 1), (64, 8, 2, 2), (96, 16, 4, 3), (120, 8, 3, 4)]
)
def test_iterated_quantile_balancing_reaches_the_lp_optimum(
    tokens: int, experts: int, k: int, seed: int
) -> None:
    scores = random_scores(tokens, experts, seed)
    x_opt, optimum = balanced_assignment(scores, k)
    # plain top-k is unbalanced on these batches: otherwise the test would prove nothing
    assert max_over_mean(expert_loads(scores, k)) > 1.2
    bias = quantile_balance_bias(scores, k, iters=5000)
    x = topk_assignment(scores, k, bias)
    q = tokens * k // experts
    assert torch.equal(x.sum(0), torch.full((experts,), float(q), dtype=x.dtype))
    assert float((x * scores).sum()) == pytest.approx(optimum, abs=1e-6)
    assert dual_objective(scores, k, bias) == pytest.approx(optimum, abs=1e-6)
    assert torch.equal(x, x_opt)  # continuous scores: the optimum is unique
    assert abs(float(bias.sum())) < 1e-9  # mean-centred


@settings(max_examples=25, deadline=None)
@given(
    experts=st.integers(2, 10),
    k_frac=st.floats(0.0, 1.0),
    per_expert=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
    skew=st.floats(0.0, 2.0),
)
def test_quantile_balancing_property(
    experts: int, k_frac: float, per_expert: int, seed: int, skew: float
) -> None:
    k = 1 + int(k_frac * (experts - 2)) if experts > 2 else 1
    tokens = per_expert * experts  # E divides T k
    scores = random_scores(tokens, experts, seed, skew)
    _, optimum = balanced_assignment(scores, k)
    bias = quantile_balance_bias(scores, k, iters=20000)
    x = topk_assignment(scores, k, bias)
    assert torch.equal(x.sum(0), torch.full((experts,), float(tokens * k // experts), dtype=x.dtype))
    assert float((x * scores).sum()) == pytest.approx(optimum, abs=1e-6)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(0.0, 3.0))
def test_lp_optimum_is_below_every_dual_bound(seed: int, scale: float) -> None:
    """Weak duality: an optimum the solver got wrong (too low) would fall below some dual bound."""
    scores = random_scores(24, 6, seed)
    _, optimum = balanced_assignment(scores, 2)
    g = torch.Generator().manual_seed(seed + 1)
    bias = scale * torch.randn(6, generator=g, dtype=torch.float64)
    assert dual_objective(scores, 2, bias) >= optimum - 1e-9


def test_lp_is_bounded_by_plain_topk_and_equals_it_when_topk_is_balanced() -> None:
    scores = random_scores(32, 8, seed=7)
    _, optimum = balanced_assignment(scores, 2)
    plain = float((topk_assignment(scores, 2) * scores).sum())
    assert optimum < plain  # capacity binds: the balanced optimum gives something up
    # planted: token t prefers experts t % 8 and (t + 1) % 8, so plain top-2 is already balanced
    planted = torch.rand(32, 8, generator=torch.Generator().manual_seed(8), dtype=torch.float64) * 0.1
    for t in range(32):
        planted[t, t % 8] += 1.0
        planted[t, (t + 1) % 8] += 1.0
    x, optimum = balanced_assignment(planted, 2)
    assert torch.equal(x, topk_assignment(planted, 2))
    assert optimum == pytest.approx(float((x * planted).sum()))


def test_non_divisible_capacity_is_the_ceiling() -> None:
    scores = random_scores(10, 4, seed=9)  # 10 * 1 / 4 = 2.5 -> at most 3 tokens per expert
    x, _ = balanced_assignment(scores, 1)
    assert x.sum(0).max() <= 3 and torch.equal(x.sum(1), torch.ones(10, dtype=x.dtype))


def test_one_round_matches_a_loop_written_from_the_spec() -> None:
    scores = random_scores(24, 6, seed=11)
    k, q = 2, 24 * 2 // 6
    init = torch.linspace(-0.3, 0.3, 6, dtype=torch.float64)
    # the spec, one scalar at a time: cutoffs between the k-th and (k+1)-th biased score of each token,
    # then prices between the q-th and (q+1)-th of score minus cutoff of each expert
    cutoffs = []
    for t in range(24):
        ranked = sorted((float(scores[t, e] + init[e]) for e in range(6)), reverse=True)
        cutoffs.append((ranked[k - 1] + ranked[k]) / 2)
    beta = []
    for e in range(6):
        ranked = sorted((float(scores[t, e]) - cutoffs[t] for t in range(24)), reverse=True)
        beta.append((ranked[q - 1] + ranked[q]) / 2)
    expected = -torch.tensor(beta, dtype=torch.float64)
    expected -= expected.mean()
    got = quantile_balance_bias(scores, k, iters=1, init_bias=init)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_deepseek_update_moves_by_gamma_towards_the_mean() -> None:
    bias = torch.tensor([0.1, 0.0, -0.2, 0.05])
    loads = torch.tensor([10.0, 2.0, 4.0, 4.0])  # mean 5
    got = deepseek_bias_update(bias, loads, gamma=1e-3)
    torch.testing.assert_close(got, torch.tensor([0.1 - 1e-3, 1e-3, -0.2 + 1e-3, 0.05 + 1e-3]))
    torch.testing.assert_close(deepseek_bias_update(bias, torch.full((4,), 3.0)), bias)  # balanced: no move


def test_balancer_applies_only_earlier_batches() -> None:
    scores = random_scores(64, 8, seed=12).float()
    balancer = RoutingBalancer([1], num_experts=8, k=2, method="qb")
    first = balancer.update(1, scores)
    torch.testing.assert_close(first, expert_loads(scores, 2))  # routed with the initial zero bias
    second = balancer.update(1, scores)  # same batch again: now routed with the bias learned from it
    assert max_over_mean(second) < max_over_mean(first)
    for _ in range(200):
        loads = balancer.update(1, scores)
    assert max_over_mean(loads) <= 1.0 + 1e-6


def test_balancer_methods() -> None:
    scores = random_scores(64, 8, seed=13).float()
    none = RoutingBalancer([0], 8, 2, method="none")
    none.update(0, scores)
    assert torch.equal(none.biases[0], torch.zeros(8))
    ds = RoutingBalancer([0], 8, 2, method="deepseek", gamma=1e-3)
    loads = ds.update(0, scores)
    torch.testing.assert_close(ds.biases[0], deepseek_bias_update(torch.zeros(8), loads, 1e-3))
    with pytest.raises(ValueError, match="needs the batch's expert loads"):
        ds.fit(0, scores)  # the sign update counts loads; scores alone do not say which bias routed them
    with pytest.raises(ValueError, match="unknown balance method"):
        RoutingBalancer([0], 8, 2, method="aux-loss")


def test_bad_inputs_fail_clearly() -> None:
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        quantile_balance_bias(torch.rand(3, 4, 5), 2)
    with pytest.raises(ValueError, match="outside 1..4"):
        quantile_balance_bias(torch.rand(8, 4), 5)
    with pytest.raises(ValueError, match="NaN"):
        balanced_assignment(torch.tensor([[float("nan"), 1.0]]), 1)
    with pytest.raises(ValueError, match="fewer than one token per expert"):
        quantile_balance_bias(torch.rand(2, 8), 1)
    assert torch.equal(quantile_balance_bias(torch.rand(5, 4), 4), torch.zeros(4))
