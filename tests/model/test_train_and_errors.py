"""Gradients flow through everything and a few steps lower the loss; loading errors say what is wrong."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from k3.checkpoint import save_checkpoint
from k3.config import K3Config
from k3.errors import K3Error
from k3.model import K3ForCausalLM, ModelLoadError


def test_optimiser_steps_lower_the_loss():
    torch.manual_seed(0)
    model = K3ForCausalLM.from_config(K3Config.preset("tiny"), seed=2, quantized_experts=False).train()
    ids = torch.randint(0, 1024, (2, 40), generator=torch.Generator().manual_seed(9))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def loss_fn():
        logits = model(ids)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    losses = []
    for step in range(6):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        if step == 0:  # every parameter that takes part gets a gradient, the KDA ones included
            routed = {n for n, p in model.named_parameters() if ".experts." in n}
            # layer 0 reads its mixer input before any block exists: its AttnRes vectors are never used
            unused = {
                "model.layers.0.self_attention_res_norm.weight",
                "model.layers.0.self_attention_res_proj.weight",
            }
            no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
            assert set(no_grad) <= routed | unused  # an expert no token chose has none
            assert unused <= set(no_grad) and len(set(no_grad) & routed) < len(routed)
            kda = model.model.layers[1].self_attn
            for p in (kda.A_log, kda.dt_bias, kda.q_conv1d.weight, kda.f_a_proj.weight):
                assert p.grad is not None and p.grad.abs().sum() > 0
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def _rewrite(src, dst, drop=(), add=(), reshape=()):
    def tensors():
        with safe_open(next(src.glob("*.safetensors")), "pt") as f:
            for name in f.keys():
                if name in drop:
                    continue
                t = f.get_tensor(name)
                yield name, (t[:-1] if name in reshape else t)
        for name in add:
            yield name, torch.zeros(3)

    save_checkpoint(tensors(), K3Config.preset("tiny"), dst)


def test_loading_errors_list_missing_unexpected_and_misshaped(tiny_checkpoint, tmp_path):
    p = "language_model.model.layers."
    missing = [p + "2.self_attn.A_log", p + "4.block_sparse_moe.experts.3.w1.weight_scale"]
    unexpected = [p + "1.self_attn.rope.inv_freq", "language_model.model.mystery"]
    misshaped = [p + "3.self_attn.kv_b_proj.weight"]
    _rewrite(tiny_checkpoint, tmp_path / "bad", drop=missing, add=unexpected, reshape=misshaped)
    with pytest.raises(ModelLoadError) as err:
        K3ForCausalLM.from_pretrained(tmp_path / "bad")
    message = str(err.value)
    assert isinstance(err.value, K3Error)
    for title, names in (
        ("missing (2)", missing),
        ("unexpected (2)", unexpected),
        ("mis-shaped (1)", misshaped),
    ):
        assert title in message
        assert all(n in message for n in names)
    assert f"{misshaped[0]}: [63, 32] in the checkpoint, [64, 32] expected" in message


def test_truncated_load_ignores_later_layers(tiny_checkpoint, tmp_path):
    p = "language_model.model.layers."
    _rewrite(
        tiny_checkpoint, tmp_path / "deep", drop=[p + "4.self_attn.o_proj.weight"], add=[p + "4.self_attn.x"]
    )
    model = K3ForCausalLM.from_pretrained(tmp_path / "deep", layers=3)
    assert model.num_layers == 3
    with pytest.raises(ModelLoadError, match="layers must be in 1..5"):
        K3ForCausalLM.from_pretrained(tmp_path / "deep", layers=6)
