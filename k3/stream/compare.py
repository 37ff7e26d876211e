"""`k3 stream compare OUT OTHER.safetensors`: k3's streamed logits against another engine's.

The format (docs/stream.md): a safetensors file with `logits` float [P, V] (the last position of each
prompt) or [P, T, V] (every position, rows right-padded), and, for the 3-D form, `lengths` int [P] (real
positions per prompt; without it every row is taken as full). Any float dtype; compared in float64.

Per prompt: max and mean |dlogit|, KL(k3 || other) (mean and max over positions), top-1 agreement
(fraction of positions), top-5 agreement (mean overlap of the two top-5 sets / 5), the first position where
|dlogit| exceeds the tolerance and the first where the top-1 ids differ. When one file has every position
and the other only the last, the last positions are compared.

llama.cpp's `--kl-divergence-base` files (k3.stream.llama_logits) hold 16-bit log-probabilities of the
second half of each chunk: those positions are compared, as log-probabilities (k3's log-softmax), and a
value llama.cpp clamped (at the max - 16 floor) counts as a difference only where k3's is above the floor.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from k3.checkpoint import open_checkpoint
from k3.errors import K3Error
from k3.stream.llama_logits import is_kld, read_kld


class CompareError(K3Error):
    """Logits files that cannot be compared (missing tensors, other shapes or vocabularies)."""


@dataclass
class PromptComparison:
    prompt: int
    positions: int
    max_abs: float
    mean_abs: float
    kl_mean: float
    kl_max: float
    top1: float
    top5: float
    first_over_tolerance: int | None  # position index, None if none
    first_top1_mismatch: int | None

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Logits:
    """One file's logits, or log-probabilities, and which positions it has."""

    values: torch.Tensor  # [P, V] (the last position of each prompt) or [P, T, V]
    lengths: torch.Tensor | None = None  # [P] real positions of each prompt ([P, T, V] only)
    start: int = 0  # positions before it are absent (llama.cpp stores only the second half of each chunk)
    stop: int | None = None  # positions from it on are absent (llama.cpp: the last one of each chunk)
    floor: torch.Tensor | None = None  # [P, T]: values at or below it say only "at most this"
    logprobs: bool = False  # values are log-probabilities: compared with the other file's log-softmax
    input_ids: torch.Tensor | None = None  # [P, T], to check that both files saw the same prompts


def read_logits(path: Path) -> Logits:
    """A logits file: k3's format (or OUT/logits.safetensors of a folder), or llama.cpp's
    --kl-divergence-base file (k3.stream.llama_logits)."""
    path = Path(path)
    if path.is_dir():
        path = path / "logits.safetensors"
    if not path.is_file():
        raise CompareError(f"{path}: no such logits file")
    if is_kld(path):
        kld = read_kld(path)
        P = kld["input_ids"].shape[0]
        return Logits(
            kld["logprobs"],
            torch.full((P,), kld["input_ids"].shape[1]),
            kld["start"],
            kld["stop"],
            kld["floor"],
            logprobs=True,
            input_ids=kld["input_ids"],
        )
    with open_checkpoint(path) as f:
        if "logits" not in f:
            raise CompareError(f"{path}: no tensor 'logits' (tensors: {', '.join(f.names[:8])})")
        logits = f.read("logits").clone()
        lengths = f.read("lengths").clone().long() if "lengths" in f else None
        input_ids = f.read("input_ids").clone().long() if "input_ids" in f else None
    if logits.dim() not in (2, 3) or not logits.is_floating_point():
        raise CompareError(
            f"{path}: 'logits' must be float [P, V] or [P, T, V], got {logits.dtype} {list(logits.shape)}"
        )
    if lengths is not None and lengths.shape != (logits.shape[0],):
        raise CompareError(f"{path}: 'lengths' must be [P] = [{logits.shape[0]}], got {list(lengths.shape)}")
    return Logits(logits, lengths, input_ids=input_ids)


def _length(f: Logits, p: int) -> int:
    """Prompt p's tokens in a 3-D file."""
    return int(f.lengths[p]) if f.lengths is not None else f.values.shape[1]


def _last(f: Logits, p: int) -> torch.Tensor:
    """Prompt p's last position [1, V]."""
    return f.values[p, _length(f, p) - 1][None] if f.values.dim() == 3 else f.values[p][None]


