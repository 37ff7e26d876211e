"""On-policy distillation (issue #24, started): the student samples, a teacher scores every sampled token,
and the per-token advantage is the negative reverse KL `log pi_teacher(y_t) - log pi_student(y_t)`
(Thinking Machines' on-policy distillation; MiMo's multi-teacher MOPD routes each sample to the teacher
of its domain). Trained with an importance-sampling policy gradient:

    loss = -1/|tokens| sum_t  sg(clip(pi_theta / pi_behaviour, lo, hi)) * sg(A_t) * log pi_theta(y_t)

so at theta = behaviour the gradient is -mean_t A_t grad log pi_theta(y_t); with the teacher equal to the
student every A_t is exactly 0 and so is the gradient. `full_reverse_kl` is GKD's beta = 1 objective over
the whole vocabulary, for small vocabularies. Only the losses exist so far: no `k3 distill` command, no
teacher routing or baselines (see /work/notes/issue-24.md).
"""

from __future__ import annotations

import torch

from k3.errors import K3Error


class DistillError(K3Error):
    """Teachers and student that cannot be distilled together (e.g. different vocabularies)."""


def reverse_kl_advantages(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """[N, T] per-token advantage log pi_teacher - log pi_student of the sampled tokens, detached."""
    return (teacher_logp - student_logp).detach()


def distill_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: tuple[float, float] = (0.0, 2.0),
) -> torch.Tensor:
    """The truncated-IS policy-gradient loss above. logp: [N, T] under training; behaviour_logp: [N, T] as
    sampled; advantages: [N, T] (detached); mask: [N, T]."""
    ratio = torch.exp(logp.detach() - behaviour_logp).clamp(*clip)
    return -(ratio * advantages.detach() * logp * mask).sum() / mask.sum().clamp_min(1)


def full_reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """[..., V] logits -> [...] KL(pi_student || pi_teacher) at each position, over the whole vocabulary."""
    log_s = torch.log_softmax(student_logits.float(), -1)
    log_t = torch.log_softmax(teacher_logits.float(), -1)
    return (log_s.exp() * (log_s - log_t)).sum(-1)


def check_compatible(student_cfg, teachers: dict[str, object]) -> None:
    """Every teacher config must have the student's vocabulary size (same token ids); names what differs."""
    for name, cfg in teachers.items():
        if cfg.vocab_size != student_cfg.vocab_size:
            raise DistillError(
                f"teacher {name}: vocabulary of {cfg.vocab_size} ids, "
                f"the student's has {student_cfg.vocab_size}"
            )
