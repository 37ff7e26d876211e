"""The gated activations of the MLPs and experts: `act(gate, up)`.

* SiLU-GLU (Kimi Linear): `silu(g) * u`
* SiTU (K3, a soft-capped SwiGLU): `b*tanh(g/b)*sigmoid(g) * c*tanh(u/c)`, b = activation_situ_beta,
  c = activation_situ_linear_beta: both factors are bounded, by b and c. `activation_situ_linear_beta: null`
  leaves the up projection uncapped (`... * u`), as the release's SiTU reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from k3.config import K3Config

GatedActivation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def situ(
    gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0
) -> torch.Tensor:
    capped = up if linear_beta is None else linear_beta * torch.tanh(up / linear_beta)
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * capped


def situ_parameters(cfg: K3Config) -> tuple[float, float | None] | None:
    """(beta, linear_beta) of SiTU, or None for SiLU-GLU: the activation as the native kernels take it
    (linear_beta None: uncapped, which they do not implement: callers take the torch path)."""
    return (cfg.activation_situ_beta, cfg.activation_situ_linear_beta) if cfg.hidden_act == "situ" else None


def gated_activation(cfg: K3Config) -> GatedActivation:
    """The config's `hidden_act` as a function of (gate, up)."""
    if cfg.hidden_act == "situ":
        return partial(situ, beta=cfg.activation_situ_beta, linear_beta=cfg.activation_situ_linear_beta)
    return silu_glu
