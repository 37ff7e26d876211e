"""The dense MLP (first layer, shared experts): `down(act(gate(x), up(x)))`."""

from __future__ import annotations

import torch
from torch import nn

from k3.config import K3Config
from k3.model.activations import gated_activation, situ_parameters
from k3.model.norm import Linear


class MLP(nn.Module):
    def __init__(self, cfg: K3Config, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size)
        self.up_proj = Linear(hidden_size, intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)
        self.act = gated_activation(cfg)
        self.situ = situ_parameters(cfg)  # the activation's parameters for the native kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))
