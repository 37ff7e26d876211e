"""Routed experts sharded by id: each rank holds only the experts it is home to (weights, gradients and,
through the optimizer built over its parameters, optimizer state); everything else is replicated.

    model = sharded_model(cfg, seed=0, rank=r, world=R)   # the weights `k3 init` writes, home experts only
    shard_experts(model, r, R)                            # or: drop the other ranks' experts of a full model
    is_expert_name("model.layers.3.block_sparse_moe.experts.5.w1.weight")  # True

Expert `e` of every MoE layer lives on rank `e // (E / R)` (k3.dist.planner.home_of). The other entries
of a layer's `experts` list become `RemoteExpert`s: no parameters, so `model.state_dict()`,
`model.parameters()` and everything built from them (the optimizer, checkpoints) hold this rank's experts
only, under their global names (`experts.<id>.`). Calling one is a bug: the expert-parallel dispatch
(k3.dist.moe) sends its pairs to a rank that holds it, and replicas run on shipped weights.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.config import K3Config
from k3.dist.planner import home_of
from k3.model import K3ForCausalLM
from k3.model.moe import MoE, RoutedExpert
from k3.model.on_demand import expert_of as layer_expert_of
from k3.model.on_demand import experts_on_demand


class RemoteExpert(nn.Module):
    """The place of an expert that another rank (its home) holds."""

    def __init__(self, expert: int, home: int) -> None:
        super().__init__()
        self.expert, self.home = expert, home

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"expert {self.expert} lives on rank {self.home}; this rank cannot run it")


def is_expert_name(name: str) -> bool:
    """Whether a model tensor name is a routed expert's (sharded) rather than a replicated one's."""
    return layer_expert_of(name) is not None


def expert_of(name: str) -> int | None:
    """The expert id in a routed expert's tensor name, else None."""
    found = layer_expert_of(name)
    return None if found is None else found[1]


def moe_layers(model: nn.Module) -> list[MoE]:
    return [layer.block_sparse_moe for layer in model.model.layers if layer.is_moe]  # type: ignore[union-attr]


def moe_layer_indices(model: nn.Module) -> list[int]:
    return [layer.index for layer in model.model.layers if layer.is_moe]  # type: ignore[union-attr]


def shard_experts(model: nn.Module, rank: int, world: int) -> nn.Module:
    """Keep only the routed experts whose home is `rank` (of `world`); returns `model`. A model loaded
    from a URL forgets the others' on-demand reads too (its home experts are read when pairs need them:
    k3.dist.moe)."""
    on_demand = experts_on_demand(model)
    for layer, moe in zip(moe_layer_indices(model), moe_layers(model), strict=True):
        homes = home_of(len(moe.experts), world)
        for e, home in enumerate(homes.tolist()):
            if home != rank:
                moe.experts[e] = RemoteExpert(e, home)
                if on_demand is not None:
                    on_demand.forget(layer, e)
    return model


def sharded_model(
    cfg: K3Config, *, seed: int, rank: int, world: int, quantized_experts: bool | None = None
) -> K3ForCausalLM:
    """`K3ForCausalLM.from_config(cfg, seed=seed, ...)` with only `rank`'s routed experts: the same values
    (each tensor has its own generator, k3.model.init), and the other experts are never held (each is
    drawn and dropped, so the peak is this rank's model plus one tensor)."""
    from k3.model.init import random_tensors
    from k3.model.loading import assign_tensor, model_name

    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    shard_experts(model, rank, world)
    held = set(model.state_dict())
    for name, tensor in random_tensors(cfg, seed=seed, layers=model.num_layers):
        target = model_name(cfg, name)
        if target in held:
            assign_tensor(model, target, tensor.float() if tensor.is_floating_point() else tensor)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if quantized_experts is False:
        model.dequantize_experts()
    return model


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
