"""llama.cpp's logits for `k3 stream compare`: the file `llama-perplexity --kl-divergence-base` writes.

    llama-perplexity -m k3.gguf -f text.txt -c 512 --kl-divergence-base base.kld

The text is cut into chunks of n_ctx tokens; each chunk is one prompt (its first token replaced by BOS when
the vocabulary adds one), and the log-probabilities of the positions n_ctx / 2 .. n_ctx - 2 of every chunk
are stored, 16 bits each. The layout (little-endian; llama.cpp's tools/perplexity/perplexity.cpp):

    "_logits_"                           8 bytes
    n_ctx, n_vocab, n_chunk              int32 each
    tokens                               int32 [n_chunk * n_ctx], the text's tokens (no BOS)
    per chunk, per stored position:      uint16 [2 * ceil(n_vocab / 2) + 4]
        scale, min_log_prob              2 x float32 (the first 4 uint16)
        q[0 .. n_vocab)                  log p_i = scale * q_i + min_log_prob

where min_log_prob is the log-probability of max(min logit, max logit - 16): q_i = 0 says only that
log p_i is at most that (`floor`). `read_kld` returns the log-probabilities as [P, n_ctx, V] with the
positions before n_ctx / 2 and the last one absent (`start`, `lengths`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from k3.errors import K3Error

MAGIC = b"_logits_"


class KldFileError(K3Error):
    """A file that is not a complete llama.cpp --kl-divergence-base file."""


def is_kld(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def read_kld(path: Path) -> dict[str, torch.Tensor | int]:
    """{"logprobs" [P, T, V] float32, "floor" [P, T] float32, "input_ids" [P, T] int64 (BOS not applied),
    "start": first stored position, "stop": one past the last}; absent positions are zero."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    if len(raw) < 20 or raw[:8].tobytes() != MAGIC:
        raise KldFileError(f"{path}: not a llama.cpp --kl-divergence-base file (no '_logits_' header)")
    n_ctx, n_vocab, n_chunk = (int(x) for x in raw[8:20].view("<i4"))
    if n_ctx < 2 or n_vocab < 1 or n_chunk < 1:
        raise KldFileError(f"{path}: bad header (n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk})")
    nv = 2 * ((n_vocab + 1) // 2) + 4
    start, stop = n_ctx // 2, n_ctx - 1
    tokens_end = 20 + 4 * n_ctx * n_chunk
    size = tokens_end + 2 * nv * (stop - start) * n_chunk
    if len(raw) != size:
        raise KldFileError(
            f"{path}: {len(raw)} bytes, the header (n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk}) "
            f"says {size}: truncated (llama-perplexity does not check its writes) or not this format"
        )
    tokens = torch.from_numpy(raw[20:tokens_end].view("<i4").astype(np.int64)).view(n_chunk, n_ctx)
    records = raw[tokens_end:].view("<u2").reshape(n_chunk, stop - start, nv)  # [P, positions, nv]
    head = np.ascontiguousarray(records[:, :, :4]).view("<f4")  # [P, positions, 2]: scale, min_log_prob
    scale, floor = torch.from_numpy(head[..., 0].copy()), torch.from_numpy(head[..., 1].copy())
    q = torch.from_numpy(records[:, :, 4 : 4 + n_vocab].astype(np.float32))  # [P, positions, V]
    logprobs = torch.zeros(n_chunk, n_ctx, n_vocab)
    logprobs[:, start:stop] = scale[..., None] * q + floor[..., None]
    floors = torch.full((n_chunk, n_ctx), float("-inf"))
    floors[:, start:stop] = floor
    return {"logprobs": logprobs, "floor": floors, "input_ids": tokens, "start": start, "stop": stop}
