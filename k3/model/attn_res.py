"""Block Attention Residuals (AttnRes): the residual stream as finished blocks plus a partial sum.

Each read site (before the mixer, before the FFN, before the output) mixes `[blocks..., partial]`:
`read(v) = sum_i p_i v_i`, `p = softmax_i(<rms(v_i, 1), w>)` with `w = res_norm.weight * res_proj.weight`.
Layer l (0-indexed), from the spec:

    x = partial if no blocks yet else read(partial, blocks, w_attn[l])
    if l % attn_res_block_size == 0: blocks.append(partial); partial = None
    partial = mixer_l(rms(x, input_layernorm)) (+ partial)
    y = read(partial, blocks, w_mlp[l])
    partial = partial + ffn_l(rms(y, post_attention_layernorm))

Without `attn_res_block_size` (Kimi Linear) no block is ever closed and every read returns `partial`:
the plain pre-norm residual stream.
"""

from __future__ import annotations

import torch

from k3.model.norm import Linear, RMSNorm


def attn_res_read(values: list[torch.Tensor], norm: RMSNorm, proj: Linear) -> torch.Tensor:
    """sum_i p_i v_i over values [B, T, H] each, p = softmax_i(<rms(v_i, 1), norm.weight * proj.weight>).

    `<rms(v, 1), w>` is computed as `<v, w> / sqrt(mean(v^2) + eps)`: no normalised copy of v, no stack.
    """
    w = norm.weight.float() * proj.weight[0].float()  # [H]
    logits = torch.stack(
        [(v.float() @ w) * torch.rsqrt(v.float().pow(2).mean(-1) + norm.eps) for v in values]
    )  # [N, B, T]
    p = logits.softmax(dim=0).to(values[0].dtype)
    out = p[0, ..., None] * values[0]
    for p_i, v in zip(p[1:], values[1:], strict=True):
        out = out + p_i[..., None] * v
    return out


class ResidualStream:
    """The residual state of one forward pass: `blocks` (finished) and `partial` (the open block)."""

    def __init__(self, embeddings: torch.Tensor, block_size: int | None) -> None:
        self.block_size = block_size
        self.blocks: list[torch.Tensor] = []
        self.partial: torch.Tensor | None = embeddings

    def _values(self) -> list[torch.Tensor]:
        return self.blocks + ([self.partial] if self.partial is not None else [])

    def plain(self) -> torch.Tensor:
        """The read of a model without AttnRes: the running sum (no block is ever closed)."""
        assert not self.blocks and self.partial is not None
        return self.partial

    def read(self, norm: RMSNorm, proj: Linear) -> torch.Tensor:
        """An AttnRes read site with these weights (the open block alone while no block is finished)."""
        if not self.blocks:
            assert self.partial is not None
            return self.partial
        return attn_res_read(self._values(), norm, proj)

    def mixer_input(self, layer: int, norm: RMSNorm, proj: Linear) -> torch.Tensor:
        """The mixer's input at layer `layer`; closes the open block when a new one starts there."""
        x = self.read(norm, proj)
        if self.block_size is not None and layer % self.block_size == 0:
            assert self.partial is not None
            self.blocks.append(self.partial)
            self.partial = None
        return x

    def add(self, update: torch.Tensor) -> None:
        self.partial = update if self.partial is None else self.partial + update
