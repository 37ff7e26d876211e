"""On-policy distillation losses (issue #24): zero advantage with teacher = student leaves the weights
bitwise unchanged under SGD, the gradient is the analytic policy-gradient form (float64), the full-vocabulary
reverse KL equals a brute-force sum, a vocabulary mismatch is named."""

import pytest
import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.rl.distill import (
    DistillError,
    check_compatible,
    distill_loss,
    full_reverse_kl,
    reverse_kl_advantages,
)


def test_teacher_equal_to_student_changes_nothing():
    model = K3ForCausalLM.from_config(K3Config.from_pretrained("tiny"), seed=2, quantized_experts=False)
    ids = torch.randint(1, 700, (2, 6), generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    logp = torch.log_softmax(model(ids[:, :-1]).float(), -1).gather(-1, ids[:, 1:, None])[..., 0]  # [2, 5]
    with torch.no_grad():
        teacher = torch.log_softmax(model(ids[:, :-1]).float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    adv = reverse_kl_advantages(logp, teacher)
    assert torch.count_nonzero(adv) == 0
    optimizer = torch.optim.SGD(model.parameters(), lr=10.0)
    distill_loss(logp, logp.detach(), adv, torch.ones_like(logp)).backward()
    optimizer.step()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_gradient_is_the_policy_gradient_form():
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(4, 6, dtype=torch.float64, generator=g).requires_grad_()  # [T, V]
    y = torch.multinomial(torch.softmax(theta.detach(), -1), 3, replacement=True, generator=g).T  # [K, T]
    teacher = torch.log_softmax(torch.randn(4, 6, dtype=torch.float64, generator=g), -1)
    logp = torch.log_softmax(theta, -1).gather(-1, y.T).T  # [K, T]
    adv = reverse_kl_advantages(logp, teacher.gather(-1, y.T).T)
    (grad,) = torch.autograd.grad(distill_loss(logp, logp.detach(), adv, torch.ones_like(logp)), theta)
    p = torch.softmax(theta.detach(), -1)
    grad_logpi = torch.nn.functional.one_hot(y, 6).double() - p  # [K, T, V]
    analytic = -(adv[..., None] * grad_logpi).sum(0) / logp.numel()
    torch.testing.assert_close(grad, analytic, rtol=1e-12, atol=1e-14)


def test_full_reverse_kl_brute_force():
    g = torch.Generator().manual_seed(2)
    s, t = torch.randn(5, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)
    ps, pt = torch.softmax(s, 0).tolist(), torch.softmax(t, 0).tolist()
    import math

    expected = sum(a * math.log(a / b) for a, b in zip(ps, pt, strict=True))
    assert abs(float(full_reverse_kl(s.float(), t.float())) - expected) < 1e-6


def test_vocabulary_mismatch_is_named():
    tiny = K3Config.from_pretrained("tiny")
    other = K3Config.from_pretrained("tiny")
    other.vocab_size = 2048
    check_compatible(tiny, {"math": tiny})
    with pytest.raises(DistillError, match="teacher code: vocabulary of 2048"):
        check_compatible(tiny, {"math": tiny, "code": other})
