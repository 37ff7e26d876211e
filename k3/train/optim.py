"""The optimizers `k3 train` offers: AdamW, or Muon for the hidden matrices with AdamW for the rest.

Muon (torch.optim.Muon: Nesterov momentum orthogonalised by Newton-Schulz) takes every 2-D weight of the
hidden layers, experts and routers included, with Moonshot's learning-rate adjustment ("match_rms_adamw":
the update's RMS matches AdamW's, so the same learning rate and weight decay carry over). The embedding
and the output head are matrices too but not hidden ones, and stay with AdamW, as do vectors, norms and
the 3-D convolution kernels. Weight decay applies to matrices only, in both optimizers.

`OptimizerPair` steps the two as one optimizer, with one `param_groups` list for the schedule and one
`state_dict` in torch's format (parameters numbered across both), so checkpoints (k3.train.state) stay
the same for either choice.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from k3.train.config import Optimizer

OPTIMIZERS = tuple(Optimizer)
NOT_HIDDEN = ("embed_tokens", "lm_head")  # matrices that Muon leaves to AdamW


def _adamw(params: list[dict], betas: tuple[float, float]) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, betas=betas, foreach=False)


def build_optimizer(
    model: nn.Module, name: str, lr: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.Optimizer | OptimizerPair:
    """The optimizer called `name` (one of OPTIMIZERS) over the trainable parameters of `model`."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r} (known: {', '.join(OPTIMIZERS)})")
    matrices, hidden, rest = [], [], []
    for param_name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.dim() != 2:
            rest.append(p)
        elif name == "muon" and not any(part in param_name for part in NOT_HIDDEN):
            hidden.append(p)
        else:
            matrices.append(p)
    adamw_groups = [
        {"params": matrices, "weight_decay": weight_decay, "lr": lr},
        {"params": rest, "weight_decay": 0.0, "lr": lr},
    ]
    if name == "adamw":
        return _adamw(adamw_groups, betas)
    muon = torch.optim.Muon(hidden, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
    return OptimizerPair(muon, _adamw(adamw_groups, betas))


class OptimizerPair:
    """Two optimizers over disjoint parameters, stepped, scheduled and checkpointed as one."""

    def __init__(self, first: torch.optim.Optimizer, second: torch.optim.Optimizer) -> None:
        self.parts = (first, second)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for part in self.parts for group in part.param_groups]

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """torch's format: parameters numbered 0.. across both parts, the first part's first."""
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for part in self.parts:
            own = part.state_dict()
            state.update({offset + index: entries for index, entries in own["state"].items()})
            for group in own["param_groups"]:
                groups.append({**group, "params": [offset + index for index in group["params"]]})
            offset += sum(len(group["params"]) for group in own["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = iter(state_dict["param_groups"])
        offset = 0
        for part in self.parts:
            own_groups = [next(groups) for _ in part.param_groups]
            count = sum(len(group["params"]) for group in own_groups)
            part.load_state_dict(
                {
                    "state": {
                        index - offset: entries
                        for index, entries in state_dict["state"].items()
                        if offset <= int(index) < offset + count
                    },
                    "param_groups": [
                        {**group, "params": [index - offset for index in group["params"]]}
                        for group in own_groups
                    ],
                }
            )
            offset += count
