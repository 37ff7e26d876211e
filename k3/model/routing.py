"""Routing reported by the model: what every MoE router chose, and replaying given choices.

    with record_routing(model) as trace:                 # every forward inside is recorded
        model(ids)
    trace.layers                                         # MoE layer indices, e.g. [1, 2, ..., 8]
    trace.indices(3)                                     # [N, k] expert ids, rows of all forwards in order
    trace.scores(3), trace.weights(3)                    # [N, E] sigmoid scores, [N, k] mixing weights

    with route_with(model, {3: indices3, ...}):          # routers use these choices instead of their own
        model(ids)                                       # (routing replay: train on the rollout's experts)
    ties = near_ties(model, trace, below=1e-5)           # rows whose k-th and (k+1)-th scores nearly tie
    with runner_up_at(model, ties[:1]):                  # the other outcome of such a tie
        model(ids)

Rows are the routers' input rows: the tokens of one forward flattened as [B * T] in row-major order, then
the next forward's. Both use forward hooks on `K3ForCausalLM.routers()`; nothing here recomputes a score.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from k3.model.moe import Router, Routing


class RoutingTrace:
    """Per MoE layer, the routing of every forward recorded (detached; scores/weights unless dropped)."""

    def __init__(self, layers: list[int], keep_scores: bool, keep_weights: bool) -> None:
        self.layers = layers
        self.keep_scores, self.keep_weights = keep_scores, keep_weights
        self._indices: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
        self._scores: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
        self._weights: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}

    def _record(self, layer: int, routing: Routing) -> None:
        self._indices[layer].append(routing.indices.detach())
        if self.keep_scores:
            self._scores[layer].append(routing.scores.detach())
        if self.keep_weights:
            self._weights[layer].append(routing.weights.detach())

    @staticmethod
    def _cat(calls: list[torch.Tensor], what: str, kept: bool) -> torch.Tensor:
        if not kept:
            raise ValueError(f"record_routing was asked not to keep {what}")
        if not calls:
            raise ValueError("no forward ran inside record_routing")
        return torch.cat(calls)

    def calls(self, layer: int) -> int:
        """How many forwards this layer's router ran while recording."""
        return len(self._indices[layer])

    def indices(self, layer: int) -> torch.Tensor:
        """[N, k] chosen expert ids (int64)."""
        return self._cat(self._indices[layer], "indices", True)

    def scores(self, layer: int) -> torch.Tensor:
        """[N, E] unbiased sigmoid scores (fp32)."""
        return self._cat(self._scores[layer], "scores", self.keep_scores)

    def weights(self, layer: int) -> torch.Tensor:
        """[N, k] the weights the chosen experts' outputs were mixed with (fp32, scaled)."""
        return self._cat(self._weights[layer], "weights", self.keep_weights)


@contextmanager
def record_routing(model: nn.Module, *, scores: bool = True, weights: bool = True) -> Iterator[RoutingTrace]:
    """Record, per MoE layer, the routing of every forward inside the block (`scores=False` and
    `weights=False` keep only the expert ids: [N, k] int64 instead of [N, E] fp32 per layer)."""
    routers = model.routers()  # type: ignore[operator]
    trace = RoutingTrace(sorted(routers), scores, weights)
    hooks = [
        router.register_forward_hook(lambda _m, _a, out, layer=layer: trace._record(layer, out))
        for layer, router in routers.items()
    ]
    try:
        yield trace
    finally:
        for hook in hooks:
            hook.remove()


@contextmanager
def route_with(model: nn.Module, indices: Mapping[int, torch.Tensor]) -> Iterator[None]:
    """Inside the block, the router of each layer in `indices` uses the given choices ([N, k] per layer,
    consumed row by row across forwards) instead of its own; the mixing weights are the router's own
    scores at those experts, normalised as usual. Layers not given route as usual. Every given row must be
    used by the end of the block."""
    routers = model.routers()  # type: ignore[operator]
    unknown = sorted(set(indices) - set(routers))
    if unknown:
        raise ValueError(f"route_with: layers {unknown} have no router (MoE layers: {sorted(routers)})")
    used = dict.fromkeys(indices, 0)

    def replace(layer: int, router: Router, out: Routing) -> Routing:
        given, start = indices[layer], used[layer]
        rows = out.indices.shape[0]
        if start + rows > given.shape[0]:
            raise ValueError(
                f"route_with: layer {layer} was given {given.shape[0]} rows of expert choices, "
                f"the forwards asked for {start + rows}"
            )
        if given.shape[1] != out.indices.shape[1]:
            raise ValueError(f"route_with: layer {layer} needs {out.indices.shape[1]} experts per row")
        chosen = given[start : start + rows].to(out.indices.device, torch.long)
        used[layer] = start + rows
        return router.routing(out.scores, chosen)

    hooks = [
        routers[layer].register_forward_hook(
            lambda m, _a, out, layer=layer: replace(layer, m, out)  # a returned value replaces the output
        )
        for layer in indices
    ]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
    left = {layer: indices[layer].shape[0] - n for layer, n in used.items() if n != indices[layer].shape[0]}
    if left:
        raise ValueError(f"route_with: rows of expert choices left unused, per layer: {left}")


@dataclass(frozen=True)
class NearTie:
    """A row where the router's last chosen expert beat the runner-up by less than some gap: an engine
    whose arithmetic differs by rounding may choose the runner-up there, and part from then on."""

    layer: int
    row: int
    gap: float  # biased score of the k-th choice minus the (k+1)-th's


def near_ties(model: nn.Module, trace: RoutingTrace, below: float) -> list[NearTie]:
    """The rows of a recorded trace (scores kept) whose top-k margin is below `below`, smallest first.
    Routers that choose within groups are left out (their runner-up depends on the group choice)."""
    ties = []
    for layer, router in model.routers().items():  # type: ignore[operator]
        if router.num_groups > 1 or router.top_k >= router.weight.shape[0]:
            continue
        biased = trace.scores(layer) + router.e_score_correction_bias.float()
        top = biased.topk(router.top_k + 1, dim=-1).values  # [N, k + 1]
        gaps = top[:, -2] - top[:, -1]
        ties += [NearTie(layer, int(row), float(gaps[row])) for row in torch.nonzero(gaps < below).flatten()]
    return sorted(ties, key=lambda t: t.gap)


@contextmanager
def runner_up_at(model: nn.Module, ties: list[NearTie]) -> Iterator[None]:
    """Inside the block, the routers choose the runner-up instead of their last (k-th) choice at the given
    rows (rows of each forward, numbered from 0 in every call): the other outcome of a near-tie."""
    routers = model.routers()  # type: ignore[operator]
    rows: dict[int, list[int]] = {}
    for tie in ties:
        rows.setdefault(tie.layer, []).append(tie.row)

    def swap(router: Router, out: Routing, flipped: list[int]) -> Routing:
        indices = out.indices.clone()
        biased = out.scores + router.e_score_correction_bias.float()
        for row in flipped:
            if row < indices.shape[0]:
                order = biased[row].topk(router.top_k + 1).indices  # [k + 1], best first
                indices[row] = torch.cat([order[: router.top_k - 1], order[router.top_k :]])
        return router.routing(out.scores, indices)

    hooks = [
        routers[layer].register_forward_hook(lambda m, _a, out, flipped=flipped: swap(m, out, flipped))
        for layer, flipped in rows.items()
    ]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
