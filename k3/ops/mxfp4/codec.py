"""MXFP4 encoding and decoding (OCP Microscaling Formats v1.0, MXFP4 = E2M1 elements + E8M0 scales).

Layout is compressed-tensors' ``mxfp4-pack-quantized`` (``weight_packed``, ``weight_scale``):

* ``packed`` uint8 ``[..., N/2]``: element ``2j`` in the low nibble of byte ``j``, ``2j+1`` in the high one;
* ``scale`` uint8 ``[..., N/32]``: one E8M0 byte per block of 32 consecutive elements; byte ``s`` means
  ``2^(s-127)`` and 255 is NaN.

E2M1 codes 0..15 are ``+0 .5 1 1.5 2 3 4 6 -0 -.5 -1 -1.5 -2 -3 -4 -6`` (bit 3 is the sign).

Quantization rule (OCP MX v1.0, section 6.3): the shared exponent of a block is
``floor(log2(amax)) - 2`` (2 = the exponent of E2M1's largest power of two, 4), clamped to E8M0's
``[-127, 127]``; each element divided by the scale is rounded to the nearest E2M1 value, ties to the even
code, and saturated at +-6. All arithmetic is exact: the exponent comes from ``torch.frexp`` and the
division is a multiplication by an exact power of two.

An all-zero block gets scale byte 0 (``2^-127``), as in Microsoft's microxcaling reference, which floors
``log2`` of a zero block's amax as if it were the smallest normal and then clamps to E8M0's minimum. It
decodes to zeros. (compressed-tensors 0.20.0 computes ``log2(0) = -inf`` for such a block and casts it to
an integer, which is undefined behaviour, so it has no defined byte to agree with.)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

BLOCK_SIZE = 32
"""Elements sharing one E8M0 scale."""

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""Value of each 4-bit E2M1 code."""

E8M0_BIAS = 127
E8M0_NAN = 255
_MIN_EXPONENT, _MAX_EXPONENT = -127, 127  # the E8M0 range of shared exponents (byte 0..254)

# Rounding |x| / scale to an E2M1 magnitude code 0..7: the code is the number of midpoints between
# neighbouring magnitudes that the value lies above. On a tie, the even code wins: the midpoints
# 0.25, 1.25, 2.5 and 5 go down (to codes 0, 2, 4, 6), and 0.75, 1.75 and 3.5 go up (to codes 2, 4, 6).
_MIDPOINTS_TIE_DOWN = (0.25, 1.25, 2.5, 5.0)
_MIDPOINTS_TIE_UP = (0.75, 1.75, 3.5)

_CHUNK_ELEMENTS = 1 << 22  # elements processed at a time, to bound temporary memory on large matrices


