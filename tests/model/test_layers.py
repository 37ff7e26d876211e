"""Small layer-level checks that the end-to-end parity tests would not single out."""

from __future__ import annotations

import torch

import k3.model.norm as norm
from k3.model.activations import situ


def test_big_weight_in_another_dtype_is_converted_in_slices(monkeypatch):
    layer = norm.Linear(64, 1000)
    layer.weight.data = torch.randn(1000, 64).bfloat16()
    x = torch.randn(3, 64)
    whole = x @ layer.weight.float().t()
    monkeypatch.setattr(norm, "CONVERT_ROWS_ELEMENTS", 64 * 7)  # slices of 7 rows, the last one shorter
    sliced = layer(x)
    assert sliced.shape == (3, 1000)
    assert torch.allclose(sliced, whole, atol=1e-5)


def test_situ_is_bounded_by_its_betas():
    g = torch.tensor([-1e4, -3.0, 0.0, 0.5, 3.0, 1e4])
    u = torch.tensor([1e4, 2.0, -1.0, 0.0, -1e4, 1e4])
    out = situ(g, u, beta=4.0, linear_beta=25.0)
    expected = [
        4 * torch.tanh(a / 4) * torch.sigmoid(a) * 25 * torch.tanh(b / 25) for a, b in zip(g, u, strict=True)
    ]
    assert torch.allclose(out, torch.stack(expected))
    assert out.abs().max() <= 4 * 25
