"""The optimizers `k3 train` offers: AdamW, or Muon for the hidden matrices with AdamW for the rest.

Muon (Nesterov momentum orthogonalised by Newton-Schulz) takes every 2-D weight of the hidden layers,
experts and routers included, with Moonshot's learning-rate adjustment ("match_rms_adamw": the update's
RMS matches AdamW's, so the same learning rate and weight decay carry over). `Muon` here is
torch.optim.Muon's algorithm, step for step (bitwise equal to it by default), with one option: the
Newton-Schulz iteration in fp32 instead of bf16 (`ns_dtype`). In bf16 the orthogonalised update is a
step function of the gradient: two gradients that differ in their last fp32 bits (summed over ranks in
another order, k3.dist) can round to different bf16 values, and five iterations amplify that to ~1e-3
of the update. In fp32 the update is as continuous as the rest of the step. The embedding
and the output head are matrices too but not hidden ones, and stay with AdamW, as do vectors, norms and
the 3-D convolution kernels. Weight decay applies to matrices only, in both optimizers.

`OptimizerPair` steps the two as one optimizer, with one `param_groups` list for the schedule and one
`state_dict` in torch's format (parameters numbered across both), so checkpoints (k3.train.state) stay
the same for either choice.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from k3.train.config import Optimizer

OPTIMIZERS = tuple(Optimizer)
NOT_HIDDEN = ("embed_tokens", "lm_head")  # matrices that Muon leaves to AdamW


def _adamw(params: list[dict], betas: tuple[float, float]) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, betas=betas, foreach=False)


def newton_schulz(
    g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz orthogonalisation of a matrix g [A, B], in `dtype`."""
    a, b, c = coefficients
    x = g.to(dtype, copy=True)  # never the caller's tensor (the momentum buffer without Nesterov)
    if g.size(0) > g.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if g.size(0) > g.size(1) else x


class Muon(torch.optim.Muon):
    """torch.optim.Muon with the Newton-Schulz iteration in `ns_dtype` (torch: bf16)."""

    def __init__(self, params, *, ns_dtype: torch.dtype = torch.bfloat16, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            lr, decay, momentum = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = newton_schulz(
                    update, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype
                )
                p.mul_(1 - lr * decay)
                p.add_(update, alpha=-_adjusted_lr(lr, group["adjust_lr_fn"], p.shape))


def _adjusted_lr(lr: float, adjust: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's learning rate for a matrix of `shape` [A, B]."""
    A, B = shape[:2]
    if adjust is None or adjust == "original":
        return lr * math.sqrt(max(1, A / B))
    if adjust == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(A, B))
    return lr


def build_optimizer(
    model: nn.Module,
    name: str,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    muon_fp32: bool = False,
) -> torch.optim.Optimizer | OptimizerPair:
    """The optimizer called `name` (one of OPTIMIZERS) over the trainable parameters of `model`
    (`muon_fp32`: Muon's Newton-Schulz iteration in fp32 rather than bf16)."""
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
    ns_dtype = torch.float32 if muon_fp32 else torch.bfloat16
    muon = Muon(hidden, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw", ns_dtype=ns_dtype)
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
