"""Small layer-level checks that the end-to-end parity tests would not single out."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

import k3.model.norm as norm
from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.model.activations import gated_activation, silu_glu, situ
from k3.model.mlp import MLP
from k3.model.moe import RoutedExpert
from k3.ops.decode.native import load_native


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


@pytest.mark.parametrize("hidden_act", ["situ", "silu"])
def test_the_modules_activation_is_native_only_when_asked_and_without_gradients(hidden_act):
    """`gated_activation(cfg)`: asked for (`native=True`) on inputs that need no gradient, the native kernel's
    values (fp32 and bf16, the same bits as calling it, not torch's); by default, for inputs that need a
    gradient, for other dtypes and for SiTU without its cap, torch's definition, bit for bit, and its
    gradient."""
    native = load_native()
    assert native is not None, "native decode kernels not built: python -m k3.ops.build"
    cfg = dataclasses.replace(K3Config.preset("tiny"), hidden_act=hidden_act)
    act = gated_activation(cfg)
    reference = partial(situ, beta=4.0, linear_beta=25.0) if hidden_act == "situ" else silu_glu
    args = (1, 4.0, 25.0) if hidden_act == "situ" else (0,)
    gen = torch.Generator().manual_seed(0)
    g, u = torch.randn(37, 300, generator=gen) * 4, torch.randn(37, 300, generator=gen) * 30
    for dtype in (torch.float32, torch.bfloat16):
        a, b = g.to(dtype), u.to(dtype)
        with torch.no_grad():
            asked, default = act(a, b, native=True), act(a, b)
        assert torch.equal(asked, native.gated_activation(a, b, *args))
        assert not torch.equal(asked, reference(a, b))  # torch's ops round otherwise: the native path ran
        assert torch.allclose(asked.double(), reference(a.double(), b.double()), rtol=2**-8, atol=1e-6)
        assert torch.equal(default, reference(a, b))
    a = g.clone().requires_grad_()
    out = act(a, u, native=True)
    assert torch.equal(out, reference(g, u))
    out.sum().backward()
    a_ref = g.clone().requires_grad_()
    reference(a_ref, u).sum().backward()
    assert torch.equal(a.grad, a_ref.grad)
    assert torch.equal(act(g.double(), u.double(), native=True), reference(g.double(), u.double()))
    if hidden_act == "situ":
        uncapped = gated_activation(dataclasses.replace(cfg, activation_situ_linear_beta=None))
        assert torch.equal(uncapped(g, u, native=True), situ(g, u, beta=4.0, linear_beta=None))


def test_a_model_asks_for_native_activations_in_every_mlp_and_expert():
    """`set_native_activations`: off by default (a frozen copy of a model gives its numbers), on in every
    MLP and routed expert when asked, and a dense MLP then gives the native activation's values."""
    torch.manual_seed(0)
    # random weights (K3ForCausalLM(cfg) leaves them unset: their values, and so the test, depended on memory)
    model = K3ForCausalLM.from_config(dataclasses.replace(K3Config.preset("tiny"), hidden_act="situ")).eval()
    modules = [m for m in model.modules() if isinstance(m, MLP | RoutedExpert)]
    assert any(isinstance(m, RoutedExpert) for m in modules) and any(isinstance(m, MLP) for m in modules)
    assert not any(m.native_activation for m in modules)
    mlp = next(m for m in modules if isinstance(m, MLP))
    x = torch.randn(5, mlp.gate_proj.in_features) * 3
    with torch.no_grad():
        default = mlp(x)
        model.set_native_activations(True)
        assert all(m.native_activation for m in modules)
        asked = mlp(x)
        g, u = mlp.gate_proj(x), mlp.up_proj(x)
        want = mlp.down_proj(load_native().gated_activation(g, u, 1, 4.0, 25.0))
        model.set_native_activations(False)
        assert torch.equal(mlp(x), default)
    assert torch.equal(asked, want) and not torch.equal(asked, default)
