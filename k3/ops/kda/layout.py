"""Token layout <-> chunk layout for the chunked KDA form.

The chunked form works on ``[steps, N, H, C, D]``: N independent sequences, each cut into chunks of
C tokens, chunk ``step`` of every sequence side by side so that the inter-chunk recurrence is one
loop over ``steps`` batched over sequences and heads. Sequences shorter than ``steps * C`` are padded
with zero tokens (q = k = v = g = beta = 0), which leave the state unchanged: k = 0 writes nothing,
g = 0 decays nothing.

Two sources: a dense batch [B, T, H, D] (N = B) or a packed batch [1, T_total, H, D] with
``cu_seqlens`` = [0, end_1, ..., end_N] (N sequences of different lengths, no chunk straddles two).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def sequence_bounds(cu_seqlens: torch.Tensor, seq_len: int) -> list[int]:
    """The checked boundaries [0, end_1, ..., T] of packed sequences."""
    bounds = cu_seqlens.tolist()
    if cu_seqlens.dim() != 1 or len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != seq_len:
        raise ValueError(f"cu_seqlens must be 1-D [0, ..., T={seq_len}], got {bounds}")
    if any(end < start for start, end in zip(bounds[:-1], bounds[1:], strict=True)):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")
    return bounds


@dataclass(frozen=True)
class ChunkLayout:
    """Where every token goes in the ``[steps, N, H, C, D]`` chunk layout."""

    batch: int  # B of the token layout
    seq_len: int  # T of the token layout
    num_seqs: int  # N
    steps: int  # chunks per sequence after padding
    chunk_size: int  # C
    # packed inputs only: slot index (step * N + seq) * C + c of every token, [T]; None for dense
    slot_of_token: torch.Tensor | None
    # packed inputs only: token index of every slot, T (a zero row) for padding, [steps * N * C]
    token_of_slot: torch.Tensor | None

    @staticmethod
    def dense(batch: int, seq_len: int, chunk_size: int) -> ChunkLayout:
        steps = -(-seq_len // chunk_size)
        return ChunkLayout(batch, seq_len, batch, steps, chunk_size, None, None)

    @staticmethod
    def packed(cu_seqlens: torch.Tensor, seq_len: int, chunk_size: int) -> ChunkLayout:
        bounds = sequence_bounds(cu_seqlens, seq_len)
        lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
        num_seqs = len(lengths)
        steps = max(-(-n // chunk_size) for n in lengths)
        # token_of_slot[step, seq, c] = start_seq + step * C + c if inside the sequence, else T (padding)
        starts = torch.tensor(bounds[:-1]).view(1, num_seqs, 1)
        lens = torch.tensor(lengths).view(1, num_seqs, 1)
        offset = torch.arange(steps).view(steps, 1, 1) * chunk_size + torch.arange(chunk_size).view(1, 1, -1)
        inside = (offset < lens).reshape(-1)  # [steps * N * C]
        token_of_slot = torch.where(offset < lens, starts + offset, seq_len).reshape(-1)
        slot_of_token = torch.empty(seq_len, dtype=torch.long)
        slot_of_token[token_of_slot[inside]] = torch.arange(token_of_slot.numel())[inside]
        return ChunkLayout(1, seq_len, num_seqs, steps, chunk_size, slot_of_token, token_of_slot)

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H, *D] -> [steps, N, H, C, *D] (a view for dense inputs whose T divides by C)."""
        C, steps, N = self.chunk_size, self.steps, self.num_seqs
        tail = x.shape[3:]
        if self.token_of_slot is None:
            pad = steps * C - self.seq_len
            if pad:
                x = F.pad(x, (0, 0) * len(tail) + (0, 0, 0, pad))
            x = x.view(N, steps, C, x.shape[2], *tail)
        else:
            flat = torch.cat([x[0], x.new_zeros(1, *x.shape[2:])])  # [T + 1, H, *D], row T is padding
            x = flat[self.token_of_slot].view(steps, N, C, x.shape[2], *tail).transpose(0, 1)
        # [N, steps, C, H, *D] -> [steps, N, H, C, *D]
        return x.permute(1, 0, 3, 2, *range(4, x.dim()))

    def to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[steps, N, H, C, *D] -> [B, T, H, *D]."""
        steps, N, H, C = x.shape[:4]
        tail = x.shape[4:]
        x = x.transpose(2, 3)  # [steps, N, C, H, *D]
        if self.token_of_slot is None:
            return x.transpose(0, 1).reshape(N, steps * C, H, *tail)[:, : self.seq_len]
        return x.reshape(steps * N * C, H, *tail)[self.slot_of_token].unsqueeze(0)
