"""`k3 stream compare OUT OTHER.safetensors`: k3's streamed logits against another engine's.

The format (docs/stream.md): a safetensors file with `logits` float [P, V] (the last position of each
prompt) or [P, T, V] (every position, rows right-padded), and, for the 3-D form, `lengths` int [P] (real
positions per prompt; without it every row is taken as full). Any float dtype; compared in float64.

Per prompt: max and mean |dlogit|, KL(k3 || other) (mean and max over positions), top-1 agreement
(fraction of positions), top-5 agreement (mean overlap of the two top-5 sets / 5), the first position where
|dlogit| exceeds the tolerance and the first where the top-1 ids differ. When one file has every position
and the other only the last, the last positions are compared.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from k3.checkpoint import open_checkpoint
from k3.errors import K3Error


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


def read_logits(path: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits [P, V] or [P, T, V], lengths [P] or None) of a logits file, or of OUT/logits.safetensors."""
    path = Path(path)
    if path.is_dir():
        path = path / "logits.safetensors"
    if not path.is_file():
        raise CompareError(f"{path}: no such logits file")
    with open_checkpoint(path) as f:
        if "logits" not in f:
            raise CompareError(f"{path}: no tensor 'logits' (tensors: {', '.join(f.names[:8])})")
        logits = f.read("logits").clone()
        lengths = f.read("lengths").clone().long() if "lengths" in f else None
    if logits.dim() not in (2, 3) or not logits.is_floating_point():
        raise CompareError(
            f"{path}: 'logits' must be float [P, V] or [P, T, V], got {logits.dtype} {list(logits.shape)}"
        )
    if lengths is not None and lengths.shape != (logits.shape[0],):
        raise CompareError(f"{path}: 'lengths' must be [P] = [{logits.shape[0]}], got {list(lengths.shape)}")
    return logits, lengths


def _rows(logits: torch.Tensor, lengths: torch.Tensor | None, p: int, last_only: bool) -> torch.Tensor:
    """Prompt p's positions [T_p, V] (its last position only when `last_only`)."""
    if logits.dim() == 2:
        return logits[p : p + 1]
    n = int(lengths[p]) if lengths is not None else logits.shape[1]
    return logits[p, n - 1 : n] if last_only else logits[p, :n]


def compare_logits(
    ours: tuple[torch.Tensor, torch.Tensor | None],
    other: tuple[torch.Tensor, torch.Tensor | None],
    tolerance: float = 1e-3,
) -> list[PromptComparison]:
    (a, a_len), (b, b_len) = ours, other
    if a.shape[0] != b.shape[0]:
        raise CompareError(f"the files hold {a.shape[0]} and {b.shape[0]} prompts")
    if a.shape[-1] != b.shape[-1]:
        raise CompareError(f"the vocabularies differ: {a.shape[-1]} and {b.shape[-1]} logits per position")
    last_only = a.dim() != b.dim()
    out = []
    for p in range(a.shape[0]):
        x, y = _rows(a, a_len, p, last_only).double(), _rows(b, b_len, p, last_only).double()
        if x.shape != y.shape:
            raise CompareError(f"prompt {p}: {x.shape[0]} positions in one file, {y.shape[0]} in the other")
        d = (x - y).abs()  # [T, V]
        lx, ly = x.log_softmax(-1), y.log_softmax(-1)
        kl = (lx.exp() * (lx - ly)).sum(-1)  # [T]
        top1 = x.argmax(-1) == y.argmax(-1)  # [T]
        k = min(5, x.shape[-1])
        tx, ty = x.topk(k, -1).indices, y.topk(k, -1).indices
        overlap = (tx[:, :, None] == ty[:, None, :]).any(-1).sum(-1).double() / k  # [T]
        over = (d.amax(-1) > tolerance).nonzero()
        parted = (~top1).nonzero()
        out.append(
            PromptComparison(
                prompt=p,
                positions=x.shape[0],
                max_abs=float(d.max()),
                mean_abs=float(d.mean()),
                kl_mean=float(kl.mean()),
                kl_max=float(kl.max()),
                top1=float(top1.double().mean()),
                top5=float(overlap.mean()),
                first_over_tolerance=int(over[0, 0]) if len(over) else None,
                first_top1_mismatch=int(parted[0, 0]) if len(parted) else None,
            )
        )
    return out
