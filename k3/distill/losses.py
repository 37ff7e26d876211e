"""On-policy distillation: the advantages and the losses (teachers and their scores: k3.distill.teachers).

The method (Thinking Machines' on-policy distillation, MiMo's multi-teacher MOPD, GKD): the student
samples answers to prompts of several domains (tasks); the teacher of each sample's domain scores every
sampled token, and each token gets the advantage

    A_t = stopgrad( log pi_teacher(x_t | x_<t) - log pi_student(x_t | x_<t) )   [+ alpha * (r - mean_r)]

the negative per-token reverse KL (sampled estimate): a token the teacher finds likelier than the student
does is pushed up, one it finds unlikely is pushed down. The update is an importance-sampling policy
gradient over the student's tokens, with the weight pi_theta / pi_behaviour truncated to [lo, hi]
(behaviour: the distribution the engine drew the token from; the weight is a constant of the loss):

    L(theta) = -(1 / n) sum_t w_t A_t log pi_theta(x_t),     w_t = clamp(pi_theta / pi_behaviour, lo, hi)

so grad L = -(1 / n) sum_t w_t A_t grad log pi_theta(x_t), n the number of sampled tokens. With `alpha`
the task's verifiable reward, minus its mean over the K samples of the prompt, is added to every token's
advantage. For small vocabularies `reverse_kl_full` is the exact alternative (GKD with beta = 1): the
full-vocabulary KL(pi_student || pi_teacher) at every sampled context, differentiated through the
student's whole distribution; `forward_kl_full` (GKD with beta = 0) is KL(pi_teacher || pi_student) at the
same student-sampled contexts: its gradient q - p pulls up every token the teacher likes, also those the
student gives almost no mass (where the reverse KL's gradient, q (log q - log p - KL), vanishes).
"""

from __future__ import annotations

import torch

from k3.distill.teachers import Scores


# ---- advantages and losses --------------------------------------------------------------------------------
def discounted_sums(
    x: torch.Tensor, mask: torch.Tensor, discount: float, after: bool = False
) -> torch.Tensor:
    """[N, T] -> [N, T]: at each generated token t, sum_{k >= t} discount^(k - t) x_k over its row's later
    generated tokens (`after`: k > t only)."""
    out, running = torch.zeros_like(x), torch.zeros(x.shape[0], dtype=x.dtype)
    for t in reversed(range(x.shape[1])):  # [N] the discounted sum from token t on
        running = x[:, t] * mask[:, t] + discount * running
        out[:, t] = running * mask[:, t]
    return out - x * mask if after else out


def discounted_means(
    x: torch.Tensor, mask: torch.Tensor, discount: float, after: bool = False
) -> torch.Tensor:
    """[N, T] -> [N, T]: `discounted_sums` divided by the sum of the same discount weights, a weighted mean
    per remaining token; 0 where none remain. MiniLLM's length normalization: a summed rest-of-sample KL is
    smaller for a shorter rest, so it rewards stopping early whenever the student's tokens cost more than
    the teacher's improbable early end."""
    sums, weights = discounted_sums(x, mask, discount, after), discounted_sums(mask, mask, discount, after)
    return torch.where(weights > 0, sums / weights.clamp(min=1e-12), torch.zeros_like(x))


def advantages(scores: Scores, discount: float = 0.0, length_norm: bool = False) -> torch.Tensor:
    """[N, T] per-token advantage log pi_teacher - log pi_student (no gradient; MOPD's outcome term,
    `reward_advantages`, is added by the caller). With `discount` g > 0 token t's advantage is the
    discounted sum over its sample's later tokens,
    sum_{k >= t} g^(k - t) (log pi_teacher - log pi_student)_k (tinker-cookbook's kl_discount_factor; g = 1:
    the whole rest of the sample's reverse KL, a sequence-level signal: a token that leads to paths the
    student gets wrong is pushed down, so the student may drop a way of answering it is bad at).
    `length_norm` makes that sum a mean over the same tokens (`discounted_means`)."""
    adv = (scores.teacher - scores.student).detach() * scores.mask
    if discount:
        rest = discounted_means if length_norm else discounted_sums
        adv = rest(adv, scores.mask, discount)
    return adv


def reward_advantages(rewards: torch.Tensor, mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, T] each sample's reward minus its group's mean (group_size >= 2; else the reward itself) on
    every generated token: the outcome term, and `--method rl`'s whole advantage."""
    r = rewards.to(mask.dtype)
    if group_size >= 2:
        g = r.view(-1, group_size)
        r = (g - g.mean(-1, keepdim=True)).view(-1)
    return r[:, None] * mask


