"""The fused decode path (one native call for a KDA step, one for the MoE of a token) equals the general one.

References: the torch forms of the same ops (k3.ops.kda.decode / k3.ops.mxfp4.experts, built from the
model's own modules and `recurrent_kda_step`), the model's general path (`set_fast_decode(False)`), and
one full forward over the same ids. Bitwise where the arithmetic is the same (the torch fallbacks),
else 1e-5 relative to the largest logit.
"""

from __future__ import annotations

import os

import pytest
import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.model.model import K3Model
from k3.model.moe import MoE
from k3.ops.kda.decode import kda_decode_step, kda_decode_step_torch
from k3.ops.kda.native import load_native as load_kda
from k3.ops.mxfp4 import MXFP4Linear
from k3.ops.mxfp4.experts import experts_one_token, experts_one_token_torch
from k3.ops.mxfp4.native import load_native as load_mxfp4

# k3 compiles its kernels on first use: outside CI a machine without a compiler skips; CI must have them
needs_native = pytest.mark.skipif(
    (load_kda() is None or load_mxfp4() is None) and os.environ.get("CI") != "true",
    reason="native kernels unavailable (see `k3 doctor`)",
)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def plain(weight: torch.Tensor) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data.copy_(weight)
    return linear


@needs_native
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("situ", [None, (4.0, 25.0)])
def test_native_experts_of_one_token_equal_torch(situ, packed):
    L, m, k = 256, 128, 4
    shapes = [(m, L), (m, L), (L, m)]
    make = MXFP4Linear.from_float if packed else plain
    experts = [
        tuple(make(torch.randn(o, i, generator=gen(10 * j + n)) * 0.2) for n, (o, i) in enumerate(shapes))
        for j in range(k)
    ]
    z = torch.randn(1, L, generator=gen(99))
    weights = torch.rand(k, generator=gen(98))
    expected = experts_one_token_torch(z, experts, weights, situ)
    calls = []
    native = load_mxfp4()
    name = "experts_one_token" if packed else "experts_one_token_dense"
    count = lambda self, *a, **kw: calls.append(1) or getattr(native, name)(*a, **kw)  # noqa: E731
    counting = type("Counting", (), {name: count})()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("k3.ops.mxfp4.experts.load_native", lambda: counting)
        out = experts_one_token(z, experts, weights, situ)
    assert calls == [1]  # one native call for the k experts
    assert rel(out, expected) <= 1e-5
    assert expected.abs().max() > 0.1  # not trivially zero


@needs_native
@pytest.mark.parametrize("B", [1, 3])
def test_native_kda_decode_step_equals_torch(B):
    H, K, ks = 4, 64, 4
    P = H * K
    x = tuple(torch.randn(B, P, generator=gen(i)) for i in range(3))
    tails = tuple(torch.randn(B, ks - 1, P, generator=gen(10 + i)) for i in range(3))
    weights = tuple(torch.randn(P, ks, generator=gen(20 + i)) for i in range(3))
    g = -torch.rand(B, H, K, generator=gen(30)) * 2
    beta = torch.rand(B, H, generator=gen(31))
    state = torch.randn(B, H, K, K, generator=gen(32))
    before = state.clone()
    native, calls = load_kda(), []
    counting = type(
        "Counting", (), {"decode_step": lambda self, *a: calls.append(1) or native.decode_step(*a)}
    )()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("k3.ops.kda.decode.load_native", lambda: counting)
        o, new_tails, new_state = kda_decode_step(x, tails, weights, g, beta, state)
    assert calls == [1]  # the native kernel ran
    o_ref, tails_ref, state_ref = kda_decode_step_torch(x, tails, weights, g, beta, state)
    assert rel(o, o_ref) <= 1e-5 and rel(new_state, state_ref) <= 1e-5
    assert all(torch.equal(a, b) for a, b in zip(new_tails, tails_ref, strict=True))  # copies of inputs
    assert torch.equal(state, before)  # the input state is not modified


