"""record_routing and route_with against routing recomputed here from each MoE layer's input.

The reference takes the hidden states that enter each MoE block (a pre-hook on the block, not on the router)
and computes the spec's routing itself: fp64 sigmoid scores, top-k of score + bias, weights renormalised
and scaled. The bias is planted non-zero so that a router ignoring it would be caught.
"""

from __future__ import annotations

import pytest
import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.model.routing import near_ties, record_routing, route_with, runner_up_at


def model_with_planted_bias(preset: str) -> K3ForCausalLM:
    model = K3ForCausalLM.from_config(K3Config.preset(preset), seed=3).eval()
    gen = torch.Generator().manual_seed(11)
    for router in model.routers().values():
        router.e_score_correction_bias.copy_(0.05 * torch.randn(router.weight.shape[0], generator=gen))
    return model


def moe_inputs(model: K3ForCausalLM, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """The hidden states [N, hidden] entering each MoE block during one forward."""
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        layer.block_sparse_moe.register_forward_pre_hook(
            lambda _m, args, i=layer.index: seen.__setitem__(i, args[0].reshape(-1, args[0].shape[-1]))
        )
        for layer in model.model.layers
        if layer.is_moe
    ]
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    return seen


def reference_routing(model: K3ForCausalLM, layer: int, x: torch.Tensor):
    cfg = model.config
    router = model.routers()[layer]
    scores = torch.sigmoid(x.double() @ router.weight.double().t())  # [N, E]
    biased = scores + router.e_score_correction_bias.double()
    indices = biased.topk(cfg.num_experts_per_token, dim=-1).indices  # [N, k]
    chosen = scores.gather(1, indices)
    return scores, indices, chosen / chosen.sum(-1, keepdim=True) * cfg.routed_scaling_factor


@pytest.mark.parametrize("preset", ["tiny", "mini"])
def test_record_routing_equals_routing_recomputed_from_the_moe_inputs(preset):
    model = model_with_planted_bias(preset)
    assert model.config.num_expert_group == 1  # the reference has no group-limited routing
    gen = torch.Generator().manual_seed(0)
    first = torch.randint(0, model.config.vocab_size, (2, 7), generator=gen)
    second = torch.randint(0, model.config.vocab_size, (1, 5), generator=gen)
    inputs = {}
    for ids in (first, second):
        for layer, x in moe_inputs(model, ids).items():
            inputs.setdefault(layer, []).append(x)
    with torch.no_grad(), record_routing(model) as trace:
        model(first)
        model(second)
    assert (
        trace.layers
        == sorted(model.routers())
        == [i for i, plan in enumerate(model.config.layer_plan) if plan.ffn.name != "DENSE"]
    )
    for layer in trace.layers:
        assert trace.calls(layer) == 2
        scores, indices, weights = reference_routing(model, layer, torch.cat(inputs[layer]))
        assert trace.indices(layer).shape == (2 * 7 + 5, model.config.num_experts_per_token)
        assert torch.equal(trace.indices(layer), indices)
        torch.testing.assert_close(trace.scores(layer).double(), scores, rtol=0, atol=1e-6)
        torch.testing.assert_close(trace.weights(layer).double(), weights, rtol=0, atol=1e-6)


def test_record_routing_keeps_only_indices_when_asked():
    model = model_with_planted_bias("tiny")
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), record_routing(model, scores=False, weights=False) as trace:
        model(ids)
    layer = trace.layers[0]
    assert trace.indices(layer).shape == (6, model.config.num_experts_per_token)
    with pytest.raises(ValueError, match="not to keep scores"):
        trace.scores(layer)
    with pytest.raises(ValueError, match="not to keep weights"):
        trace.weights(layer)


@pytest.mark.parametrize("preset", ["tiny", "mini"])
def test_route_with_recorded_choices_reproduces_the_logits_bit_for_bit(preset):
    model = model_with_planted_bias(preset)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), record_routing(model, scores=False, weights=False) as trace:
        expected = model(ids)
    recorded = {layer: trace.indices(layer) for layer in trace.layers}
    with torch.no_grad(), route_with(model, recorded):
        replayed = model(ids)
    assert torch.equal(replayed, expected)


