"""The MoonViT3d tower (spec sections 4.2-4.6): patch embedding + position grid, pre-norm encoder blocks
with 2D RoPE and attention inside each image or clip, a final RMSNorm, then the sd2_tpool merge (2x2
groups, averaged over the frames of a clip).

Module and parameter names are the published ones under `vision_tower.` (`patch_embed.proj.weight`,
`encoder.blocks.N.wqkv.weight`, ...). Computation runs in the weights' dtype: fp32 by default; with BF16
weights it follows the reference (linear layers in BF16, RMSNorm, RoPE and softmax in fp32, cast back).
`k3.vision.naive` is the same forward written loop by loop, to check this one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.vision.config import VisionConfig
from k3.vision.position import PositionGrid, apply_rope, rope_angles

Grids = list[tuple[int, int, int]]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, in fp32, returned in x's dtype (ATen's rule)."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Linear(nn.Module):
    """A bias-free linear layer whose weight [out, in] is the published tensor."""

    def __init__(self, inp: int, out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out, inp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class PatchEmbed(nn.Module):
    """Conv2d(3 -> D, kernel = stride = patch) on each patch, as one matmul: [N, 3*P*P] @ W[D, 3*P*P]^T
    (the 3*P*P axis in (channel, row, column) order), plus the position grid."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        D, P = cfg.vt_hidden_size, cfg.patch_size
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.zeros(D, 3, P, P))
        self.pos_emb = PositionGrid(cfg.init_pos_emb_height, cfg.init_pos_emb_width, cfg.init_pos_emb_time, D)

    def forward(self, pixels: torch.Tensor, grids: Grids) -> torch.Tensor:
        """pixels [N, 3, P, P] -> [N, D]."""
        w = self.proj.weight
        x = pixels.reshape(pixels.shape[0], -1).to(w.dtype) @ w.reshape(w.shape[0], -1).T
        return self.pos_emb(x, grids)


class MLP(nn.Module):
    """fc1(gelu_tanh(fc0(x)))."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc0, self.fc1 = Linear(dim, hidden), Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class EncoderBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        D, Q = cfg.vt_hidden_size, cfg.qkv_hidden_size
        self.heads, self.head_dim = cfg.vt_num_attention_heads, cfg.head_dim
        self.norm0 = RMSNorm(D, cfg.vt_rms_norm_eps)
        self.norm1 = RMSNorm(D, cfg.vt_rms_norm_eps)
        self.wqkv = Linear(D, 3 * Q)  # rows: q, k, v blocks of Q; heads contiguous inside each
        self.wo = Linear(Q, D)
        self.mlp = MLP(D, cfg.vt_intermediate_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        """x [L, D]; cos, sin [L, head_dim/2]; lengths: tokens of each image or clip (sum = L)."""
        qkv = self.wqkv(self.norm0(x)).unflatten(-1, (3, self.heads, self.head_dim))  # [L, 3, heads, d]
        q, k, v = qkv.unbind(1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        x = x + self.wo(segment_attention(q, k, v, lengths))
        return x + self.mlp(self.norm1(x))


EAGER_SCORES_BYTES = 1 << 30  # bf16: explicit scores (as the reference) while [heads, n, n] fp32 fits


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Bidirectional attention inside each segment (block-diagonal): q, k, v [L, heads, d] -> [L, heads*d];
    no token sees another image or clip. fp32: one SDPA call per segment (scale 1/sqrt(d); 4-D inputs, so
    that CPU torch runs its flash kernel and no [n, n] scores exist). bf16: as the reference, q k^T and
    p v in bf16, softmax in fp32 (SDPA for segments whose scores would pass EAGER_SCORES_BYTES)."""
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))  # [heads, n, d]
        if q.dtype == torch.bfloat16 and q.shape[1] * n * n * 4 <= EAGER_SCORES_BYTES:
            scores = (qs @ ks.transpose(1, 2)) * qs.shape[-1] ** -0.5  # [heads, n, n] bf16
            o = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ vs
        else:  # 4-D: torch's CPU flash kernel, O(n) memory; 3-D inputs take the math path ([heads, n, n])
            o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None])[0]
        out.append(o.transpose(0, 1).flatten(1))
        start += n
    return torch.cat(out)


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.blocks = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.vt_num_hidden_layers))
        self.final_layernorm = RMSNorm(cfg.vt_hidden_size, cfg.vt_rms_norm_eps)

    def forward(self, x: torch.Tensor, grids: Grids) -> torch.Tensor:
        angles = rope_angles(self.head_dim, grids).to(x.device)  # [L, d/2], fp32
        cos, sin = angles.cos(), angles.sin()
        lengths = [t * h * w for t, h, w in grids]
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.final_layernorm(x)


def tpool_merge(x: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """x [sum t*h*w, D] -> per item [(h/2)*(w/2), 4, D]: tokens row-major over (h/2, w/2), a token's four
    sub-vectors in (dy, dx) order (top-left, top-right, bottom-left, bottom-right), mean over the t frames."""
    out, start = [], 0
    D = x.shape[-1]
    for t, h, w in grids:
        if h % 2 or w % 2:
            raise ValueError(f"a grid of {h} x {w} patches: the 2x2 merge needs even sides")
        seq = x[start : start + t * h * w].view(t, h // 2, 2, w // 2, 2, D)
        merged = seq.permute(0, 1, 3, 2, 4, 5).mean(dim=0)  # [h/2, w/2, 2, 2, D]
        out.append(merged.reshape((h // 2) * (w // 2), 4, D))
        start += t * h * w
    return out


class VisionTower(nn.Module):
    """`vision_tower`: patches [N, 3, P, P] of every item, and their grids -> merged tokens per item,
    each [(h/2)*(w/2), 4, D]."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = Encoder(cfg)

    def forward(self, pixels: torch.Tensor, grids: Grids) -> list[torch.Tensor]:
        grids = [tuple(int(v) for v in g) for g in grids]
        if pixels.shape[0] != sum(t * h * w for t, h, w in grids):
            raise ValueError(f"{pixels.shape[0]} patches for grids {grids}")
        x = self.encoder(self.patch_embed(pixels, grids), grids)
        return tpool_merge(x, grids)
