"""Where a patch is: the learnable position grid (resampled to each image's grid), the sincos time table of
clips, and the interleaved 2D RoPE of the attention (spec sections 4.3 and 4.4).

A grid (t, h, w) counts patches: t frames (1 for an image, at most `init_pos_emb_time`), h rows, w columns.
Patches are ordered frame, then row-major (y, x).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ROPE_THETA = 10000.0  # hard-coded in the reference (Rope2DPosEmbRepeated(theta_base=10000))
ROPE_MAX_SIDE = 512  # the reference's precomputed table: at most 512 x 512 patches


def resample_grid(grid: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The learnable grid [H0, W0, D] resampled bilinearly (half-pixel centres, edges clamped: PyTorch's
    align_corners=False) to [h * w, D], row-major; unchanged when (h, w) == (H0, W0)."""
    if (h, w) == tuple(grid.shape[:2]):
        return grid.flatten(0, 1)
    out = F.interpolate(grid.permute(2, 0, 1)[None], size=(h, w), mode="bilinear", align_corners=False)
    return out[0].permute(1, 2, 0).flatten(0, 1)  # [h * w, D]


def time_table(frames: int, dim: int) -> torch.Tensor:
    """[frames, dim] float32: row k = (sin(k w_j) for j < dim/2, cos(k w_j) for j < dim/2),
    w_j = 1 / 10000^(j / (dim/2)); computed in float32 as the reference's numpy code does."""
    half = dim // 2
    omega = torch.arange(half, dtype=torch.float32) / (dim / 2.0)
    omega = 1.0 / 10000.0**omega  # [dim/2]
    angles = torch.arange(frames, dtype=torch.float32)[:, None] * omega[None]  # [frames, dim/2]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class PositionGrid(nn.Module):
    """`patch_embed.pos_emb`: the learnable [H0, W0, D] grid plus the fixed time table for clips."""

    def __init__(self, height: int, width: int, frames: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(height, width, dim))
        self.frames = frames  # the time table's rows are computed when a clip needs them (no buffer)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """x [sum t*h*w, D] -> x plus each item's position embedding. Frame k of a clip (t > 1) also gets
        time row k; a single image (t == 1) gets no time row (the reference skips it)."""
        parts = []
        for t, h, w in grids:
            if not 1 <= t <= self.frames:
                raise ValueError(f"a clip of {t} frames; this tower takes 1..{self.frames}")
            pos = resample_grid(self.weight, h, w)  # [h*w, D]
            if t > 1:
                time = time_table(t, pos.shape[-1]).to(pos.device, pos.dtype)  # [t, D]
                pos = (pos[None] + time[:, None]).flatten(0, 1)  # [t*h*w, D]
            parts.append(pos)
        return x + torch.cat(parts).to(x.dtype)


def rope_frequencies(head_dim: int) -> torch.Tensor:
    """[head_dim / 4] float32: f_j = 1 / 10000^(4 j / head_dim)."""
    steps = torch.arange(0, head_dim, 4)[: head_dim // 4].float()
    return 1.0 / (ROPE_THETA ** (steps / head_dim))


def rope_angles(head_dim: int, grids: list[tuple[int, int, int]]) -> torch.Tensor:
    """[sum t*h*w, head_dim / 2] float32: the angle of each complex slot of each patch. Slot 2j turns by
    x * f_j (the column, first), slot 2j+1 by y * f_j (the row); frames of a clip repeat the table."""
    freqs = rope_frequencies(head_dim)  # [head_dim/4]
    parts = []
    for t, h, w in grids:
        if not (1 <= h <= ROPE_MAX_SIDE and 1 <= w <= ROPE_MAX_SIDE):
            raise ValueError(f"a grid of {h} x {w} patches; the 2D RoPE takes at most {ROPE_MAX_SIDE} a side")
        y, x = torch.meshgrid(torch.arange(h).float(), torch.arange(w).float(), indexing="ij")
        ax = x.reshape(-1, 1) * freqs  # [h*w, head_dim/4]
        ay = y.reshape(-1, 1) * freqs
        parts.append(torch.stack([ax, ay], dim=-1).flatten(1).repeat(t, 1))  # [t*h*w, head_dim/2]
    return torch.cat(parts)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [L, heads, d]: adjacent pairs (2k, 2k+1) as complex numbers, rotated by the slot's angle
    (cos, sin [L, d/2]); computed in float32, returned in x's dtype (the reference's rule)."""
    pairs = x.float().unflatten(-1, (-1, 2))  # [L, heads, d/2, 2]
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None], sin[:, None]  # [L, 1, d/2]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2).to(x.dtype)
