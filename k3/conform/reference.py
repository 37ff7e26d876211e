"""k3's exact next-token distributions, the values an engine's returned logprobs are held against.

    ref = CheckpointReference(model, tokenizer)          # computed now, every position, full vocabulary
    ref = GoldenReference(pack)                          # read from a golden pack (k3.conform.golden): top-20
    rows = ref.expect(ids, positions)                    # [Expected] after ids[:p] for each p
    rows = ref.expect(ids, positions, images)            # ids holding those images' pads (`ref.sees_images`)

`Expected.logprob(token)` is the log-probability k3 gives `token` there (None when a golden pack did not keep
it: only its top-20 are stored).

Router near-ties: where a router's k-th choice beats the runner-up by less than `tie_gap` at some position,
an engine that computes the same model to rounding may pick the runner-up there, and its logprobs part from
k3's from then on without any bug in its state handling (seen on random-weight checkpoints: llama.cpp on
`mini`, docs/conform.md). A checkpoint reference then also computes the sequence with the other outcome of
each near-tie (`Expected.variants`, with what each assumes); the report holds a request against the variant
it agrees with best and says so.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path

import torch

from k3.engine.images import ImageInput
from k3.errors import K3Error
from k3.model.routing import NearTie, near_ties, record_routing, runner_up_at

# router margins below this are near-ties (sigmoid scores): llama.cpp on `mini` rounded to the runner-up
# at gaps of 1.2e-7, 1.1e-6, 5.8e-6 and 2.8e-5 (the last evaluating a prompt's end after restoring a state)
TIE_GAP = 1e-4
MAX_TIES = 3  # near-ties whose outcomes are combined (2^3 - 1 extra forwards at most); smaller gaps first


class ReferenceError(K3Error):
    """A request the reference cannot score (e.g. a sequence the golden pack does not hold)."""


@dataclass
class Expected:
    """k3's distribution of the token after some context."""

    top_ids: list[int]  # most likely first
    top_logprobs: list[float]
    full: torch.Tensor | None = None  # [V] float64 log-probabilities, when the whole row is known
    # the same position with other outcomes of router near-ties: (the ties flipped, that distribution)
    variants: list[tuple[tuple[NearTie, ...], Expected]] = field(default_factory=list)

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


Outcome = tuple[tuple[NearTie, ...], torch.Tensor]  # (the near-ties flipped, [len(rows), V] log-probs)


def pixel_inputs(images: Sequence[ImageInput]) -> dict:
    """The forward's keyword for a prompt's images (none for text)."""
    return {"images": [im.item for im in images]} if images else {}


@dataclass
class GoldenSequence:
    """One sequence of a golden pack; row p of its tables: the token after ids[:p + 1]."""

    ids: list[int]  # [T]
    top_ids: torch.Tensor  # [T, 20]
    top_logprobs: torch.Tensor  # [T, 20]
    images: list[str] = field(default_factory=list)  # content hashes of the images its pads hold, in order


def reference_model(ckpt: Path) -> torch.nn.Module:
    """The checkpoint's model in memory: with its vision tower when its config has one."""
    from k3.config import K3Config
    from k3.model import K3ForCausalLM, K3ForConditionalGeneration

    vision = K3Config.from_pretrained(ckpt).vision_config is not None
    return (K3ForConditionalGeneration if vision else K3ForCausalLM).from_pretrained(ckpt)


