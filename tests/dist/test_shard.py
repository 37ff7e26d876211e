"""Routed experts sharded by id: a rank's model holds exactly its home experts, with the values of the
one-process model, and nothing it builds (parameters, optimizer state) reaches the other experts."""

from __future__ import annotations

import pytest
import torch

from k3.config import K3Config
from k3.dist.shard import RemoteExpert, expert_of, is_expert_name, parameter_bytes, sharded_model
from k3.model import K3ForCausalLM
from k3.train.optim import build_optimizer


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_holds_its_home_experts_with_the_one_process_values(world):
    cfg = K3Config.preset("tiny")
    full = K3ForCausalLM.from_config(cfg, seed=3, quantized_experts=False).state_dict()
    E = cfg.num_experts
    dense = {name for name in full if not is_expert_name(name)}
    total = 0
    for rank in range(world):
        model = sharded_model(cfg, seed=3, rank=rank, world=world, quantized_experts=False)
        state = model.state_dict()
        home = set(range(rank * E // world, (rank + 1) * E // world))
        assert {expert_of(n) for n in state} - {None} == home
        assert set(state) == dense | {n for n in full if expert_of(n) in home}
        for name, tensor in state.items():
            assert torch.equal(tensor, full[name]), name
        assert not any(t.is_meta for t in state.values())
        total += sum(t.numel() * t.element_size() for n, t in state.items() if is_expert_name(n))
        optimizer = build_optimizer(model, "muon", 1e-3, 0.1, (0.9, 0.95))
        held = {id(p) for p in model.parameters()}
        assert {id(p) for group in optimizer.param_groups for p in group["params"]} == held
        dense_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if not is_expert_name(n))
        assert parameter_bytes(model) == dense_bytes + sum(
            t.numel() * 4 for n, t in state.items() if is_expert_name(n)
        )
    # the experts' bytes over all ranks add up to one copy of them
    assert total == sum(t.numel() * t.element_size() for n, t in full.items() if is_expert_name(n))


def test_an_expert_held_elsewhere_cannot_run():
    model = sharded_model(K3Config.preset("tiny"), seed=0, rank=1, world=2)
    moe = next(layer.block_sparse_moe for layer in model.model.layers if layer.is_moe)
    assert isinstance(moe.experts[0], RemoteExpert)
    with pytest.raises(RuntimeError, match="expert 0 lives on rank 0"):
        moe.experts[0](torch.zeros(1, moe.experts[4].w1.in_features))
