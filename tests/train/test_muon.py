"""k3's Muon: bitwise torch.optim.Muon with the bf16 iteration; with fp32, an orthogonalisation that a
float64 run of the same iteration confirms, and that does not amplify last-bit gradient differences."""

from __future__ import annotations

import torch

from k3.train.optim import Muon, newton_schulz

COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((24, 40), (40, 24), (16, 16))]


def _run(optimizer_cls, steps: int = 4, **kwargs) -> list[torch.Tensor]:
    params = _params(0)
    opt = optimizer_cls(params, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", **kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in params]


def test_bf16_iteration_is_bitwise_torch_muon():
    for got, want in zip(_run(Muon), _run(torch.optim.Muon), strict=True):
        assert torch.equal(got, want)


def test_without_nesterov_the_momentum_buffer_is_not_overwritten():
    params = _params(0)
    opt = Muon(params, lr=0.02, nesterov=False, ns_dtype=torch.float32)
    grads = [torch.randn_like(p) for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    opt.step()
    for p, g in zip(params, grads, strict=True):  # after one step from zero: buf = (1 - momentum) g
        assert torch.allclose(opt.state[p]["momentum_buffer"], 0.05 * g, rtol=1e-6, atol=0)


def test_fp32_iteration_matches_float64_and_a_last_bit_change_stays_small():
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(48, 80, generator=gen)
    x32 = newton_schulz(g, COEFFICIENTS, 5, 1e-7, torch.float32)
    x64 = newton_schulz(g.double(), COEFFICIENTS, 5, 1e-7, torch.float64)
    assert float((x32.double() - x64).norm() / x64.norm()) < 1e-5
    nudged = g * (1 + 2**-23 * torch.randint(-1, 2, g.shape, generator=gen))  # last-bit differences
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
    assert rel(newton_schulz(nudged, COEFFICIENTS, 5, 1e-7, torch.float32), x32) < 1e-5
    # bf16 resolves the update to ~1e-2 only: a gradient that rounds to another bf16 value moves it that much
    assert rel(newton_schulz(g, COEFFICIENTS, 5, 1e-7, torch.bfloat16), x64) > 1e-3
