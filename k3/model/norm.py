"""RMSNorm and the Linear layer every model module uses.

Both compute in the activation dtype (fp32 by default) whatever dtype the checkpoint stored the weight in,
so a model can keep BF16 weights in memory and still run in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)` without the op when x already has it (the same tensor either way; saves a dispatch)."""
    return x if x.dtype == dtype else x.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps) * weight` over the last dim, computed in fp32, returned in x's dtype."""
    x32 = as_dtype(x, torch.float32)
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * as_dtype(weight, torch.float32)
    return as_dtype(y, x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


CONVERT_ROWS_ELEMENTS = 1 << 24  # weights above 16 M elements are converted to the compute dtype in slices


class Linear(nn.Linear):
    """A bias-free `nn.Linear` whose weight may be stored in another dtype than the activations."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self) -> None:
        # Weights come from a checkpoint or from k3.model.init; skip nn.Linear's costly kaiming init.
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.dtype == x.dtype:
            return F.linear(x, w)
        if w.numel() <= CONVERT_ROWS_ELEMENTS:
            return F.linear(x, w.to(x.dtype))
        # a big weight in another dtype (a BF16 lm_head with fp32 compute, say): convert it a slice of
        # output rows at a time, so the converted copy never exists whole
        rows = max(1, CONVERT_ROWS_ELEMENTS // w.shape[1])
        return torch.cat(
            [F.linear(x, w[i : i + rows].to(x.dtype)) for i in range(0, w.shape[0], rows)], dim=-1
        )