class CheckpointReference:
    """Every position computed by the model in memory (fp32), one forward per scored sequence, plus one per
    combination of outcomes of its router near-ties (at most MAX_TIES of them, the closest).

    The last `remember` requests' results are kept (least recently used dropped first): one is enough for a
    single run, whose scenarios repeat a request right after itself or not at all; a reference held against
    several servers of the same checkpoint keeps more, so that the sequences they agree on run once."""

    def __init__(self, model: torch.nn.Module, top: int = 20, tie_gap: float = TIE_GAP, remember: int = 1):
        if remember < 1:
            raise ValueError(f"remember must be at least 1, not {remember}")
        self.model = model.eval()
        self.top, self.tie_gap, self.remember = top, tie_gap, remember
        self.forwards = 0  # model forwards run so far (the memo's hits run none)
        self._memo: OrderedDict[tuple, list[Outcome]] = OrderedDict()

    @property
    def sees_images(self) -> bool:
        """Whether the model has a vision tower (a checkpoint with vision_config)."""
        return hasattr(self.model, "encode_images")

    def _forward(self, ids: list[int], rows: list[int], images: Sequence[ImageInput]) -> torch.Tensor:
        """[len(rows), V] float64 log-softmax of the logits at those rows (row p: after ids[:p + 1])."""
        self.forwards += 1
        return self.model(torch.tensor([ids]), **pixel_inputs(images))[0, rows].double().log_softmax(-1)

    def _outcomes(self, ids: list[int], rows: list[int], images: Sequence[ImageInput]) -> list[Outcome]:
        """Every outcome of the request's near-ties, k3's own routing first."""
        key = (*ids, -1, *rows, *(im.key for im in images))
        if key in self._memo:
            self._memo.move_to_end(key)
        else:
            with torch.no_grad():
                with record_routing(self.model, weights=False) as trace:
                    outcomes = [((), self._forward(ids, rows, images))]
                ties = near_ties(self.model, trace, self.tie_gap)[:MAX_TIES] if self.tie_gap > 0 else []
                for n in range(1, len(ties) + 1):
                    for flipped in combinations(ties, n):
                        with runner_up_at(self.model, list(flipped)):
                            outcomes.append((flipped, self._forward(ids, rows, images)))
            self._memo[key] = outcomes
            while len(self._memo) > self.remember:  # bounded memory
                self._memo.popitem(last=False)
        return self._memo[key]

    def expect(
        self, ids: list[int], positions: list[int], images: Sequence[ImageInput] = ()
    ) -> list[Expected]:
        """For each p in positions (1 <= p <= len(ids)): the distribution of the token after ids[:p];
        `images`: those whose pads ids holds, in order."""
        if not positions:
            return []
        if images and not self.sees_images:
            raise ReferenceError("the checkpoint has no vision tower (its config has no vision_config)")
        outcomes = self._outcomes(ids[: max(positions)], [p - 1 for p in positions], images)
        out = []
        for i, p in enumerate(positions):
            first = self._expected(outcomes[0][1][i])
            first.variants = [
                (flipped, self._expected(table[i]))
                for flipped, table in outcomes[1:]
                if min(t.row for t in flipped) < p  # the tie comes before this position
            ]
            out.append(first)
        return out

    def _expected(self, row: torch.Tensor) -> Expected:
        top = row.topk(min(self.top, row.numel()))
        return Expected(top.indices.tolist(), top.values.tolist(), row)


class GoldenReference:
    """Distributions read from a golden pack: the sequences it holds (prompt + greedy continuation, and the
    content hashes of the images whose pads it holds) and any prefix of them; only their top-20 are known."""

    def __init__(self, sequences: list[GoldenSequence]) -> None:
        self.sequences = sequences

    @property
    def sees_images(self) -> bool:
        """Whether the pack holds sequences with images (a checkpoint with a vision tower)."""
        return any(s.images for s in self.sequences)

    def expect(
        self, ids: list[int], positions: list[int], images: Sequence[ImageInput] = ()
    ) -> list[Expected]:
        if not positions:
            return []
        need, keys = max(positions), [im.key for im in images]
        for s in self.sequences:
            if len(s.ids) >= need and s.ids[:need] == ids[:need] and s.images == keys:
                return [
                    Expected(s.top_ids[p - 1].tolist(), s.top_logprobs[p - 1].double().tolist())
                    for p in positions
                ]
        with_images = f" and these {len(keys)} images" if keys else ""
        raise ReferenceError(
            f"the golden pack holds no sequence starting with these {need} tokens{with_images}"
        )
