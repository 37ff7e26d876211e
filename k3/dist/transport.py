"""The autograd all-to-all: rows leave in rank-ordered blocks of variable size and arrive likewise.

    recv_rows, recv_weights = exchange(comm, [(rows, send_splits, recv_splits), (flat, w_send, w_recv)])

Forward sends `tensor[i]`'s rows `send_splits[r]` at a time to rank r (dim 0) and returns what arrived
(`recv_splits[r]` rows from rank r, in rank order). Backward is the same call with the splits swapped: each
arriving row's gradient goes back to the rank and the position it came from. Several tensors travel in one
Function so that its backward runs on every rank as soon as any output is used, even on a rank whose other
outputs are empty or unused (their gradients are materialised as zeros): every rank then enters every
backward collective, in the same order. No padding: an empty block is just a zero split.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k3.dist.group import Comm

Splits = list[int]


def _send(comm: Comm, tensor: torch.Tensor, send: Splits, recv: Splits) -> torch.Tensor:
    out = tensor.new_empty((sum(recv), *tensor.shape[1:]))
    if len(send) != comm.world or len(recv) != comm.world:
        raise ValueError(f"splits must have one entry per rank ({comm.world}), got {len(send)}, {len(recv)}")
    if sum(send) != tensor.shape[0]:
        raise ValueError(f"send splits add up to {sum(send)} rows, the tensor has {tensor.shape[0]}")
    return comm.all_to_all(out, tensor, recv, send)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm: Comm, splits: tuple[tuple[Splits, Splits], ...], *tensors: torch.Tensor):
        ctx.comm, ctx.splits = comm, splits
        out = tuple(_send(comm, t, send, recv) for t, (send, recv) in zip(tensors, splits, strict=True))
        ctx.integer = [not t.is_floating_point() for t in out]
        ctx.mark_non_differentiable(*(t for t in out if not t.is_floating_point()))
        return out

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        # integer tensors (MXFP4 codes and scales) have no gradient, on any rank: they skip the way back
        back = tuple(
            None if integer else _send(ctx.comm, g.contiguous(), recv, send)
            for g, integer, (send, recv) in zip(grads, ctx.integer, ctx.splits, strict=True)
        )
        return (None, None, *back)


def exchange(comm: Comm, items: Sequence[tuple[torch.Tensor, Splits, Splits]]) -> tuple[torch.Tensor, ...]:
    """All-to-all every (tensor, send_splits, recv_splits), differentiably; returns the received tensors."""
    splits = tuple((list(map(int, send)), list(map(int, recv))) for _, send, recv in items)
    return _Exchange.apply(comm, splits, *(t for t, _, _ in items))


def segments(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The positions `starts[i] .. starts[i] + lengths[i] - 1` for every i, concatenated (int64)."""
    lengths = lengths.to(torch.long)
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.long)
    begin = torch.cumsum(lengths, 0) - lengths  # where each segment begins in the output
    return torch.repeat_interleave(starts.to(torch.long) - begin, lengths) + torch.arange(total)