@torch.no_grad()
def decode_logits(model: K3ForCausalLM, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits of a prefill of `prefill` tokens, then one decode step per remaining token."""
    cache = model.new_cache(ids.shape[0])
    steps = [model(ids[:, :prefill], cache)]
    steps += [model(ids[:, t : t + 1], cache) for t in range(prefill, ids.shape[1])]
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("preset", ["tiny", "mini"])
@pytest.mark.parametrize("quantized", [None, False])
def test_fast_decode_equals_general_path_and_full_forward(preset, quantized):
    cfg = K3Config.preset(preset)
    # mini: its first 5 layers (KDA, MLA at 3, dense and MoE FFNs, an AttnRes block closed at 3)
    model = K3ForCausalLM.from_config(cfg, seed=3, quantized_experts=quantized, num_layers=5)
    ids = torch.randint(0, cfg.vocab_size, (1, 24), generator=gen(5))
    fast = decode_logits(model.set_fast_decode(True), ids, 16)
    general = decode_logits(model.set_fast_decode(False), ids, 16)
    model.set_fast_decode(True)
    with torch.no_grad():
        full = model(ids)
    assert rel(fast[:, :16], general[:, :16]) <= 1e-5  # the prefill's experts: one native call or one by one
    assert rel(fast, general) <= 1e-5
    assert rel(fast, full) <= 1e-4  # chunked vs recurrent KDA, as tests/model/test_cache.py allows
    assert rel(general, full) <= 1e-4


def test_fast_decode_of_a_batch_and_without_native_kernels(monkeypatch):
    """B = 2 (KDA fused per row, MoE through the general dispatch); the KDA torch fallback is bitwise."""
    cfg = K3Config.preset("tiny")
    model = K3ForCausalLM.from_config(cfg, seed=4)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=gen(6))
    general = decode_logits(model.set_fast_decode(False), ids, 8)
    fast = decode_logits(model.set_fast_decode(True), ids, 8)
    assert rel(fast, general) <= 1e-5
    monkeypatch.setattr("k3.ops.kda.decode.load_native", lambda: None)
    for module in model.modules():  # the fused KDA step in torch; MoE and AttnRes reads: general
        if isinstance(module, MoE | K3Model):
            module.fast_decode = False
    assert torch.equal(decode_logits(model, ids, 8), general)  # same arithmetic, op for op
    monkeypatch.setattr("k3.ops.mxfp4.experts.load_native", lambda: None)
    model.set_fast_decode(True)
    assert rel(decode_logits(model, ids[:1], 8), general[:1]) <= 1e-5


def test_a_one_token_forward_with_gradients_takes_the_general_path():
    """The one-token expert call has no backward: with grad enabled, the experts' and the router's
    gradients of a [1, 1] forward must be those of the general path (they were silently missing)."""
    model = K3ForCausalLM.from_config(K3Config.preset("tiny"), seed=0, quantized_experts=False)
    ids = torch.tensor([[5]])

    def grads(fast: bool) -> dict[str, torch.Tensor]:
        model.set_fast_decode(fast).zero_grad(set_to_none=True)
        model(ids).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    fast, general = grads(True), grads(False)
    assert any(".experts." in name for name in general) and any(".gate." in name for name in general)
    assert fast.keys() == general.keys()
    # the stacked AttnRes read of one-token forwards rounds differently: not bitwise, relative to the
    # largest gradient (a single MLA query's q gradients are rounding noise near 0)
    scale = max(float(g.abs().max()) for g in general.values())
    for name in general:
        assert (fast[name] - general[name]).abs().max() <= 1e-5 * scale, name


def test_a_cached_one_token_step_with_gradients_takes_the_general_kda_path():
    """The native KDA decode step has no backward either: a one-token step that continues a cache with
    grad enabled must give the KDA projections the gradients of the general path (they were missing)."""
    model = K3ForCausalLM.from_config(K3Config.preset("tiny"), seed=0, quantized_experts=False)

    def grads(fast: bool) -> dict[str, torch.Tensor]:
        model.set_fast_decode(fast).zero_grad(set_to_none=True)
        cache = model.new_cache(1)
        with torch.no_grad():
            model(torch.tensor([[3, 4, 5]]), cache)
        model(torch.tensor([[6]]), cache).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    fast, general = grads(True), grads(False)
    assert any("self_attn.q_proj" in name for name in general)
    assert fast.keys() == general.keys()
    scale = max(float(g.abs().max()) for g in general.values())
    for name in general:
        assert (fast[name] - general[name]).abs().max() <= 1e-5 * scale, name
