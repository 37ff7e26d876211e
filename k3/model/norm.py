"""RMSNorm and the Linear layer every model module uses.

Both compute in the activation dtype (fp32 by default) whatever dtype the checkpoint stored the weight in,
so a model can keep BF16 weights in memory and still run in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.model.tiling import block_rows, is_tiled, laid_out_state, matrix_shape, rows_of, untiled_state
from k3.ops.decode.native import load_native

# The dtypes the native kernels read weight matrices in: fp32, or BF16 as fp32 in registers.
NATIVE_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


def parameter(module: nn.Module, name: str) -> torch.Tensor:
    """`module.<name>` for a parameter or buffer, read from its dicts: the decode step reads ~500 of them a
    token, and nn.Module.__getattr__ costs ~1.5 us each (as much as a small native call)."""
    found = module.__dict__["_parameters"].get(name)
    return module.__dict__["_buffers"][name] if found is None else found


def child(module: nn.Module, name: str) -> nn.Module:
    """`module.<name>` for a submodule, the same way."""
    return module.__dict__["_modules"][name]


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)` without the op when x already has it (the same tensor either way; saves a dispatch)."""
    return x if x.dtype == dtype else x.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps) * weight` over the last dim, computed in fp32, returned in x's dtype."""
    x32 = as_dtype(x, torch.float32)
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * as_dtype(weight, torch.float32)
    return as_dtype(y, x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


CONVERT_ROWS_ELEMENTS = 1 << 24  # with autograd, weights above 16 M elements are converted in slices
CONVERT_BLOCK_ELEMENTS = 1 << 21  # without: weights pass through one 8 MB fp32 block, refilled slice by slice
# Up to this many rows of fp32 input, a BF16 weight is multiplied in place by the native kernel (read as fp32
# in registers: 2 bytes a weight from memory, no converted copy); above, converting blocks + torch's GEMM win.
NATIVE_BF16_ROWS = 64


def _native_bf16(x: torch.Tensor, w: torch.Tensor):
    """The native module when it can multiply x [..., K] fp32 by the BF16 weight w (tiled or not) in place;
    else None."""
    if w.dtype != torch.bfloat16 or x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    if x.numel() > NATIVE_BF16_ROWS * matrix_shape(w)[1] or not w.is_contiguous():
        return None
    return load_native()


def _slice_rows(N: int, wanted: int, block: int) -> int:
    """Rows per converted slice: `wanted`, at least one, a whole number of blocks of `block` rows (a tiled
    weight's; 1 in rows)."""
    return max(block, min(N, wanted) // block * block)


def _converted_in_slices(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x W^T with W converted to x's dtype by torch ops (differentiable): whole, or a slice of output rows
    at a time for a big weight (a BF16 lm_head, say), so that the converted copy never exists whole."""
    N, K = matrix_shape(w)
    if N * K <= CONVERT_ROWS_ELEMENTS:
        return F.linear(x, rows_of(w, 0, N).to(x.dtype))
    rows = _slice_rows(N, CONVERT_ROWS_ELEMENTS // K, block_rows(w))
    slices = [F.linear(x, rows_of(w, i, min(N, i + rows)).to(x.dtype)) for i in range(0, N, rows)]
    return torch.cat(slices, dim=-1)


def _converted_in_blocks(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x W^T without autograd: slices of W converted into one reused block (a new converted copy per call
    would be a fresh allocation, which the kernel hands over page by page, each time), each block's GEMM
    written into its columns of the output."""
    N, K = matrix_shape(w)
    rows = _slice_rows(N, CONVERT_BLOCK_ELEMENTS // K, block_rows(w))
    block = torch.empty(rows, K, dtype=x.dtype)  # [rows, K]
    out = x.new_empty(*x.shape[:-1], N)  # [..., N]
    for i in range(0, N, rows):
        part = block[: min(rows, N - i)]
        rows_of(w, i, i + part.shape[0], out=part)
        out[..., i : i + part.shape[0]] = F.linear(x, part)
    return out


class Linear(nn.Linear):
    """A bias-free `nn.Linear` whose weight may be stored in another dtype than the activations, and, for
    inference, tiled for the decode kernels (k3.model.tiling: a 4-D weight, saved as [N, K] by state_dict and
    loaded from [N, K] by load_state_dict)."""

    tileable = True  # whether k3.model.tiling may tile the weight (False where code reads its rows in place)

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.register_state_dict_post_hook(untiled_state)
        self._register_load_state_dict_pre_hook(laid_out_state, with_module=True)

    def reset_parameters(self) -> None:
        # Weights come from a checkpoint or from k3.model.init; skip nn.Linear's costly kaiming init.
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.dtype == x.dtype and not is_tiled(w):
            # as a matrix: torch's bf16 matmul of a [1, 1, K] input with a large weight (lm_head) expands
            # it into a batched product that copies the whole transposed weight (12 s for K3's lm_head)
            return F.linear(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])
        if torch.is_grad_enabled():
            return _converted_in_slices(x, w)
        if (native := _native_bf16(x, w)) is not None:
            rows = x.reshape(-1, self.in_features).contiguous()  # [B, K]
            return native.project(rows, None, 0.0, [w])[0].view(*x.shape[:-1], self.out_features)
        return _converted_in_blocks(x, w)
