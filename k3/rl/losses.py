"""RL losses over groups of K samples per prompt, KL estimators, and reward shaping.

Shapes: a batch holds G prompts x K samples = N rows, the K samples of a prompt in consecutive rows.
Per-token tensors are [N, T] (right-padded), with `mask` [N, T] = 1 on the tokens the loss counts (the
sampled answer tokens; 0 on padding, tool output, or tokens too stale to train on).

K2 / K1.5 policy mirror descent (Kimi K1.5 section 2.3.2, K2 section 3.3):

    L(theta) = 1/(2 tau G) sum_g sum_i ( r_gi - mean_j r_gj - tau * log pi_theta(y_gi) / pi_old(y_gi) )^2

with log pi(y) the sum of the token log-probs of sample y. At theta = theta_old the log-ratio is 0 and
grad L = -(1/G) sum_g sum_i (r_gi - mean_j r_gj) grad log pi(y_gi): the policy gradient with the mean-reward
baseline; away from theta_old the squared form pulls log pi / pi_old towards (r - mean_r) / tau, the
closed-form solution of the KL-regularised objective, so tau sets how far one iteration moves the policy.

ReST (rejection sampling fine-tuning, K1.5's baseline): the log-likelihood of the correct samples.

GRPO (Shao et al. 2024), the comparison: advantages (r - mean) / (std + eps) per group, PPO's clipped
ratio per token, averaged over all counted tokens of the batch.

KL estimators (J. Schulman, "Approximating KL Divergence", 2020). Samples x ~ q (the policy being
trained, pi_theta), reference p (e.g. pi_old); with log r = log p(x) - log q(x):

    k1 = -log r                 unbiased for KL(q || p); as a loss its expected gradient is 0
    k2 = (log r)^2 / 2          biased, low variance; as a loss its expected gradient is grad KL(q || p)
    k3 = (r - 1) - log r        unbiased for KL(q || p), always >= 0; as a loss its expected gradient is
                                grad KL(p || q) (the forward KL)

("as a loss": gradient through log q(x) at the sampled x, the sampling itself not differentiated, as an
autograd loss does.) tests/rl/test_losses.py checks all six statements by brute force over a categorical.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def group_baseline(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N] rewards -> [N] r - mean of its group (K = group_size consecutive rows)."""
    r = rewards.view(-1, group_size)  # [G, K]
    return (r - r.mean(-1, keepdim=True)).view(-1)


def k2_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    rewards: torch.Tensor,
    group_size: int,
    tau: float,
    token_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The K2 / K1.5 squared loss (module doc). logp, old_logp, mask: [N, T]; rewards: [N].

    `token_weights` [N, T] (detached; e.g. truncated importance weights of stale tokens) scale each
    token's log-ratio term."""
    if tau <= 0:
        raise ValueError(f"tau must be positive, got {tau}")
    weight = mask if token_weights is None else mask * token_weights
    log_ratio = ((logp - old_logp) * weight).sum(-1)  # [N]
    advantage = group_baseline(rewards, group_size)  # [N]
    groups = rewards.numel() // group_size
    return ((advantage - tau * log_ratio) ** 2).sum() / (2 * tau * groups)


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """[N] -> (r - mean) / (std + eps) within each group (std with Bessel's correction off)."""
    r = rewards.view(-1, group_size)
    return ((r - r.mean(-1, keepdim=True)) / (r.std(-1, correction=0, keepdim=True) + eps)).view(-1)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    rewards: torch.Tensor,
    group_size: int,
    clip: float = 0.2,
    token_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """PPO-clipped surrogate with group-normalised advantages, mean over counted tokens. [N, T] inputs."""
    advantage = grpo_advantages(rewards, group_size)[:, None]  # [N, 1]
    ratio = torch.exp(logp - old_logp)  # [N, T]
    surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage)
    weight = mask if token_weights is None else mask * token_weights
    return -(surrogate * weight).sum() / mask.sum().clamp_min(1)


def rest_loss(logp: torch.Tensor, mask: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
    """ReST / rejection-sampling fine-tuning (K1.5's ablation): the negative log-likelihood of the correct
    samples only, mean over their tokens (0, with no gradient signal, when none is correct). correct: [N]."""
    keep = mask * correct[:, None].to(mask.dtype)
    return -(logp * keep).sum() / keep.sum().clamp_min(1)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-sample estimate of KL(pi || ref) from samples of pi: logp = log pi(x), ref_logp = log ref(x)."""
    log_r = ref_logp - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {kind!r} (known: {', '.join(KL_ESTIMATORS)})")


def length_reward(correct: torch.Tensor, lengths: torch.Tensor, group_size: int) -> torch.Tensor:
    """Kimi K1.5's length penalty (section 2.3.3), per group of K samples of one prompt:

        lambda_i = 0.5 - (len_i - min_len) / (max_len - min_len)
        reward_i = lambda_i if sample i is correct, else min(0, lambda_i)

    (all 0 when every sample of the group has the same length). correct: [N] bool, lengths: [N]."""
    n = lengths.view(-1, group_size).double()
    lo, hi = n.min(-1, keepdim=True).values, n.max(-1, keepdim=True).values
    lam = torch.where(hi > lo, 0.5 - (n - lo) / (hi - lo).clamp_min(1e-12), torch.zeros_like(n)).view(-1)
    return torch.where(correct.bool(), lam, lam.clamp(max=0.0))


def shape_rewards(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    truncated: torch.Tensor,
    group_size: int,
    length_coef: float = 0.0,
    truncation_penalty: float = 0.0,
) -> torch.Tensor:
    """Final rewards [N]: the grader's score, plus `length_coef` x the length reward, and a response cut
    by its token budget (or stopped as a loop) gets `-truncation_penalty` whatever its text (K2's budget
    control). scores: [N] in [0, 1]; lengths: [N] tokens; truncated: [N] bool."""
    rewards = scores.double()
    if length_coef:
        rewards = rewards + length_coef * length_reward(scores > 0.5, lengths, group_size)
    return torch.where(truncated.bool(), torch.full_like(rewards, -truncation_penalty), rewards)