def _check_prompts(a: Logits, b: Logits, p: int, stop: int | None = None) -> None:
    """Where both files name their token ids, prompt p's must agree up to `stop` (default: the whole prompt,
    whose lengths must then agree too), position 0 aside: llama.cpp puts BOS there."""
    if a.input_ids is None or b.input_ids is None:
        return
    if stop is None:
        n, m = (int(f.lengths[p]) if f.lengths is not None else f.input_ids.shape[1] for f in (a, b))
        if n != m:
            raise CompareError(f"prompt {p}: {n} tokens in one file, {m} in the other: not the same prompts")
        stop = n
    x, y = a.input_ids[p, 1:stop], b.input_ids[p, 1:stop]
    n = min(len(x), len(y))
    differ = (x[:n] != y[:n]).nonzero()
    if len(differ):
        j = int(differ[0, 0]) + 1
        raise CompareError(f"prompt {p}: the files' token ids differ at position {j}: not the same prompts")


def compare_logits(ours: Logits, other: Logits, tolerance: float = 1e-3) -> list[PromptComparison]:
    a, b = ours.values, other.values
    if a.shape[0] != b.shape[0]:
        raise CompareError(f"the files hold {a.shape[0]} and {b.shape[0]} prompts")
    if a.shape[-1] != b.shape[-1]:
        raise CompareError(f"the vocabularies differ: {a.shape[-1]} and {b.shape[-1]} logits per position")
    as_logprobs = ours.logprobs or other.logprobs
    if as_logprobs and (a.dim() != 3 or b.dim() != 3):
        raise CompareError(
            "llama.cpp's file holds the positions n_ctx/2 .. n_ctx-2 of each chunk, not the last one: "
            "run `k3 stream` with --all-positions"
        )
    out = []
    for p in range(a.shape[0]):
        if a.dim() == 3 and b.dim() == 3:
            n = _length(ours, p)
            if _length(other, p) != n:
                raise CompareError(f"prompt {p}: {n} positions in one file, {_length(other, p)} in the other")
            start = max(ours.start, other.start)
            stop = min([n, *(f.stop for f in (ours, other) if f.stop is not None)])
            _check_prompts(ours, other, p, stop)
            x, y = a[p, start:stop].double(), b[p, start:stop].double()
            floor = other.floor[p, start:stop, None].double() if other.floor is not None else None
        else:  # one file has the last positions only: compare those
            _check_prompts(ours, other, p)
            start, floor = 0, None
            x, y = _last(ours, p).double(), _last(other, p).double()
        out.append(_compare(p, start, x, y, floor, as_logprobs, tolerance))
    return out


def _compare(
    p: int,
    start: int,
    x: torch.Tensor,
    y: torch.Tensor,
    floor: torch.Tensor | None,
    as_logprobs: bool,
    tolerance: float,
) -> PromptComparison:
    """Prompt p's positions x, y [T, V] from `start` (float64)."""
    lx, ly = x.log_softmax(-1), y.log_softmax(-1)
    if as_logprobs:
        x, y = lx, y  # the other file holds log-probabilities already (llama.cpp's, quantized)
    d = (x - y).abs()  # [T, V]
    if floor is not None:  # where the other says only "at most the floor", ours must not exceed it
        d = torch.where(y <= floor, (x - floor).clamp(min=0), d)
    kl = (lx.exp() * (lx - ly)).sum(-1)  # [T]
    top1 = x.argmax(-1) == y.argmax(-1)  # [T]
    k = min(5, x.shape[-1])
    tx, ty = x.topk(k, -1).indices, y.topk(k, -1).indices
    overlap = (tx[:, :, None] == ty[:, None, :]).any(-1).sum(-1).double() / k  # [T]
    over = (d.amax(-1) > tolerance).nonzero()
    parted = (~top1).nonzero()
    return PromptComparison(
        prompt=p,
        positions=x.shape[0],
        max_abs=float(d.max()),
        mean_abs=float(d.mean()),
        kl_mean=float(kl.mean()),
        kl_max=float(kl.max()),
        top1=float(top1.double().mean()),
        top5=float(overlap.mean()),
        first_over_tolerance=start + int(over[0, 0]) if len(over) else None,
        first_top1_mismatch=start + int(parted[0, 0]) if len(parted) else None,
    )
