"""Routed experts read on first use: how `from_pretrained(url)` loads a model without fetching every expert.

A model loaded from a URL gets its dense weights at load time and its routed experts only when a router
first chooses them: each MoE layer's `load_experts` is called with the routing of a batch before the
dispatch (`MoE.forward`), and fetches, in one go and in file order, the experts of that batch not read
yet. Until then an expert's weights are meta tensors (no storage; a read of one fails loudly instead of
seeing zeros). The checkpoint is mirrored (`k3.checkpoint.mirror`), so the experts, like the dense
weights, are memory-mapped from a local sparse file: page cache, not anonymous memory.

    model = K3ForCausalLM.from_pretrained("http://host:8000")   # dense weights only
    model(ids)                                                  # + the experts these tokens chose
    experts_on_demand(model).missing                            # {(layer, expert), ...} not read yet
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import nn

from k3.checkpoint import Checkpoint

_EXPERTS = ".block_sparse_moe.experts."

Convert = Callable[[str, torch.Tensor], torch.Tensor]  # (published name, tensor read) -> the parameter


def expert_of(path: str) -> tuple[int, int] | None:
    """(layer, expert) of a routed expert's parameter path (`model.layers.3.block_sparse_moe.experts.7.w1.
    weight_packed`), None for any other tensor."""
    if _EXPERTS not in path:
        return None
    layer, rest = path.split(_EXPERTS)
    return int(layer.rsplit(".", 1)[1]), int(rest.split(".", 1)[0])


class ExpertsOnDemand:
    """The routed experts of `model` not read yet, and how to read them from `ckpt` (kept open)."""

    def __init__(
        self,
        model: nn.Module,
        ckpt: Checkpoint,
        tensors: dict[
            tuple[int, int], list[tuple[str, str, str]]
        ],  # (layer, e) -> (path, published, ckpt name)
        convert: Convert,
        assign: Callable[[str, torch.Tensor], None],
    ) -> None:
        self.ckpt, self.convert, self.assign = ckpt, convert, assign
        self._tensors = tensors
        self._lock = threading.Lock()
        layers = {layer for layer, _ in tensors}
        self._moes = {}  # layer -> its MoE, while some of its experts are not read
        for layer in model.model.layers:  # type: ignore[union-attr]
            if layer.index in layers:
                self._moes[layer.index] = layer.block_sparse_moe
                layer.block_sparse_moe.load_experts = lambda indices, i=layer.index: self.load(i, indices)
        model.experts_on_demand = self  # type: ignore[assignment]

    @property
    def missing(self) -> set[tuple[int, int]]:
        return set(self._tensors)

    def load(self, layer: int, indices: torch.Tensor) -> None:
        """Read the experts of `layer` that `indices` [N, k] name and that are not read yet."""
        wanted = [(layer, e) for e in indices.unique().tolist() if (layer, e) in self._tensors]
        if not wanted:
            return
        with self._lock:
            wanted = [key for key in wanted if key in self._tensors]  # another thread may have read some
            self.ckpt.prefetch([name for key in wanted for _, _, name in self._tensors[key]])
            for key in wanted:
                for path, published, name in self._tensors[key]:
                    self.assign(path, self.convert(published, self.ckpt.read(name)))
                del self._tensors[key]
            if layer in self._moes and not any(key[0] == layer for key in self._tensors):
                self._moes.pop(layer).load_experts = None  # all read: the MoE stops asking

    def forget(self, layer: int, expert: int) -> None:
        """Never read expert `expert` of `layer` (k3.dist: another rank holds it)."""
        with self._lock:
            self._tensors.pop((layer, expert), None)
            if layer in self._moes and not any(key[0] == layer for key in self._tensors):
                self._moes.pop(layer).load_experts = None


def experts_on_demand(model: nn.Module) -> ExpertsOnDemand | None:
    """The on-demand reader of a model loaded from a URL; None when every weight was read at load."""
    return getattr(model, "experts_on_demand", None)
