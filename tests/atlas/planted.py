"""Small checkpoints with planted facts for the atlas tests.

`planted` holds, in the K3 naming:
* `layers.0.mlp.gate_proj.weight` BF16 with exactly 21 distinct values (k/8 for k in -10..10);
* `layers.1...experts.2.w1` MXFP4 with exactly 21 distinct values, built from codes and scales directly:
  scale 2^0 with all 16 codes, 2^1 with codes of 4 and 6, 2^2 with the code of 6 (0, +-{.5 1 1.5 2 3 4 6},
  +-{8 12}, +-24);
* experts 0 and 1 of that layer: +-1 weights, expert 1 = expert 0 with exactly a quarter of the signs flipped,
  so their cosine is exactly 1 - 2/4 = 0.5;
* `norm.weight`: all zeros.
"""

from __future__ import annotations

import torch

from k3.ops.mxfp4 import quantize_mxfp4

P = "language_model.model."
EXPERT_ROWS, EXPERT_COLS = 32, 64


def _mxfp4_21_values(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """packed [32, 32] and scale [32, 2] of a matrix with exactly 21 distinct values."""
    blocks = EXPERT_ROWS * EXPERT_COLS // 32  # 64 blocks of 32 elements
    codes = torch.empty(blocks, 32, dtype=torch.uint8)
    scales = torch.empty(blocks, dtype=torch.uint8)
    for b in range(blocks):
        kind = b % 3
        if kind == 0:  # scale 2^0, every code (0..15) at least once
            codes[b] = torch.randperm(32, generator=gen).to(torch.uint8) % 16
            scales[b] = 127
        elif kind == 1:  # scale 2^1, magnitudes 4 and 6 -> 8 and 12
            codes[b] = torch.tensor([6, 7, 14, 15], dtype=torch.uint8)[
                torch.randint(0, 4, (32,), generator=gen)
            ]
            scales[b] = 128
        else:  # scale 2^2, magnitude 6 -> 24
            codes[b] = torch.tensor([7, 15], dtype=torch.uint8)[torch.randint(0, 2, (32,), generator=gen)]
            scales[b] = 129
    codes = codes.reshape(EXPERT_ROWS, EXPERT_COLS)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), scales.reshape(EXPERT_ROWS, EXPERT_COLS // 32).contiguous()


def planted_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    t: dict[str, torch.Tensor] = {}
    t[f"{P}embed_tokens.weight"] = torch.randn(64, 16, generator=gen).bfloat16()
    values = torch.arange(-10, 11, dtype=torch.float32) / 8  # 21 values, exact in BF16
    idx = torch.cat([torch.arange(21), torch.randint(0, 21, (48 * 16 - 21,), generator=gen)])
    t[f"{P}layers.0.mlp.gate_proj.weight"] = values[idx].reshape(48, 16).bfloat16()
    t[f"{P}layers.0.self_attn.A_log"] = torch.randn(300, 7, generator=gen)  # F32
    e0 = torch.where(torch.rand(EXPERT_ROWS, EXPERT_COLS, generator=gen) < 0.5, -1.0, 1.0)
    flip = torch.zeros(EXPERT_ROWS * EXPERT_COLS, dtype=torch.bool)
    flip[torch.randperm(flip.numel(), generator=gen)[: flip.numel() // 4]] = True
    e1 = torch.where(flip.reshape(e0.shape), -e0, e0)
    q = f"{P}layers.1.block_sparse_moe."
    for e, (packed, scale) in enumerate((quantize_mxfp4(e0), quantize_mxfp4(e1), _mxfp4_21_values(gen))):
        t[f"{q}experts.{e}.w1.weight_packed"] = packed
        t[f"{q}experts.{e}.w1.weight_scale"] = scale
    t[f"{q}gate.weight"] = torch.randn(3, 16, generator=gen).bfloat16()
    t[f"{P}norm.weight"] = torch.zeros(16, dtype=torch.bfloat16)
    return t
