"""BF16 weights re-laid once for the decode kernels ("tiled"), so that a token's matrix-vector products read
each matrix as one memory stream.

The decode kernels (k3/ops/decode/_native_gemv.h) multiply one vector by 8 weight rows at a time, one
8-lane accumulator per row. Stored as published ([N, K], row-major), those 8 rows are 8 streams through
memory, 14 kB apart at K3's hidden size; tiled, blocks of 8 rows are stored [K/8][8 rows][8 columns], so
the 8 values each row needs next lie together and a block is read front to back. The arithmetic is the
same (each row's value is the same sum in the same order), so a tiled model's logits are the untiled
model's bit for bit; only the speed changes (docs/native-decode.md, "Tiled BF16 weights").

A tiled weight is the Linear's parameter itself in the 4-D shape [N/8, K/8, 8, 8] (no second copy):
torch code that expects [N, K] fails on the shape instead of computing with scrambled rows.
`Linear.forward` multiplies it (the native kernels read it in place; a long prefill converts blocks of it
back to rows for torch's GEMM), `state_dict()` hands it out as [N, K], and `untile_weights` puts the rows
back. Only inference weights are tiled: fp32 computation (the fused decode step's), no gradient, N and K
multiples of 8, and not a Linear that says `tileable = False` (MLA's kv_b_proj, read head by head in place).

fp32 matrices keep their rows (the kernels read 8 fp32 values in one load either way; MLA's kv_b_proj too),
but are copied together onto huge pages: read from the shards' memory map or fresh allocations they sit on
4 kB pages, and a decode step's stream through them misses the TLB every 4 kB (a KDA layer's 1 MB o_proj
took 110-170 us at one thread with its pages out of the caches, against ~40 at the read bandwidth). Each
stays a tensor of its own, in one allocation. `mini`, fp32, EPYC Zen 4, as loaded against placed, alternated
in one process (medians of 40 steps after 512 tokens, six rounds): one thread 10.5-15.9 -> 9.3-13.7 ms
(five rounds faster; median of rounds 11.6 -> 10.1), two threads 7.5-10.7 -> 7.3-8.1 (four faster; 8.1 ->
7.7); its lm_head alone 22-25 -> 26-28 GB/s at one thread. The values and the layout stay, so the logits do
too, bit for bit.

With `bf16_products=True` (`K3ForCausalLM.tile_weights(bf16_products=True)`, `k3 generate --bf16-products`;
CPUs with AVX-512 BF16 only) the BF16 matrices are "paired" instead: blocks of 16 rows stored [K/2][16
rows][2 columns] ([N/16, K/2, 16, 2]), which the decode kernels multiply by their vectors rounded to bfloat16
with bf16 dot products (k3/ops/decode/_native_paired.h): twice the products an instruction, for a step of
several sequences, which is compute-bound. Approximate and opted into: the vectors lose their low 16 bits
(round to nearest even; sums stay fp32), so the logits move from the exact ones (measured in
docs/native-decode.md, "bf16 products in decode steps"); a row's value depends on nothing but its weights
and its vector, so a sequence gets the same bits alone or in a batch, at any thread count. A prefill longer
than the kernels' reach converts blocks back to rows and stays exact. Matrices whose N is not a multiple of
16 are tiled.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.errors import K3Error
from k3.ops.decode.native import load_native

ROWS, COLUMNS = 8, 8  # tiled: rows per block (Tiled::kRows), columns per step (one 8-lane load)
PAIRED_ROWS, PAIRED_COLUMNS = 16, 2  # paired: rows per block (16 lanes), columns per step (a pair)


def is_tiled(w: torch.Tensor) -> bool:
    """Whether w is a BF16 matrix laid out in blocks: tiled [N/8, K/8, 8, 8] or paired [N/16, K/2, 16, 2]."""
    return w.dim() == 4


def is_paired(w: torch.Tensor) -> bool:
    """Whether w is a paired BF16 matrix [N/16, K/2, 16, 2] (multiplied with bf16 products)."""
    return w.dim() == 4 and w.shape[2:] == (PAIRED_ROWS, PAIRED_COLUMNS)


def block_rows(w: torch.Tensor) -> int:
    """Rows per block of a tiled or paired matrix (1 for a matrix in rows)."""
    return w.shape[2] if is_tiled(w) else 1


def matrix_shape(w: torch.Tensor) -> tuple[int, int]:
    """(N, K) of a weight matrix, in rows, tiled or paired ([blocks, steps, rows, columns])."""
    if is_tiled(w):
        return w.shape[0] * w.shape[2], w.shape[1] * w.shape[3]
    return w.shape[0], w.shape[1]


def _inference_matrix(w: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether w is a CPU matrix of `dtype` without gradient: what tile_weights may replace."""
    return w.dim() == 2 and w.dtype == dtype and w.device.type == "cpu" and not w.requires_grad


def can_tile(w: torch.Tensor, rows: int = ROWS, columns: int = COLUMNS) -> bool:
    """Whether the kernels take w tiled (or paired: `rows`, `columns` = PAIRED_*): a BF16 CPU matrix with N
    and K multiples of those, no gradient."""
    return _inference_matrix(w, torch.bfloat16) and w.shape[0] % rows == 0 and w.shape[1] % columns == 0


def can_place(w: torch.Tensor) -> bool:
    """Whether w is an fp32 CPU matrix without gradient: copied onto huge pages with the others."""
    return _inference_matrix(w, torch.float32)


