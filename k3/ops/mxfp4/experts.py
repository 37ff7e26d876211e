"""The routed experts of one token in one call: ``sum_j p_j W2_j act(W1_j z, W3_j z)``.

A decode step's MoE runs k tiny expert MLPs (mini: [128 x 256] matrices); run one torch op at a time,
dispatch costs more than the arithmetic. The native kernels (``experts_one_token`` and
``experts_one_token_dense`` in ``_native.cpp``) run the k experts, their activation and the weighted sum
in one call, on MXFP4-packed experts (``MXFP4Linear``, exact or with their ``int8_inputs``) or on plain
fp32 ones (any bias-free module with a ``weight`` [out, in]); :func:`experts_one_token_torch` is the same
in torch (the reference, and the path for other dtypes or without the native kernels).

Activations: SiLU-GLU ``silu(g) u`` (``situ=None``) or SiTU ``b tanh(g/b) sigmoid(g) c tanh(u/c)``
(``situ=(b, c)``), as k3.model.activations defines them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from k3.ops.mxfp4.matmul import MXFP4Linear
from k3.ops.mxfp4.native import load_native

Expert = tuple[nn.Module, nn.Module, nn.Module]  # (w1 gate [m, L], w3 up [m, L], w2 down [L, m]), bias-free


def _act(gate: torch.Tensor, up: torch.Tensor, situ: tuple[float, float | None] | None) -> torch.Tensor:
    if situ is None:
        return F.silu(gate) * up
    b, c = situ  # c None: the up projection uncapped
    return b * torch.tanh(gate / b) * torch.sigmoid(gate) * (up if c is None else c * torch.tanh(up / c))


def experts_one_token_torch(
    z: torch.Tensor, experts: Sequence[Expert], weights: torch.Tensor, situ: tuple[float, float] | None
) -> torch.Tensor:
    """z [1, L], the token's k experts, weights [k] -> [1, L], one torch op at a time."""
    out = torch.zeros_like(z)
    for (w1, w3, w2), p in zip(experts, weights.tolist(), strict=True):
        out += p * w2(_act(w1(z), w3(z), situ))
    return out


def _plain_fp32(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and getattr(module, "bias", None) is None
    )


def experts_one_token(
    z: torch.Tensor, experts: Sequence[Expert], weights: torch.Tensor, situ: tuple[float, float] | None
) -> torch.Tensor:
    """z [1, L], the token's k experts, weights [k] -> sum_j p_j expert_j(z) [1, L] (native where it can)."""
    native = load_native() if z.device.type == "cpu" and z.dtype == torch.float32 else None
    if situ is not None and situ[1] is None:  # an uncapped SiTU: the native kernels cap the up projection
        native = None
    matrices = [w for expert in experts for w in expert]  # (w1, w3, w2) per expert
    args = (weights.to(torch.float32).contiguous().view(-1), 0 if situ is None else 1, *(situ or (0.0, 0.0)))
    packed = all(isinstance(w, MXFP4Linear) and w.bias is None for w in matrices)
    int8 = {w.int8_inputs for w in matrices} if packed else set()  # one mode for all, or each its own forward
    if native is not None and packed and len(int8) == 1:
        scales = [w.weight_scale for w in matrices]
        return native.experts_one_token(
            z.contiguous(), [w.weight_packed for w in matrices], scales, *args, int8_x=int8.pop()
        )
    if native is not None and all(_plain_fp32(w) for w in matrices):
        return native.experts_one_token_dense(
            z.contiguous(), [w.weight.contiguous() for w in matrices], *args
        )
    return experts_one_token_torch(z, experts, weights, situ)
