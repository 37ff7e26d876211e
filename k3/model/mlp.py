"""The dense MLP (first layer, shared experts): `down(act(gate(x), up(x)))`."""

from __future__ import annotations

import torch
from torch import nn

from k3.config import K3Config
from k3.model.activations import gated_activation, situ_parameters
from k3.model.norm import Linear
from k3.ops.mxfp4 import MXFP4Linear


class MLP(nn.Module):
    def __init__(self, cfg: K3Config, hidden_size: int, intermediate_size: int, packed: bool = False) -> None:
        super().__init__()
        linear = MXFP4Linear if packed else Linear  # packed: MXFP4 weights (a checkpoint's shared experts)
        self.gate_proj = linear(hidden_size, intermediate_size)
        self.up_proj = linear(hidden_size, intermediate_size)
        self.down_proj = linear(intermediate_size, hidden_size)
        self.act = gated_activation(cfg)
        self.situ = situ_parameters(cfg)  # the activation's parameters for the native kernels
        self.native_activation = False  # K3ForCausalLM.set_native_activations

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x), native=self.native_activation))