def rows_of(w: torch.Tensor, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [start, stop) of the matrix w as [stop - start, K] in w's dtype: a view of a row-major w, a copy
    of a tiled or paired one (start, and stop unless it is N, multiples of its block's rows).

    With `out` (a [stop - start, K] matrix, float32 or w's dtype) the rows are written into it, converted
    exactly, and it is returned: from a tiled or paired w by the native kernel where there is one (torch's
    copy from the blocks' transposed view moves 16 bytes at a time: 2.6-4x slower at K3's widths)."""
    if not is_tiled(w):
        return w[start:stop] if out is None else out.copy_(w[start:stop])
    rows = block_rows(w)
    if start % rows or (stop % rows and stop != matrix_shape(w)[0]):
        raise ValueError(f"rows of a tiled matrix are taken in blocks of {rows}, got [{start}, {stop})")
    native = load_native() if out is not None and w.is_contiguous() and out.is_contiguous() else None
    if native is not None and out.dtype in (torch.float32, torch.bfloat16):
        return native.rows_from_blocks(w, start, stop, out)
    blocks = w[start // rows : -(-stop // rows)]  # [b, steps, rows, columns]
    taken = blocks.transpose(1, 2).reshape(-1, matrix_shape(w)[1])[: stop - start]
    return taken if out is None else out.copy_(taken)


def laid_out_like(w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The [N, K] matrix `rows` in w's layout (tiled or paired) and dtype: a new tensor."""
    if tuple(rows.shape) != matrix_shape(w):
        raise ValueError(f"rows {tuple(rows.shape)} for a matrix of {matrix_shape(w)}")
    rows = rows.to(w.dtype).contiguous()
    native = load_native()
    return native.pair_rows(rows) if is_paired(w) else native.tile_rows(rows)


def laid_out_state(module: nn.Module, state: dict, prefix: str, *args: object) -> None:
    """A load_state_dict pre-hook (every Linear has it): the [N, K] matrix given for a tiled weight is laid
    out as the weight is, so that `load_state_dict(state_dict())` works on a tiled model too."""
    key, w = prefix + "weight", module._parameters.get("weight")
    if w is not None and is_tiled(w) and key in state and state[key].dim() == 2:
        state[key] = laid_out_like(w, state[key])


def state_entries(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The shape and dtype of every entry `model.state_dict()` hands out, a tiled weight as its [N, K],
    without making the state: state_dict() copies every tiled matrix back into rows (k3-slice: ~11 GB)."""
    entries = {}
    for name, module in model.named_modules(remove_duplicate=False):  # shared modules under every name
        prefix = name + "." if name else ""
        for key, p in module._parameters.items():
            if p is not None:
                tiled = key == "weight" and getattr(module, "tileable", False) and is_tiled(p)  # not a conv's
                shape = matrix_shape(p) if tiled else tuple(p.shape)
                entries[prefix + key] = (shape, p.dtype)
        for key, b in module._buffers.items():
            if b is not None and key not in module._non_persistent_buffers_set:
                entries[prefix + key] = (tuple(b.shape), b.dtype)
    return entries


def untiled_state(module: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
    """A state_dict post-hook (every Linear has it): a tiled weight is saved as the [N, K] matrix it is."""
    key = prefix + "weight"
    if key in state and is_tiled(state[key]):
        state[key] = rows_of(state[key], 0, matrix_shape(state[key])[0])


def tile_weights(model: nn.Module, bf16_products: bool = False) -> int:
    """Tile every eligible BF16 Linear weight of an inference model in place (or pair it, for bf16 products)
    and copy its fp32 ones together onto huge pages; returns the bytes tiled or copied. A weight shared with
    another module (tied embeddings) stays as it is. Computing in another dtype than fp32 (the fused decode
    step's), nothing is tiled: each product would convert the tiles back. Weights already tiled or paired
    stay as they are (untile_weights first to change the layout)."""
    native = load_native()
    if bf16_products and (native is None or not native.bf16_products_supported()):
        raise K3Error("bf16 products need a CPU with AVX-512 BF16 (avx512_bf16) and the native kernels")
    if getattr(model, "compute_dtype", torch.float32) != torch.float32 or native is None:
        return 0
    uses: dict[int, int] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                uses[id(p)] = uses.get(id(p), 0) + 1
    done = 0
    placed: list[nn.Module] = []  # the modules whose fp32 weights go onto huge pages, together
    for module in model.modules():
        w = module._parameters.get("weight") if hasattr(module, "tileable") else None  # k3's Linears
        if w is None or uses[id(w)] > 1:
            continue
        if module.tileable and bf16_products and can_tile(w, PAIRED_ROWS, PAIRED_COLUMNS):
            module.register_parameter("weight", nn.Parameter(native.pair_rows(w.data), requires_grad=False))
            done += w.nbytes  # [N/16, K/2, 16, 2], on huge pages if allowed
        elif module.tileable and can_tile(w):  # [N/8, K/8, 8, 8]: a new tensor, on huge pages if allowed
            module.register_parameter("weight", nn.Parameter(native.tile_rows(w.data), requires_grad=False))
            done += w.nbytes
        elif can_place(w):
            placed.append(module)
    if placed:
        copies = native.on_huge_pages([m._parameters["weight"].data for m in placed])  # type: ignore[union-attr]
        for module, copy in zip(placed, copies, strict=True):
            module.register_parameter("weight", nn.Parameter(copy, requires_grad=False))
            done += copy.nbytes
    return done


def untile_weights(model: nn.Module) -> int:
    """Put every tiled weight back in rows [N, K]; returns the bytes untiled. Only a tileable module's
    weight is looked at (a convolution's weight has four dimensions too)."""
    done = 0
    for module in model.modules():
        w = module._parameters.get("weight") if getattr(module, "tileable", False) else None
        if w is not None and is_tiled(w):
            rows = rows_of(w.data, 0, matrix_shape(w)[0]).contiguous()
            module.register_parameter("weight", nn.Parameter(rows, requires_grad=False))
            done += rows.nbytes
    return done
