"""A BF16 weight times fp32 activations (k3.model.norm.Linear): the native kernel for a few rows, torch's
slices above, both against a float64 product of the same numbers (BF16 -> fp32 is exact, so the only
difference is the order of the fp32 sums)."""

from __future__ import annotations

import os

import pytest
import torch

import k3.model.norm as norm
from k3.model.norm import NATIVE_BF16_ROWS, Linear
from k3.ops.decode.native import load_native

pytestmark = pytest.mark.skipif(
    load_native() is None and os.environ.get("CI") != "true", reason="native kernels unavailable (k3 doctor)"
)


class Counting:
    def __init__(self) -> None:
        self.native, self.calls = load_native(), 0

    def project(self, *args):
        self.calls += 1
        return self.native.project(*args)


@pytest.fixture
def counting(monkeypatch) -> Counting:
    counter = Counting()
    monkeypatch.setattr(norm, "load_native", lambda: counter)
    return counter


def bf16_linear(n_in: int, n_out: int, seed: int) -> Linear:
    layer = Linear(n_in, n_out)
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n_out, n_in, generator=g).to(torch.bfloat16)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    return layer


def exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).float()


@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (2, 5), (1, NATIVE_BF16_ROWS)])
def test_native_rows_equal_the_exact_product(counting, shape):
    layer = bf16_linear(203, 38, seed=1)  # K % 8 = 3 and N % 4 = 2: the kernel's tails
    x = torch.randn(*shape, 203, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y = layer(x)
    want = exact(x, layer.weight)
    assert y.shape == want.shape and y.dtype == torch.float32
    assert ((y - want).abs().max() / want.abs().max()).item() <= 1e-6
    assert counting.calls == 1


def test_a_rows_result_does_not_depend_on_its_batch(counting):
    layer = bf16_linear(136, 20, seed=3)
    x = torch.randn(7, 136, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        together = layer(x)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(7)])
        pairs = torch.cat([layer(x[i : i + 2]) for i in range(0, 6, 2)] + [layer(x[6:])])
    assert torch.equal(together, alone) and torch.equal(together, pairs)


def test_many_rows_and_gradients_take_torchs_path(counting):
    layer = bf16_linear(64, 12, seed=5)
    many = torch.randn(NATIVE_BF16_ROWS + 1, 64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        y = layer(many)
    assert counting.calls == 0
    assert ((y - exact(many, layer.weight)).abs().max() / y.abs().max()).item() <= 1e-6
    x = torch.randn(2, 64, requires_grad=True)
    layer(x).sum().backward()  # grad enabled: torch's ops, which autograd can differentiate
    assert counting.calls == 0
    assert torch.allclose(x.grad, layer.weight.float().sum(0).expand(2, -1))
