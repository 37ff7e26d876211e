"""Ordinary loading for inference: `from_pretrained` weights need no gradient (so `model(ids)` outside
`no_grad` records no graph and keeps no weight copies); training asks for them explicitly."""

from __future__ import annotations

import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM


def test_from_pretrained_weights_need_no_gradient(checkpoints):
    model = K3ForCausalLM.from_pretrained(checkpoints("tiny"))
    assert not any(p.requires_grad for p in model.parameters())
    logits = model(torch.tensor([[1, 2, 3]]))  # no torch.no_grad(): still no graph
    assert not logits.requires_grad and logits.grad_fn is None


def test_training_asks_for_gradients(checkpoints):
    trainable = K3ForCausalLM.from_pretrained(checkpoints("tiny"), requires_grad=True)
    floating = [p for p in trainable.parameters() if p.is_floating_point()]
    assert floating and all(p.requires_grad for p in floating)
    trainable(torch.tensor([[1, 2, 3]])).sum().backward()
    assert trainable.lm_head.weight.grad is not None
    fresh = K3ForCausalLM.from_config(K3Config.preset("tiny"), quantized_experts=False)  # what k3/train uses
    assert all(p.requires_grad for p in fresh.parameters())
