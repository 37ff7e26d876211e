"""Training checkpoints: optimizer state keyed by parameter name; several writers (threads standing in for
ranks) write one checkpoint in the sharded layout that loads into a model holding every part."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from k3.train.state import Writers, list_checkpoints, load_training_state, save_training_state


def _model(parts: list[str], seed: int = 0) -> nn.ModuleDict:
    torch.manual_seed(seed)
    return nn.ModuleDict({name: nn.Linear(4, 3) for name in parts})


def _stepped(parts: list[str]) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model(parts)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model.zero_grad()
        sum(m(torch.ones(2, 4)).square().sum() for m in model.values()).backward()
        optimizer.step()
    return model, optimizer


def test_two_writers_write_one_checkpoint_that_loads_whole(tmp_path):
    """'rank' r holds the replicated `a` and its own `e{r}`; a model holding a, e0 and e1 loads every
    part, weights and AdamW moments, as the rank that wrote it held it."""
    barrier = threading.Barrier(2)
    ranks = [_stepped(["a", f"e{r}"]) for r in range(2)]

    def write(r: int) -> None:
        writers = Writers(r, 2, barrier.wait, lambda name: name.startswith("a."))
        save_training_state(tmp_path, 2, *ranks[r], {"tokens": 8}, writers=writers)

    threads = [threading.Thread(target=write, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    checkpoint = list_checkpoints(tmp_path)[-1][1]
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["a.weight"] == index["e0.weight"] == "model-00001-of-00002.safetensors"
    assert index["e1.weight"] == "model-00002-of-00002.safetensors"
    assert set(load_file(str(checkpoint / "optimizer-00002-of-00002.safetensors"))) == {
        "state.e1.weight.step", "state.e1.weight.exp_avg", "state.e1.weight.exp_avg_sq",
        "state.e1.bias.step", "state.e1.bias.exp_avg", "state.e1.bias.exp_avg_sq",
    }  # fmt: skip
    fresh = _model(["a", "e0", "e1"], seed=5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    meta = load_training_state(checkpoint, fresh, fresh_opt)
    assert meta["step"] == 2 and meta["tokens"] == 8
    for r, (model, opt) in enumerate(ranks):  # each part as its writer held it
        for name in ("a", f"e{r}"):
            for p, q in zip(model[name].parameters(), fresh[name].parameters(), strict=True):
                assert torch.equal(p, q)
                for key in ("exp_avg", "exp_avg_sq", "step"):
                    assert torch.equal(opt.state[p][key], fresh_opt.state[q][key])


def test_optimizer_state_of_no_parameter_is_an_error(tmp_path):
    model, optimizer = _stepped(["a"])
    checkpoint = save_training_state(tmp_path, 1, model, optimizer, {})
    tensors = load_file(str(checkpoint / "optimizer.safetensors"))
    tensors["state.ghost.weight.exp_avg"] = torch.zeros(3, 4)
    save_file(tensors, str(checkpoint / "optimizer.safetensors"))
    with pytest.raises(KeyError, match="state.ghost.weight.exp_avg belongs to no parameter"):
        load_training_state(checkpoint, *(_stepped(["a"])))
