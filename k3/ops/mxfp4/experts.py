"""The routed experts of one token in one call: ``sum_j p_j W2_j act(W1_j z, W3_j z)``, MXFP4 weights.

A decode step's MoE runs k tiny expert MLPs (mini: [128 x 256] matrices); run one torch op at a time,
dispatch costs more than the arithmetic. The native kernel (``experts_one_token`` in ``_native.cpp``)
runs the k experts, their activation and the weighted sum in one call; :func:`experts_one_token_torch`
is the same in torch (the reference, and the path without the native kernels).

Activations: SiLU-GLU ``silu(g) u`` (``situ=None``) or SiTU ``b tanh(g/b) sigmoid(g) c tanh(u/c)``
(``situ=(b, c)``), as k3.model.activations defines them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from k3.ops.mxfp4.matmul import MXFP4Linear
from k3.ops.mxfp4.native import load_native

Expert = tuple[MXFP4Linear, MXFP4Linear, MXFP4Linear]  # (w1 gate [m, L], w3 up [m, L], w2 down [L, m])


def _act(gate: torch.Tensor, up: torch.Tensor, situ: tuple[float, float] | None) -> torch.Tensor:
    if situ is None:
        return F.silu(gate) * up
    b, c = situ
    return b * torch.tanh(gate / b) * torch.sigmoid(gate) * (c * torch.tanh(up / c))


def experts_one_token_torch(
    z: torch.Tensor, experts: Sequence[Expert], weights: torch.Tensor, situ: tuple[float, float] | None
) -> torch.Tensor:
    """z [1, L], the token's k experts, weights [k] -> [1, L], one torch op at a time."""
    out = torch.zeros_like(z)
    for (w1, w3, w2), p in zip(experts, weights.tolist(), strict=True):
        out += p * w2(_act(w1(z), w3(z), situ))
    return out


def experts_one_token(
    z: torch.Tensor, experts: Sequence[Expert], weights: torch.Tensor, situ: tuple[float, float] | None
) -> torch.Tensor:
    """z [1, L] fp32, the token's k experts (MXFP4, no bias), weights [k] -> sum_j p_j expert_j(z) [1, L]."""
    native = load_native() if z.device.type == "cpu" and z.dtype == torch.float32 else None
    if native is None or any(w.bias is not None for e in experts for w in e):
        return experts_one_token_torch(z, experts, weights, situ)
    w1, w3, w2 = zip(*experts, strict=True)
    return native.experts_one_token(
        z.contiguous(),
        [w.weight_packed for w in w1],
        [w.weight_scale for w in w1],
        [w.weight_packed for w in w3],
        [w.weight_scale for w in w3],
        [w.weight_packed for w in w2],
        [w.weight_scale for w in w2],
        weights.to(torch.float32).contiguous().view(-1),
        0 if situ is None else 1,
        *(situ or (0.0, 0.0)),
    )


__all__ = ["experts_one_token", "experts_one_token_torch"]
