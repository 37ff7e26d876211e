"""k3's exact next-token distributions, the values an engine's returned logprobs are held against.

    ref = CheckpointReference(model, tokenizer)          # computed now, every position, full vocabulary
    ref = GoldenReference(pack)                          # read from a golden pack (k3.conform.golden): top-20
    rows = ref.expect(ids, positions)                    # [Expected] after ids[:p] for each p

`Expected.logprob(token)` is the log-probability k3 gives `token` there (None when a golden pack did not keep
it: only its top-20 are stored).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.errors import K3Error


class ReferenceError(K3Error):
    """A request the reference cannot score (e.g. a sequence the golden pack does not hold)."""


@dataclass
class Expected:
    """k3's distribution of the token after some context."""

    top_ids: list[int]  # most likely first
    top_logprobs: list[float]
    full: torch.Tensor | None = None  # [V] float64 log-probabilities, when the whole row is known

    def logprob(self, token: int) -> float | None:
        if self.full is not None:
            return float(self.full[token])
        for t, v in zip(self.top_ids, self.top_logprobs, strict=True):
            if t == token:
                return v
        return None

    @property
    def best(self) -> float:
        return self.top_logprobs[0]


class CheckpointReference:
    """Every position computed by the model in memory (fp32), one forward per scored sequence."""

    def __init__(self, model: torch.nn.Module, top: int = 20) -> None:
        self.model = model.eval()
        self.top = top
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}

    def _logprobs(self, ids: list[int]) -> torch.Tensor:
        """[T, V] float64 log-softmax of the logits after each prefix of ids (row p: after ids[:p + 1])."""
        key = tuple(ids)
        if key not in self._memo:
            with torch.no_grad():
                logits = self.model(torch.tensor([ids]))[0]
            self._memo = {key: logits.double().log_softmax(-1)}  # the last sequence only: bounded memory
        return self._memo[key]

    def expect(self, ids: list[int], positions: list[int]) -> list[Expected]:
        """For each p in positions (1 <= p <= len(ids)): the distribution of the token after ids[:p]."""
        if not positions:
            return []
        rows = self._logprobs(ids[: max(positions)])
        out = []
        for p in positions:
            row = rows[p - 1]
            top = row.topk(min(self.top, row.numel()))
            out.append(Expected(top.indices.tolist(), top.values.tolist(), row))
        return out


class GoldenReference:
    """Distributions read from a golden pack: the sequences it holds (prompt + greedy continuation) and
    any prefix of them; only their top-20 are known."""

    def __init__(self, sequences: list[tuple[list[int], torch.Tensor, torch.Tensor]]) -> None:
        # (ids [T], top ids [T, 20], top logprobs [T, 20]); row p: after ids[:p + 1]
        self.sequences = sequences

    def expect(self, ids: list[int], positions: list[int]) -> list[Expected]:
        if not positions:
            return []
        need = max(positions)
        for seq, top_ids, top_lp in self.sequences:
            if len(seq) >= need and seq[:need] == ids[:need]:
                return [Expected(top_ids[p - 1].tolist(), top_lp[p - 1].double().tolist()) for p in positions]
        raise ReferenceError(f"the golden pack holds no sequence starting with these {need} tokens")
