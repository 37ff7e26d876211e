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

from k3.model.norm import NATIVE_WEIGHT_DTYPES, Linear, RMSNorm, as_dtype, parameter
from k3.ops.decode.native import load_native


def attn_res_read(values: list[torch.Tensor], norm: RMSNorm, proj: Linear) -> torch.Tensor:
    """sum_i p_i v_i over values [B, T, H] each, p = softmax_i(<rms(v_i, 1), norm.weight * proj.weight>).

    `<rms(v, 1), w>` is computed as `<v, w> / sqrt(mean(v^2) + eps)`: no normalised copy of v, no stack.
    """
    w = as_dtype(norm.weight, torch.float32) * as_dtype(proj.weight[0], torch.float32)  # [H]
    floats = [as_dtype(v, torch.float32) for v in values]
    logits = torch.stack([(v @ w) * torch.rsqrt(v.pow(2).mean(-1) + norm.eps) for v in floats])  # [N, B, T]
    p = as_dtype(logits.softmax(dim=0), values[0].dtype)
    out = p[0, ..., None] * values[0]
    for p_i, v in zip(p[1:], values[1:], strict=True):
        out = out + p_i[..., None] * v
    return out


def attn_res_read_stacked(values: list[torch.Tensor], norm: RMSNorm, proj: Linear) -> torch.Tensor:
    """`attn_res_read` on the values stacked into one tensor: a dozen ops whatever their number (the same
    arithmetic but for the order of the final sum; used for decode steps, where ops cost more than math)."""
    w = as_dtype(norm.weight, torch.float32) * as_dtype(proj.weight[0], torch.float32)  # [H]
    stacked = torch.stack(values)  # [N, B, T, H]
    floats = as_dtype(stacked, torch.float32)
    logits = (floats @ w) * torch.rsqrt(floats.pow(2).mean(-1) + norm.eps)  # [N, B, T]
    p = as_dtype(logits.softmax(dim=0), values[0].dtype)
    return (p[..., None] * stacked).sum(0)


def attn_res_read_native(values: list[torch.Tensor], norm: RMSNorm, proj: Linear) -> torch.Tensor | None:
    """`attn_res_read` in one native call (k3.ops.decode) when no gradient is recorded and the values are
    fp32 on the CPU (the two weight vectors fp32 or BF16, as a checkpoint stores them); None otherwise."""
    if torch.is_grad_enabled() or any(v.dtype != torch.float32 or not v.is_cpu for v in values):
        return None
    weights = native_read_weights(norm, proj)
    native = None if weights is None else load_native()
    if native is None:
        return None
    return native.attn_res_read([v.contiguous() for v in values], *weights)


def native_read_weights(norm: RMSNorm, proj: Linear) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """A read site's (norm weight [H], projection weight [1, H], eps) as the native read takes them (fp32),
    or None when the weights are in a dtype the kernels do not read."""
    weights = (parameter(norm, "weight"), parameter(proj, "weight"))  # read once each (a decode step has 18)
    if any(w.dtype not in NATIVE_WEIGHT_DTYPES or not w.is_cpu for w in weights):
        return None
    norm_w, proj_w = (as_dtype(w, torch.float32) for w in weights)  # a few kB
    return norm_w, proj_w, norm.eps


class ResidualStream:
    """The residual state of one forward pass: `blocks` (finished) and `partial` (the open block).

    `stacked`: reads through `attn_res_read_native` or `attn_res_read_stacked` (fewer ops; decode steps)."""

    def __init__(self, embeddings: torch.Tensor, block_size: int | None, stacked: bool = False) -> None:
        self.block_size = block_size
        self.stacked = stacked
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
        if not self.stacked:
            return attn_res_read(self._values(), norm, proj)
        fused = attn_res_read_native(self._values(), norm, proj)
        return attn_res_read_stacked(self._values(), norm, proj) if fused is None else fused

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
