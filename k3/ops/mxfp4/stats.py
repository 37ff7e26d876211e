"""Exact value statistics of an MXFP4 matrix, computed from codes and scales without dequantizing it.

Every element's value is ``E2M1[code] * 2^(scale - 127)``, so the distinct values of a matrix are the
distinct products over the (scale byte, code) pairs in use: count the pairs (256 x 16 bins), then merge
pairs with equal products (code 2 = 1.0 at scale s equals code 1 = 0.5 at scale s+1; +0 and -0 are both
0.0). A K3 expert matrix typically holds about 21 distinct values.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from k3.ops.mxfp4.codec import BLOCK_SIZE, E8M0_NAN, check_packed, e2m1_table, e8m0_table
from k3.ops.mxfp4.native import load_native

_CHUNK_BLOCKS = 1 << 18  # blocks counted at a time (bounds the [blocks, 16] key tensor to 16 MiB)


@dataclass(frozen=True)
class MXFP4ValueCounts:
    """Distinct values of an MXFP4 tensor and how often each occurs.

    ``values`` float64 [V]: the distinct values, ascending (exact; one NaN last if any scale byte is 255);
    ``counts`` int64 [V]: elements holding each value;
    ``code_histogram`` int64 [16]: elements per E2M1 code;
    ``scale_histogram`` int64 [256]: blocks (of 32 elements) per scale byte.
    """

    values: torch.Tensor
    counts: torch.Tensor
    code_histogram: torch.Tensor
    scale_histogram: torch.Tensor

    @property
    def num_distinct(self) -> int:
        return int(self.values.numel())


def add_scaled_byte_histogram(
    joint: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, native: ModuleType | None = None
) -> None:
    """``joint`` int64 [65536] += how many packed bytes there are per (block scale byte, byte) pair.

    Index ``scale * 256 + byte``; ``packed`` [..., K/2] and ``scale`` [..., K/32] uint8 (16 bytes per scale).
    ``native``: the native kernel module (``load_native()``) for a single-threaded pass ~4x faster than
    ``torch.bincount``, or None for bincount.
    """
    if native is not None:
        native.histogram_scaled_bytes(packed.contiguous().view(-1), scale.contiguous().view(-1), joint)
        return
    block_bytes = packed.reshape(-1, BLOCK_SIZE // 2)  # [B, 16]: the 16 bytes of each block
    block_scale = scale.reshape(-1)  # [B]
    for b0 in range(0, block_scale.numel(), _CHUNK_BLOCKS):
        key = (
            block_scale[b0 : b0 + _CHUNK_BLOCKS, None].int() * 256
            + block_bytes[b0 : b0 + _CHUNK_BLOCKS].int()
        )
        joint += torch.bincount(key.flatten(), minlength=256 * 256)


def _scale_code_counts(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int64 [256, 16]: how many elements have each (scale byte, code) pair."""
    byte_counts = torch.zeros(256 * 256, dtype=torch.int64, device=packed.device)  # [scale * 256 + byte]
    native = load_native() if packed.device.type == "cpu" else None
    add_scaled_byte_histogram(byte_counts, packed, scale, native)
    byte_counts = byte_counts.view(256, 16, 16)  # [scale, high nibble, low nibble]
    return byte_counts.sum(dim=1) + byte_counts.sum(dim=2)  # low-nibble codes + high-nibble codes


def mxfp4_value_counts(packed: torch.Tensor, scale: torch.Tensor) -> MXFP4ValueCounts:
    """Exact distinct values and counts of ``dequantize_mxfp4(packed, scale)``, plus code/scale histograms.

    Equals ``torch.unique(dequantize_mxfp4(packed, scale, torch.float64), return_counts=True)`` (with
    NaNs merged into one entry) while reading only the bytes.
    """
    check_packed(packed, scale)
    pair_counts = _scale_code_counts(packed, scale)  # [256, 16]
    # [256, 16] exact float64 products; "+ 0.0" turns -0.0 into +0.0 so that both zeros merge
    pair_values = e8m0_table(torch.float64)[:, None] * e2m1_table(torch.float64)[None, :] + 0.0
    in_use = pair_counts.cpu() > 0
    values, counts = pair_values[in_use], pair_counts.cpu()[in_use]  # [P] each, P <= 4096

    is_nan = values.isnan()  # only scale byte 255 decodes to NaN
    distinct, inverse = torch.unique(values[~is_nan], sorted=True, return_inverse=True)
    merged = torch.zeros(distinct.numel(), dtype=torch.int64).scatter_add_(0, inverse, counts[~is_nan])
    if bool(is_nan.any()):
        distinct = torch.cat([distinct, torch.tensor([float("nan")], dtype=torch.float64)])
        merged = torch.cat([merged, counts[is_nan].sum().reshape(1)])
    return MXFP4ValueCounts(
        values=distinct,
        counts=merged,
        code_histogram=pair_counts.sum(dim=0).cpu(),
        scale_histogram=torch.bincount(scale.reshape(-1).long(), minlength=E8M0_NAN + 1).cpu(),
    )