def e8m0_table(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[256]`` table of ``2^(s-127)`` for every scale byte ``s`` (NaN for 255); every entry is exact."""
    values = [math.ldexp(1.0, s - E8M0_BIAS) for s in range(E8M0_NAN)] + [math.nan]
    return torch.tensor(values, dtype=dtype)


def e2m1_table(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[16]`` table of the E2M1 code values."""
    return torch.tensor(E2M1_VALUES, dtype=dtype)


def byte_pair_table(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[256, 2]`` the two E2M1 values of every packed byte, low nibble (the earlier element) first."""
    byte = torch.arange(256)
    return e2m1_table(dtype)[torch.stack([byte & 0x0F, byte >> 4], dim=-1)]


def check_packed(packed: torch.Tensor, scale: torch.Tensor) -> None:
    """Raise ValueError unless ``packed`` [..., K/2] and ``scale`` [..., K/32] form a valid MXFP4 pair."""
    for name, tensor in (("packed", packed), ("scale", scale)):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != torch.uint8:
            raise ValueError(f"{name} must be uint8, got {tensor.dtype}")
        if tensor.dim() < 1:
            raise ValueError(f"{name} must have at least one dimension, got a scalar")
    if packed.shape[:-1] != scale.shape[:-1] or packed.shape[-1] != scale.shape[-1] * (BLOCK_SIZE // 2):
        raise ValueError(
            f"packed {tuple(packed.shape)} and scale {tuple(scale.shape)} are inconsistent: expected "
            f"packed [..., K/2] and scale [..., K/32] with the same leading dimensions"
        )


def _check_weight(w: torch.Tensor) -> None:
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(w).__name__}")
    if not w.is_floating_point():
        raise ValueError(f"expected a floating-point tensor, got {w.dtype}")
    if w.dim() < 1 or w.shape[-1] == 0 or w.shape[-1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"the last dimension must be a positive multiple of {BLOCK_SIZE}, got shape {tuple(w.shape)}"
        )
    if not bool(torch.isfinite(w).all()):
        raise ValueError("cannot quantize NaN or infinite values to MXFP4")


def _quantize_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [B, 32] (float32 or float64) -> codes uint8 [B, 32] and scale bytes uint8 [B]."""
    magnitude = blocks.abs()
    amax = magnitude.amax(dim=1)  # [B]
    # amax = m * 2^exponent with m in [0.5, 1), so floor(log2 amax) = exponent - 1
    _, exponent = torch.frexp(amax)
    shared = (exponent - 1 - 2).clamp(_MIN_EXPONENT, _MAX_EXPONENT)
    shared = torch.where(amax == 0, _MIN_EXPONENT, shared)  # [B]
    # |x| / 2^shared, exactly: 2^-shared is a power of two representable in the working dtype
    inverse_scale = e8m0_table(blocks.dtype).to(blocks.device)[E8M0_BIAS - shared]
    y = magnitude * inverse_scale[:, None]  # [B, 32]
    codes = torch.zeros_like(y, dtype=torch.uint8)
    for midpoint in _MIDPOINTS_TIE_DOWN:
        codes += y > midpoint
    for midpoint in _MIDPOINTS_TIE_UP:
        codes += y >= midpoint
    codes |= torch.signbit(blocks).to(torch.uint8) << 3
    return codes, (shared + E8M0_BIAS).to(torch.uint8)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w`` [..., N] (N a multiple of 32) to MXFP4: ``(packed [..., N/2], scale [..., N/32])``.

    Negative values that round to zero keep their sign (code 8, ``-0``). Float inputs of any precision
    are accepted; float64 is processed in float64, everything else exactly in float32.
    """
    _check_weight(w)
    work_dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
    *lead, n = w.shape
    blocks = w.reshape(-1, BLOCK_SIZE)  # [B, 32]
    packed = torch.empty(blocks.shape[0], BLOCK_SIZE // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(blocks.shape[0], dtype=torch.uint8, device=w.device)
    step = _CHUNK_ELEMENTS // BLOCK_SIZE
    for b0 in range(0, blocks.shape[0], step):
        codes, scale_bytes = _quantize_blocks(blocks[b0 : b0 + step].to(work_dtype))
        packed[b0 : b0 + step] = codes[:, 0::2] | (codes[:, 1::2] << 4)
        scale[b0 : b0 + step] = scale_bytes
    return packed.reshape(*lead, n // 2), scale.reshape(*lead, n // BLOCK_SIZE)


def dequantize_mxfp4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode ``packed`` [..., K/2] and ``scale`` [..., K/32] to a dense ``[..., K]`` tensor of ``dtype``.

    Values are computed exactly in float32 (float64 when ``dtype`` is float64) and then cast, so
    float32 and bfloat16 results are exact; in float32, ``|code| >= 2`` at scale byte 254 overflows to inf,
    as in the compressed-tensors and transformers decoders. Scale byte 255 decodes to NaN.
    """
    check_packed(packed, scale)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype}")
    work_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    *lead, half_k = packed.shape
    rows_packed = packed.reshape(-1, half_k)  # [R, K/2]
    rows_scale = scale.reshape(-1, scale.shape[-1])  # [R, K/32]
    # one table lookup per byte gives both of its values (a [3072, 3584] matrix in 37 ms instead of
    # 50 ms by unpacking nibbles into codes first)
    pair_values = byte_pair_table(work_dtype).to(packed.device)
    scale_values = e8m0_table(work_dtype).to(packed.device)
    out = torch.empty(rows_packed.shape[0], 2 * half_k, dtype=dtype, device=packed.device)
    step = max(1, _CHUNK_ELEMENTS // (2 * half_k))
    for r0 in range(0, rows_packed.shape[0], step):
        pairs = F.embedding(rows_packed[r0 : r0 + step].to(torch.int32), pair_values)  # [r, K/2, 2]
        values = pairs.flatten(-2).unflatten(-1, (-1, BLOCK_SIZE))  # [r, K/32, 32]
        values *= scale_values[rows_scale[r0 : r0 + step].long()][..., None]
        out[r0 : r0 + step] = values.flatten(-2)
    return out.reshape(*lead, 2 * half_k)