def test_route_with_other_choices_changes_only_the_moe_output():
    model = model_with_planted_bias("tiny")
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(4))
    layer = sorted(model.routers())[1]
    moe = model.model.layers[layer].block_sparse_moe
    seen = {}
    hook = moe.register_forward_hook(lambda _m, args, out: seen.update(x=args[0], y=out))
    with torch.no_grad(), record_routing(model) as trace:
        model(ids)
    base_x, base_y = seen["x"], seen["y"]
    own = trace.indices(layer)
    other = (own + 1) % cfg.num_experts  # a different, still valid choice for every token
    with torch.no_grad(), route_with(model, {layer: other}), record_routing(model) as replay:
        model(ids)
    hook.remove()
    # everything before the MoE output of `layer` is unchanged: its input, its scores, earlier layers
    assert torch.equal(seen["x"], base_x)
    assert torch.equal(replay.scores(layer), trace.scores(layer))
    assert torch.equal(replay.indices(layer), other)
    for earlier in [i for i in trace.layers if i < layer]:
        assert torch.equal(replay.indices(earlier), trace.indices(earlier))
    # the MoE output is the spec's mixture over the given experts, recomputed here
    x = seen["x"].reshape(-1, cfg.hidden_size)
    scores, _, _ = reference_routing(model, layer, x)
    p = scores.gather(1, other)
    p = (p / p.sum(-1, keepdim=True) * cfg.routed_scaling_factor).float()
    z = moe.routed_expert_down_proj(x)
    mixed = sum(
        p[:, j : j + 1] * torch.stack([moe.experts[e](z[n]) for n, e in enumerate(other[:, j])])
        for j in range(other.shape[1])
    )
    expected = moe.routed_expert_up_proj(moe.routed_expert_norm(mixed)) + moe.shared_experts(x)
    with torch.no_grad():
        torch.testing.assert_close(seen["y"].reshape(-1, cfg.hidden_size), expected, rtol=0, atol=1e-5)
    assert (seen["y"] - base_y).abs().max() > 1e-4


def test_route_with_checks_what_it_is_given():
    model = model_with_planted_bias("tiny")
    ids = torch.zeros(1, 4, dtype=torch.long)
    k = model.config.num_experts_per_token
    with pytest.raises(ValueError, match="have no router"):
        with route_with(model, {0: torch.zeros(4, k, dtype=torch.long)}):
            pass
    layer = sorted(model.routers())[0]
    with pytest.raises(ValueError, match="was given 3 rows"), torch.no_grad():
        with route_with(model, {layer: torch.zeros(3, k, dtype=torch.long)}):
            model(ids)
    with pytest.raises(ValueError, match="left unused"), torch.no_grad():
        with route_with(model, {layer: torch.zeros(6, k, dtype=torch.long)}):
            model(ids)


def test_near_ties_are_the_rows_whose_top_k_margin_is_below_the_gap():
    model = model_with_planted_bias("mini")
    k = model.config.num_experts_per_token
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), record_routing(model) as trace:
        model(ids)
    below = 0.02  # wide enough that a 40-token prompt has several
    ties = near_ties(model, trace, below)
    expected = set()
    for layer, x in moe_inputs(model, ids).items():  # the slow loop: sort every row's biased scores
        bias = model.routers()[layer].e_score_correction_bias
        for row in range(x.shape[0]):
            biased = sorted((trace.scores(layer)[row] + bias).tolist(), reverse=True)
            if biased[k - 1] - biased[k] < below:
                expected.add((layer, row))
    assert expected and {(t.layer, t.row) for t in ties} == expected
    assert [t.gap for t in ties] == sorted(t.gap for t in ties)


def test_runner_up_at_is_route_with_the_runner_up_swapped_in_at_that_row():
    model = model_with_planted_bias("mini")
    k = model.config.num_experts_per_token
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), record_routing(model) as trace:
        base = model(ids)
    tie = near_ties(model, trace, 0.02)[0]
    router = model.routers()[tie.layer]
    order = (trace.scores(tie.layer)[tie.row] + router.e_score_correction_bias).argsort(descending=True)
    swapped = trace.indices(tie.layer).clone()
    swapped[tie.row] = torch.cat([order[: k - 1], order[k : k + 1]])  # k-th choice out, runner-up in
    with torch.no_grad(), route_with(model, {tie.layer: swapped}):
        replayed = model(ids)
    with torch.no_grad(), runner_up_at(model, [tie]):
        flipped = model(ids)
    assert torch.equal(flipped, replayed)
    # rows before the tie keep their values (to rounding: the experts' batches of rows changed size), the
    # tie's row and later ones change
    assert (flipped[0, : tie.row] - base[0, : tie.row]).abs().max() < 1e-5
    assert (flipped[0, tie.row :] - base[0, tie.row :]).abs().max() > 1e-2
