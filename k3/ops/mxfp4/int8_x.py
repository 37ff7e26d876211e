"""x rounded to int8 per block of 32: the approximate mode of the MXFP4 matmul (``int8_inputs=True``).

The exact path turns every weight into an fp32 value; where a CPU's vector units are narrow (AVX2 on AMD
Zen 1 splits each 256-bit operation in two) that decoding, not the memory, bounds the few-row GEMV. In this
mode ``x`` is rounded once per block of 32 values, as llama.cpp's Q8_0 does (the block's scale kept in fp32),
and the native kernel multiplies weight bytes by int8 codes with ``vpmaddubsw`` (``_native_int8.h``). The
result is ``W`` times the rounded ``x`` (:func:`round_int8_blocks`): exact integer sums per block, scaled and
summed in fp32; its distance from ``x @ W^T`` is at most :func:`rounding_bound`.

It is a mode to choose, never a default: k3's logits stay exact unless asked otherwise.
"""

from __future__ import annotations

import torch

from k3.ops.mxfp4.codec import BLOCK_SIZE, dequantize_mxfp4

LEVELS = 127.0
"""x codes are integers in [-LEVELS, LEVELS]."""


def quantize_int8_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] fp32 -> codes int8 [..., K] and scales fp32 [..., K/32], per block of 32 along K.

    ``scale = max|x| / 127``, ``code = round_half_even(x * (127 / max|x|))``, all in fp32 (the kernel's own
    arithmetic); a zero block has scale 0, a block holding an inf or NaN codes 0 and a NaN scale.
    """
    if x.dtype != torch.float32 or x.shape[-1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"x must be float32 [..., K], K a multiple of {BLOCK_SIZE}; got {x.dtype} {list(x.shape)}"
        )
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)  # [..., K/32, 32]
    amax = blocks.abs().amax(-1)  # [..., K/32]
    finite = torch.isfinite(blocks).all(-1)
    usable = finite & (amax > 0)
    inverse = torch.where(usable, LEVELS / torch.where(usable, amax, 1.0), 0.0)
    codes = torch.round(blocks * inverse[..., None]).clamp(-LEVELS, LEVELS)
    codes = torch.where(usable[..., None], codes, 0.0).to(torch.int8).reshape(x.shape)
    scales = torch.where(finite, amax / LEVELS, torch.nan)
    return codes, scales


def round_int8_blocks(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The x [..., K] that the int8 mode multiplies: each code times its block's scale, in `dtype`."""
    codes, scales = quantize_int8_blocks(x)
    blocks = codes.reshape(*codes.shape[:-1], codes.shape[-1] // BLOCK_SIZE, BLOCK_SIZE).to(dtype)
    return (blocks * scales.to(dtype)[..., None]).reshape(codes.shape)


def rounding_bound(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[..., N] float64: sum_k |W[n, k]| * scale_x(block of k) / 2, the most rounding x moves each output."""
    _, scales = quantize_int8_blocks(x)
    half_step = scales.double().repeat_interleave(BLOCK_SIZE, dim=-1) / 2  # [..., K]
    return half_step @ dequantize_mxfp4(packed, scale).double().abs().t()