def importance_weights(logp: torch.Tensor, behaviour: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """[N, T] pi_theta / pi_behaviour per token, truncated to [low, high], without gradient."""
    return torch.exp(logp.detach() - behaviour).clamp(low, high)


def distill_loss(
    logp: torch.Tensor,
    behaviour: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    low: float = 0.0,
    high: float = 2.0,
) -> torch.Tensor:
    """The truncated importance-sampling policy-gradient loss (module doc). All [N, T]; `logp` carries the
    gradient, `behaviour` the engine's log-probs, `adv` the advantages."""
    w = importance_weights(logp, behaviour.to(logp.dtype), low, high)
    return -(w * adv.to(logp.dtype) * logp * mask).sum() / mask.sum().clamp(min=1)


def reverse_kl_full(student_dist: torch.Tensor, teacher_dist: torch.Tensor) -> torch.Tensor:
    """[N, T, V] log-distributions -> [N, T] KL(student || teacher), i.e.
    sum_v p_s(v) (log p_s(v) - log p_t(v))."""
    return (student_dist.exp() * (student_dist - teacher_dist)).sum(-1)


def forward_kl_full(student_dist: torch.Tensor, teacher_dist: torch.Tensor) -> torch.Tensor:
    """[N, T, V] log-distributions -> [N, T] KL(teacher || student), i.e.
    sum_v p_t(v) (log p_t(v) - log p_s(v))."""
    return (teacher_dist.exp() * (teacher_dist - student_dist)).sum(-1)


def full_vocab_kl(
    student_dist: torch.Tensor, teacher_dist: torch.Tensor, divergence: str = "reverse"
) -> torch.Tensor:
    """[N, T, V] log-distributions -> [N, T]: the full-vocabulary reverse KL (GKD's beta = 1) or forward KL
    (`divergence="forward"`, beta = 0) at each context, with the student's gradient; the teacher is a
    constant."""
    kl_full = reverse_kl_full if divergence == "reverse" else forward_kl_full
    return kl_full(student_dist, teacher_dist.detach())


def gkd_loss(kl: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GKD: the per-context divergence (`full_vocab_kl`, [N, T]) averaged over the sampled contexts."""
    return (kl * mask).sum() / mask.sum().clamp(min=1)


def leave_one_out_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N, T] -> [N, T]: at each generated token, the mean of x over the other rows' generated tokens at the
    same position (0 where no other row has one). Independent of the row's own sample, so subtracting it
    from a policy gradient's weight leaves its expectation unchanged (a baseline, as RLOO's)."""
    total, count = (x * mask).sum(0, keepdim=True), mask.sum(0, keepdim=True)  # [1, T]
    others = (count - mask).clamp(min=1)
    return torch.where(count - mask > 0, (total - x * mask) / others, torch.zeros_like(x)) * mask


def future_kl_advantages(
    kl: torch.Tensor, mask: torch.Tensor, discount: float, baseline: bool = False, length_norm: bool = False
) -> torch.Tensor:
    """[N, T]: the rest of the sequence-level reverse KL's gradient, beside `gkd_loss`'s local term, as a
    sampled-token advantage for `distill_loss`: minus the full-vocabulary reverse KL at the contexts after
    each token, sum_{k > t} discount^(k - t) KL_k (`kl` [N, T] from `full_vocab_kl`, taken as a constant).
    With discount 1, gkd_loss + distill_loss with this is an unbiased estimate of the gradient of the whole
    sample's expected reverse KL, sum_t E[KL_t] (MiniLLM's decomposition): the local term is exact, the
    future one a policy gradient whose reward, KL_k, is itself exact rather than one sampled log-ratio.
    With `baseline` the other samples' mean future KL at the same position is subtracted first
    (`leave_one_out_mean`): the same expectation, far less variance when every sample is far off.
    `length_norm` weights by the mean KL of the contexts after t instead (`discounted_means`): no longer
    the gradient of the sequence's KL, but free of its pull towards short samples."""
    rest = discounted_means if length_norm else discounted_sums
    future = rest(kl.detach() * mask, mask, discount, after=True)  # [N, T] the contexts after t only
    if baseline:
        future = future - leave_one_out_mean(future, mask)
    return -future


def sampled_reverse_kl(scores: Scores, teacher_of: list[str]) -> dict[str, float]:
    """Per teacher: mean over its samples' tokens of log pi_student - log pi_teacher (the sampled,
    unbiased estimate of the per-token reverse KL on the student's own samples)."""
    out = {}
    diff = (scores.student - scores.teacher) * scores.mask
    for name in dict.fromkeys(teacher_of):
        rows = torch.tensor([i for i, owner in enumerate(teacher_of) if owner == name])
        out[name] = float(diff[rows].sum() / scores.mask[rows].sum().clamp(min=1))
    return out
