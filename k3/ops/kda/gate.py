"""KDA forget gates: per-channel log-decay ``g`` (<= 0) from the gate projection ``f``.

- K3 (bounded): ``g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))``, so every step decays by a
  factor in (e^lower_bound, 1) (K3.md section 4; transformers' Glm5Next gate with a lower bound).
- Kimi Linear (softplus): ``g = -exp(A_log) * softplus(f + dt_bias)``, unbounded below
  (transformers' ``KimiLinearForgetGate``: dt_bias added on the flat [H*K] axis, A_log per head).

Shapes: f [..., H, K] or flat [..., H*K]; dt_bias [H*K]; A_log holds one entry per head, in any
shape with at least H entries: only the first H are used. The K3 checkpoint stores A_log padded to
128 entries (96 heads), Kimi Linear as [1, 1, H, 1]. With a padded A_log and a flat f, pass
``num_heads``: H cannot be told from the shapes. Math in fp32; g comes back fp32 in f's layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()  # no op (and no dispatch) when already fp32


def _gate_inputs(
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, num_heads: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(f + dt_bias as [..., H, K] fp32, exp(A_log[:H]) as [H, 1] fp32)``."""
    width = dt_bias.numel()
    if f.dim() == 0:
        raise ValueError("f must be [..., H, K] or [..., H*K], got a scalar")
    if f.shape[-1] == width:  # flat [..., H*K] (a last dim of H*K always reads as flat)
        H = num_heads if num_heads is not None else A_log.numel()
        if H < 1 or width % H:
            raise ValueError(f"cannot split f's last dim {width} into {H} heads; pass num_heads")
        x = (_f32(f) + _f32(dt_bias)).view(*f.shape[:-1], H, width // H)
    elif f.dim() >= 2 and f.shape[-2] * f.shape[-1] == width:  # [..., H, K]
        H = f.shape[-2]
        if num_heads is not None and num_heads != H:
            raise ValueError(f"f has {H} heads but num_heads={num_heads}")
        x = _f32(f) + _f32(dt_bias).view(H, -1)
    else:
        raise ValueError(
            f"f must be [..., H, K] or [..., H*K] with H*K = dt_bias.numel() = {width}, got {tuple(f.shape)}"
        )
    if A_log.numel() < H:
        raise ValueError(f"A_log has {A_log.numel()} entries, fewer than the {H} heads")
    rate = _f32(A_log).reshape(-1)[:H].exp().view(H, 1)
    return x, rate


def kda_gate(
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float = -5.0,
    *,
    num_heads: int | None = None,
) -> torch.Tensor:
    """K3's gate: ``g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))``, in [lower_bound, 0)."""
    if lower_bound >= 0:
        raise ValueError(f"lower_bound must be negative, got {lower_bound}")
    x, rate = _gate_inputs(f, A_log, dt_bias, num_heads)
    g = lower_bound * torch.sigmoid(rate * x)
    return g.view(*f.shape[:-1], -1) if f.shape[-1] == dt_bias.numel() else g


def kda_softplus_gate(
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *, num_heads: int | None = None
) -> torch.Tensor:
    """Kimi Linear's gate: ``g = -exp(A_log) * softplus(f + dt_bias)`` (softplus linear above 20)."""
    x, rate = _gate_inputs(f, A_log, dt_bias, num_heads)
    g = -rate * F.softplus(x, beta=1.0, threshold=20.0)
    return g.view(*f.shape[:-1], -1) if f.shape[-1] == dt_bias.numel() else g
