"""The tower and projector written from the spec loop by loop, in any dtype (float64 for checks): the
reference `k3.vision.tower` and `k3.vision.projector` are tested against. Slow; one image or clip at a
time, plain formulas: closed-form bilinear resampling, complex-number RoPE, explicit softmax attention.

`weights`: {published name: tensor} (`vision_tower.…`, `mm_projector.…`).
"""

from __future__ import annotations

import math

import torch

from k3.vision.config import VisionConfig


def bilinear(grid: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """grid [H0, W0, D] -> [h, w, D]: per axis src = (i + 0.5) * in / out - 0.5 clamped at 0,
    i0 = floor(src), i1 = min(i0 + 1, in - 1), out = (1 - frac) g[i0] + frac g[i1]; rows, then columns."""

    def axis(n_in: int, n_out: int) -> list[tuple[int, int, float]]:
        taps = []
        for i in range(n_out):
            src = max((i + 0.5) * n_in / n_out - 0.5, 0.0)
            i0 = min(int(math.floor(src)), n_in - 1)
            taps.append((i0, min(i0 + 1, n_in - 1), src - i0))
        return taps

    rows = torch.stack([(1 - f) * grid[a] + f * grid[b] for a, b, f in axis(grid.shape[0], h)])  # [h, W0, D]
    return torch.stack([(1 - f) * rows[:, a] + f * rows[:, b] for a, b, f in axis(grid.shape[1], w)], dim=1)


def time_row(k: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    half = dim // 2
    j = torch.arange(half, dtype=torch.float64)
    angle = k / 10000.0 ** (j / half)
    return torch.cat([angle.sin(), angle.cos()]).to(dtype)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, h: int, w: int, t: int) -> torch.Tensor:
    """x [t*h*w, heads, d] real -> rotated: complex slot 2j by x*f_j, slot 2j+1 by y*f_j."""
    d = x.shape[-1]
    out = torch.empty_like(x)
    for n in range(t * h * w):
        y, col = divmod(n % (h * w), w)
        for slot in range(d // 2):
            j, axis = divmod(slot, 2)
            f = 10000.0 ** (-4.0 * j / d)
            pos = col if axis == 0 else y
            z = torch.complex(x[n, :, 2 * slot], x[n, :, 2 * slot + 1]) * complex(
                math.cos(pos * f), math.sin(pos * f)
            )
            out[n, :, 2 * slot], out[n, :, 2 * slot + 1] = z.real, z.imag
    return out


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def item_features(
    weights: dict[str, torch.Tensor], cfg: VisionConfig, patches: torch.Tensor, grid: tuple[int, int, int]
) -> torch.Tensor:
    """One image or clip: patches [t*h*w, 3, P, P] -> projected rows [(h/2)*(w/2), text hidden]."""
    W = {k: v.to(patches.dtype) for k, v in weights.items()}
    t, h, w = grid
    D, heads, d, eps = cfg.vt_hidden_size, cfg.vt_num_attention_heads, cfg.head_dim, cfg.vt_rms_norm_eps
    conv = W["vision_tower.patch_embed.proj.weight"]  # [D, 3, P, P]
    x = torch.einsum("ncij,dcij->nd", patches, conv)
    pos = bilinear(W["vision_tower.patch_embed.pos_emb.weight"], h, w).reshape(h * w, D)
    x = x + torch.cat([pos + (time_row(k, D, x.dtype) if t > 1 else 0) for k in range(t)])
    for i in range(cfg.vt_num_hidden_layers):
        b = f"vision_tower.encoder.blocks.{i}."
        qkv = rms(x, W[b + "norm0.weight"], eps) @ W[b + "wqkv.weight"].T
        q, k, v = qkv.reshape(-1, 3, heads, d).unbind(1)
        q, k = rope(q, h, w, t), rope(k, h, w, t)
        scores = torch.einsum("nhd,mhd->hnm", q, k) / math.sqrt(d)
        probs = torch.exp(scores - scores.amax(-1, keepdim=True))
        probs = probs / probs.sum(-1, keepdim=True)
        x = x + torch.einsum("hnm,mhd->nhd", probs, v).reshape(-1, heads * d) @ W[b + "wo.weight"].T
        hidden = gelu_tanh(rms(x, W[b + "norm1.weight"], eps) @ W[b + "mlp.fc0.weight"].T)
        x = x + hidden @ W[b + "mlp.fc1.weight"].T
    x = rms(x, W["vision_tower.encoder.final_layernorm.weight"], eps).reshape(t, h, w, D)
    tokens = []
    for ty in range(h // 2):
        for tx in range(w // 2):
            subs = [x[:, 2 * ty + dy, 2 * tx + dx].mean(0) for dy in (0, 1) for dx in (0, 1)]
            tokens.append(torch.cat(subs))
    z = torch.stack(tokens)  # [M, 4*D]
    z = gelu_erf(z @ W["mm_projector.proj.0.weight"].T) @ W["mm_projector.proj.2.weight"].T
    return rms(z, W["mm_projector.post_norm.weight"], cfg.projector_ln_eps)
