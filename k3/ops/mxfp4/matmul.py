"""Matrix multiplication with MXFP4-packed weights: ``x @ W^T`` without materializing ``W``.

Two implementations, chosen automatically:

* ``native``: the C++ kernels in ``_native.cpp`` (AVX2, built by ``python -m k3.ops.build``). For a
  few rows of ``x`` (decoding) they stream the packed bytes once, decode nibbles with a byte shuffle and
  accumulate with FMAs, so they read 4x fewer bytes than a bfloat16 matrix; for many rows (prefill) they
  decode ``W`` tile by tile to float32 and multiply each tile with sgemm. Many rows of a bfloat16 ``x``
  are multiplied in bfloat16 instead: ``W``'s tiles decoded to bfloat16 (exactly: every MXFP4 value is a
  bfloat16 value) and torch's bf16 GEMM, which sums in fp32 and rounds each output once; a few rows of it
  stream ``W`` once with bf16 dot products (AVX-512 BF16, ``_native_bf16.h``).
* ``torch``: the pure-torch reference, always available: decode one ``[TORCH_TILE_N, TORCH_TILE_K]`` tile
  at a time with :func:`dequantize_mxfp4` and accumulate ``x_tile @ W_tile^T``.

Both keep scratch memory bounded by the tile size, whatever the size of ``W``.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from k3.ops.mxfp4.codec import BLOCK_SIZE, check_packed, dequantize_mxfp4, quantize_mxfp4
from k3.ops.mxfp4.int8_x import round_int8_blocks
from k3.ops.mxfp4.native import load_native

Backend = Literal["auto", "native", "torch"]

NATIVE_GEMV_MAX_M = 8
"""Up to this many rows of x, the native path streams W once (decoding each block once for all rows);
above it, decoding tiles for sgemm is faster (measured crossover between 8 and 12 rows, 1 thread)."""
NATIVE_TILE_N, NATIVE_TILE_K = 128, 4096  # native tile: up to 2 MiB of float32 scratch per thread
TORCH_TILE_N, TORCH_TILE_K = 256, 2048  # torch-path tile: 2 MiB of float32 scratch


def _matmul_torch(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ W^T -> [M, N] float32, decoding W one tile at a time."""
    n_rows, k = packed.shape[0], x.shape[1]
    out = torch.empty(x.shape[0], n_rows, dtype=torch.float32, device=x.device)
    for n0 in range(0, n_rows, TORCH_TILE_N):
        out_tile = out[:, n0 : n0 + TORCH_TILE_N]  # [M, tile_n]
        for k0 in range(0, k, TORCH_TILE_K):
            w_tile = dequantize_mxfp4(
                packed[n0 : n0 + TORCH_TILE_N, k0 // 2 : (k0 + TORCH_TILE_K) // 2],
                scale[n0 : n0 + TORCH_TILE_N, k0 // BLOCK_SIZE : (k0 + TORCH_TILE_K) // BLOCK_SIZE],
            )  # [tile_n, tile_k] float32
            out_tile.addmm_(x[:, k0 : k0 + TORCH_TILE_K], w_tile.t(), beta=0.0 if k0 == 0 else 1.0)
    return out


def mxfp4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    backend: Backend = "auto",
    int8_inputs: bool = False,
) -> torch.Tensor:
    """``x @ W^T (+ bias)``: ``x`` [..., K]; ``W`` [N, K] as ``packed`` [N, K/2] and ``scale`` [N, K/32].

    Computes in float32 and returns ``x.dtype``, but for a bfloat16 ``x`` on the native path: bf16 products
    (exact), fp32 sums, bf16 out (few rows: fp32 FMAs where the CPU lacks AVX-512 BF16).
    ``backend="auto"`` uses the native kernels when they are built and ``x`` is on the CPU, else the
    pure-torch path; ``"native"`` and ``"torch"`` force one. ``int8_inputs``: approximate, ``x`` (as
    float32) rounded to int8 per block of 32 first and multiplied with integer products
    (k3.ops.mxfp4.int8_x; one pass over ``W`` per 8 rows of ``x``).
    """
    check_packed(packed, scale)
    if packed.dim() != 2:
        raise ValueError(f"packed must be a matrix [N, K/2], got shape {tuple(packed.shape)}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    n_out, k = packed.shape[0], 2 * packed.shape[1]
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not match W [{n_out}, {k}]: expected x [..., {k}]")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (n_out,)):
        raise ValueError(f"bias must be a tensor of shape ({n_out},), got {getattr(bias, 'shape', bias)}")
    if backend not in ("auto", "native", "torch"):
        raise ValueError(f"backend must be 'auto', 'native' or 'torch', got {backend!r}")

    native = load_native() if backend != "torch" and x.device.type == "cpu" else None
    if backend == "native" and native is None:
        raise RuntimeError(
            "the native MXFP4 kernels are not available (CPU tensors only; build them with "
            "`python -m k3.ops.build`; the CPU needs AVX2 and FMA)"
        )

    x2d = x.reshape(-1, k)  # [M, K]
    bf16_products = native is not None and x.dtype == torch.bfloat16 and not int8_inputs
    x2d = x2d.contiguous() if bf16_products else x2d.to(torch.float32).contiguous()
    if int8_inputs and native is not None:
        out = native.matmul_int8_x(x2d, packed.contiguous(), scale.contiguous())
    elif int8_inputs:
        out = _matmul_torch(round_int8_blocks(x2d), packed, scale)
    elif native is not None:
        out = native.matmul(
            x2d,
            packed.contiguous(),
            scale.contiguous(),
            gemv_max_m=NATIVE_GEMV_MAX_M,
            tile_n=NATIVE_TILE_N,
            tile_k=NATIVE_TILE_K,
        )
    else:
        out = _matmul_torch(x2d, packed, scale)
    if bias is not None:
        out += bias.to(out.dtype)
    return out.reshape(*x.shape[:-1], n_out).to(x.dtype)


class MXFP4Linear(nn.Module):
    """A linear layer ``y = x W^T (+ b)`` whose weight is stored in MXFP4.

    Buffers follow the compressed-tensors checkpoint names: ``weight_packed`` uint8 [out, in/2] and
    ``weight_scale`` uint8 [out, in/32], so a checkpoint's tensors load with ``load_state_dict``. A fresh
    layer holds zeros (all codes +0, scale byte 0, as :func:`quantize_mxfp4` writes for a zero block).
    ``int8_inputs``: multiply inputs rounded to int8 per block (approximate; ``mxfp4_matmul``), default False.
    """

    weight_packed: torch.Tensor
    weight_scale: torch.Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if in_features <= 0 or in_features % BLOCK_SIZE != 0:
            raise ValueError(f"in_features must be a positive multiple of {BLOCK_SIZE}, got {in_features}")
        if out_features <= 0:
            raise ValueError(f"out_features must be positive, got {out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer(
            "weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device)
        )
        self.register_buffer(
            "weight_scale",
            torch.zeros(out_features, in_features // BLOCK_SIZE, dtype=torch.uint8, device=device),
        )
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None
        self.int8_inputs = False

    @classmethod
    def from_float(cls, linear_or_weight: nn.Linear | torch.Tensor) -> MXFP4Linear:
        """Quantize an ``nn.Linear`` (its bias is kept in float32) or a weight tensor [out, in]."""
        if isinstance(linear_or_weight, nn.Linear):
            weight, bias = linear_or_weight.weight.detach(), linear_or_weight.bias
        elif isinstance(linear_or_weight, torch.Tensor) and linear_or_weight.dim() == 2:
            weight, bias = linear_or_weight.detach(), None
        else:
            raise ValueError(
                "from_float expects an nn.Linear or a 2-D weight tensor [out_features, in_features]"
            )
        out_features, in_features = weight.shape
        layer = cls(in_features, out_features, bias=bias is not None, device=weight.device)
        packed, scale = quantize_mxfp4(weight)
        layer.weight_packed.copy_(packed)
        layer.weight_scale.copy_(scale)
        if bias is not None:
            layer.bias.data.copy_(bias.detach())
        return layer

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight [out, in]."""
        return dequantize_mxfp4(self.weight_packed, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mxfp4_matmul(x, self.weight_packed, self.weight_scale, self.bias, int8_inputs=self.int8_inputs)

    def extra_repr(self) -> str:
        int8 = ", int8_inputs=True" if self.int8_inputs else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
            + int8
        )
