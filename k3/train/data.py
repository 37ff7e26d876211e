"""Training data: synthetic tasks (multi-query associative recall, copying) and plain text files.

Every dataset here is a pure function of (seed, batch index): `batch(index)` always returns the same
tensors, so the data position of a run is just the step counter, and a resumed run sees exactly the
batches an uninterrupted one would. A batch is `(inputs, labels)`, both int64 [B, L]; `labels[b, i]` is
the token expected after `inputs[b, :i+1]`, or `IGNORE` (-100) where the loss is not taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

IGNORE = -100


class Dataset(Protocol):
    vocab_size: int
    seq_len: int

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def _generator(seed: int, index: int, stream: int) -> np.random.Generator:
    """An independent random stream per (seed, batch index, stream): train and eval never overlap."""
    return np.random.default_rng([seed, index, stream])


@dataclass
class MQAR:
    """Multi-query associative recall, as in the Zoology benchmark (Arora et al. 2023).

    A sequence opens with `num_kv_pairs` key-value pairs `k1 v1 k2 v2 ...` (distinct keys drawn from the
    lower half of the vocabulary, values from the upper half), then every key is queried once more later
    on: the key appears again and the model must produce its value right after it. Query positions are
    drawn with Zoology's power law over the gap from the context (small gaps more likely, `power_a`);
    all other positions hold random noise tokens. Loss and accuracy count only the value after each
    queried key. Token 0 is never used (kept free as padding).
    """

    vocab_size: int
    seq_len: int
    batch_size: int
    num_kv_pairs: int = 8
    power_a: float = 0.01
    seed: int = 0
    stream: int = 0  # 0 = training batches; use another stream for held-out evaluation

    def __post_init__(self) -> None:
        half = self.vocab_size // 2
        if self.num_kv_pairs < 1:
            raise ValueError(f"num_kv_pairs must be at least 1, got {self.num_kv_pairs}")
        if half - 1 < self.num_kv_pairs:
            raise ValueError(
                f"vocab_size {self.vocab_size} is too small for {self.num_kv_pairs} distinct keys"
            )
        # context (2 n) + every query (2 positions each) must fit in seq_len + 1 tokens
        if 4 * self.num_kv_pairs > self.seq_len + 1:
            raise ValueError(
                f"seq_len {self.seq_len} is too short for {self.num_kv_pairs} pairs and their queries "
                f"(needs at least {4 * self.num_kv_pairs - 1})"
            )

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = _generator(self.seed, index, self.stream)
        n, total = self.num_kv_pairs, self.seq_len + 1  # one extra token: inputs and targets are shifts
        half = self.vocab_size // 2
        tokens = rng.integers(1, self.vocab_size, size=(self.batch_size, total))  # noise everywhere first
        targets = np.full((self.batch_size, total), IGNORE)
        context = 2 * n
        space = total - context  # positions left for queries
        slots = space // 2  # a query occupies slot j = positions (context + 2j, context + 2j + 1)
        # Zoology's power law over the distance from the context, normalised over the available slots
        gaps = np.arange(1, slots + 1, dtype=np.float64)
        weights = self.power_a * gaps ** (self.power_a - 1)
        weights /= weights.sum()
        for b in range(self.batch_size):
            keys = rng.choice(np.arange(1, half), size=n, replace=False)
            values = rng.integers(half, self.vocab_size, size=n)
            tokens[b, 0:context:2], tokens[b, 1:context:2] = keys, values
            where = rng.choice(slots, size=n, replace=False, p=weights)
            order = rng.permutation(n)  # which key each query slot asks for
            pos = context + 2 * where
            tokens[b, pos], tokens[b, pos + 1] = keys[order], values[order]
            targets[b, pos + 1] = values[order]
        inputs = torch.from_numpy(tokens[:, :-1].copy())
        labels = torch.from_numpy(targets[:, 1:].copy())
        return inputs, labels


@dataclass
class Copying:
    """Copy a random string: `x_1..x_n SEP x_1..x_n`; the loss counts only the copied half.

    `seq_len = 2 n + 1` tokens of input (n = seq_len // 2); token 0 is the separator."""

    vocab_size: int
    seq_len: int
    batch_size: int
    seed: int = 0
    stream: int = 0

    def __post_init__(self) -> None:
        if self.seq_len < 3:
            raise ValueError(f"seq_len must be at least 3 for copying, got {self.seq_len}")
        if self.vocab_size < 3:
            raise ValueError(f"vocab_size must be at least 3 for copying, got {self.vocab_size}")

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = _generator(self.seed, index, self.stream)
        n = self.seq_len // 2
        source = rng.integers(1, self.vocab_size, size=(self.batch_size, n))
        sep = np.zeros((self.batch_size, 1), dtype=source.dtype)
        pad = np.zeros((self.batch_size, self.seq_len + 1 - (2 * n + 1)), dtype=source.dtype)
        tokens = np.concatenate([source, sep, source, pad], axis=1)  # [B, seq_len + 1]
        targets = np.full_like(tokens, IGNORE)
        targets[:, n + 1 : 2 * n + 1] = source
        return torch.from_numpy(tokens[:, :-1].copy()), torch.from_numpy(targets[:, 1:].copy())


class TextFile:
    """Windows of `seq_len + 1` tokens from a plain text file, tokenised once with the k3 tokenizer.

    Batch `index` takes `batch_size` windows at start offsets drawn from (seed, index). The tokenizer is
    any object with `encode(text) -> list[int]` (`k3.tokenizer.kimi.Tokenizer`)."""

    def __init__(
        self, path: str | Path, tokenizer, seq_len: int, batch_size: int, vocab_size: int, seed: int = 0
    ):
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such text file")
        ids = tokenizer.encode(path.read_text(encoding="utf-8"))
        if len(ids) < seq_len + 2:
            raise ValueError(f"{path}: {len(ids)} tokens, fewer than one window of {seq_len + 1}")
        if max(ids) >= vocab_size:
            raise ValueError(f"{path}: token id {max(ids)} is outside the model's vocabulary ({vocab_size})")
        self.ids = torch.tensor(ids, dtype=torch.int64)  # [N]
        self.vocab_size, self.seq_len, self.batch_size, self.seed = vocab_size, seq_len, batch_size, seed

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = _generator(self.seed, index, 0)
        starts = rng.integers(0, len(self.ids) - self.seq_len - 1, size=self.batch_size)
        windows = torch.stack([self.ids[s : s + self.seq_len + 1] for s in starts.tolist()])  # [B, L + 1]
        return windows[:, :-1].clone(), windows[:, 1:].clone()


def answer_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of counted positions (labels != IGNORE) where the argmax of `logits` [B, L, V] is right."""
    mask = labels != IGNORE
    if not mask.any():
        raise ValueError("labels count no position")
    return float((logits.argmax(-1)[mask] == labels[mask]).float().mean())
