"""Losses against analytic gradients and brute-force categorical expectations (float64)."""

import pytest
import torch

from k3.rl.losses import (
    grpo_loss,
    k2_loss,
    kl_estimate,
    length_reward,
    shape_rewards,
)


@pytest.fixture(autouse=True)
def float64():
    """Every test here in float64; the default is restored for the other test files."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def _policy(seed: int, T: int = 4, V: int = 5, K: int = 6):
    """A per-position categorical policy theta [T, V] and K sampled sequences y [K, T]."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(T, V, generator=g).requires_grad_()
    y = torch.multinomial(torch.softmax(theta.detach(), -1), K, replacement=True, generator=g).T  # [K, T]
    rewards = torch.rand(K, generator=g)
    return theta, y, rewards


def _token_logp(theta: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(theta, -1).gather(-1, y.T).T  # [K, T]


def _analytic_grad_logpi(theta: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """grad_theta log pi(y_k) for each sample: one_hot(y_t) - softmax(theta_t) at each position. [K, T, V]"""
    p = torch.softmax(theta.detach(), -1)  # [T, V]
    return torch.nn.functional.one_hot(y, theta.shape[-1]).double() - p


def test_k2_gradient_at_theta_old_is_mean_baselined_policy_gradient():
    for seed in range(3):
        theta, y, r = _policy(seed)
        logp = _token_logp(theta, y)
        loss = k2_loss(logp, logp.detach(), torch.ones_like(logp), r, group_size=len(r), tau=0.3)
        (grad,) = torch.autograd.grad(loss, theta)
        analytic = -((r - r.mean())[:, None, None] * _analytic_grad_logpi(theta, y)).sum(0)
        torch.testing.assert_close(grad, analytic, rtol=1e-12, atol=1e-12)


def test_k2_value_against_a_loop():
    theta, y, r = _policy(7)
    old = theta.detach() + 0.1 * torch.randn(theta.shape, generator=torch.Generator().manual_seed(1))
    logp, old_logp = _token_logp(theta, y), _token_logp(old, y)
    mask = torch.ones_like(logp)
    mask[0, 2:] = 0
    K, tau = 3, 0.5  # two groups of three
    expected = 0.0
    for g in range(2):
        rows = range(g * K, (g + 1) * K)
        mean = sum(float(r[i]) for i in rows) / K
        for i in rows:
            ratio = sum(float(logp[i, t].detach() - old_logp[i, t]) for t in range(y.shape[1]) if mask[i, t])
            expected += (float(r[i]) - mean - tau * ratio) ** 2
    expected /= 2 * tau * 2
    assert abs(float(k2_loss(logp, old_logp, mask, r, K, tau).detach()) - expected) < 1e-12


def test_grpo_gradient_at_theta_old():
    theta, y, r = _policy(3)
    logp = _token_logp(theta, y)
    loss = grpo_loss(logp, logp.detach(), torch.ones_like(logp), r, group_size=len(r))
    (grad,) = torch.autograd.grad(loss, theta)
    adv = (r - r.mean()) / (r.std(correction=0) + 1e-6)
    analytic = -(adv[:, None, None] * _analytic_grad_logpi(theta, y)).sum(0) / logp.numel()
    torch.testing.assert_close(grad, analytic, rtol=1e-10, atol=1e-12)


def test_grpo_clip_stops_the_gradient_past_the_trust_region():
    theta, y, r = _policy(4, K=2)
    logp = _token_logp(theta, y)
    r = torch.tensor([1.0, 0.0])  # sample 0 has a positive advantage
    old = logp.detach() - 1.0  # ratio e > 1.2 everywhere
    loss = grpo_loss(logp, old, torch.ones_like(logp), r, 2)
    (grad,) = torch.autograd.grad(loss, theta)
    # positive advantage and ratio above 1 + clip: clipped, no gradient; negative advantage: min keeps ratio
    adv = -0.5 / (0.5 + 1e-6)
    ratio = torch.exp(logp - old).detach()[1][:, None]  # [T, 1]
    only_negative = -(adv * ratio * _analytic_grad_logpi(theta, y)[1])  # [T, V]
    torch.testing.assert_close(grad, only_negative / logp.numel())


def _categorical_pair(seed: int, V: int = 7):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(V, generator=g).requires_grad_()
    ref = torch.randn(V, generator=g)
    return theta, torch.log_softmax(ref, -1)


def test_kl_estimators_expected_value_brute_force():
    theta, log_p = _categorical_pair(0)
    log_q = torch.log_softmax(theta, -1)
    q = log_q.exp().detach()
    kl_qp = float((q * (log_q.detach() - log_p)).sum())
    # every outcome x weighted by q(x): the exact expectation of each estimator under samples of q
    e = {k: float((q * kl_estimate(log_q.detach(), log_p, k)).sum()) for k in ("k1", "k2", "k3")}
    assert abs(e["k1"] - kl_qp) < 1e-12
    assert abs(e["k3"] - kl_qp) < 1e-12
    log_r = log_p - log_q.detach()
    assert abs(e["k2"] - float((q * 0.5 * log_r**2).sum())) < 1e-12
    assert e["k2"] != kl_qp  # biased
    assert (kl_estimate(log_q, log_p, "k3") >= 0).all()


def test_kl_estimators_expected_gradient_brute_force():
    theta, log_p = _categorical_pair(1)

    def expected_grad(kind: str) -> torch.Tensor:
        log_q = torch.log_softmax(theta, -1)
        q = log_q.exp().detach()  # the samples' distribution is not differentiated
        (g,) = torch.autograd.grad((q * kl_estimate(log_q, log_p, kind)).sum(), theta)
        return g

    log_q = torch.log_softmax(theta, -1)
    (reverse,) = torch.autograd.grad((log_q.exp() * (log_q - log_p)).sum(), theta)  # grad KL(q || p)
    log_q = torch.log_softmax(theta, -1)
    (forward,) = torch.autograd.grad((log_p.exp() * (log_p - log_q)).sum(), theta)  # grad KL(p || q)
    torch.testing.assert_close(expected_grad("k1"), torch.zeros_like(theta), atol=1e-12, rtol=0)
    torch.testing.assert_close(expected_grad("k2"), reverse, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(expected_grad("k3"), forward, atol=1e-12, rtol=1e-10)


def test_kl_k3_monte_carlo_is_unbiased():
    theta, log_p = _categorical_pair(2)
    log_q = torch.log_softmax(theta.detach(), -1)
    x = torch.multinomial(log_q.exp(), 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    est = float(kl_estimate(log_q[x], log_p[x], "k3").mean())
    exact = float((log_q.exp() * (log_q - log_p)).sum())
    assert abs(est - exact) < 0.01 * exact + 1e-3


def test_length_reward_kimi_k15():
    correct = torch.tensor([True, True, False, False, True, False, True, False])
    lengths = torch.tensor([10, 20, 30, 10, 7, 7, 7, 7])
    out = length_reward(correct, lengths, group_size=4)
    # group 1: min 10, max 30: lambda = 0.5, 0, -0.5, 0.5; wrong answers get min(0, lambda)
    torch.testing.assert_close(out[:4], torch.tensor([0.5, 0.0, -0.5, 0.0]))
    # group 2: equal lengths: 0
    torch.testing.assert_close(out[4:], torch.zeros(4))


def test_shape_rewards_truncation_penalty():
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0])
    out = shape_rewards(
        scores, torch.tensor([3, 3, 3, 3]), torch.tensor([False, True, False, True]), 2, 0, 0.5
    )
    torch.testing.assert_close(out, torch.tensor([1.0, -0.5, 0.0, -0.5]))
