"""A decode step's layers in one native call (k3.model.fused.decoder_layers, k3/ops/decode/_native_step.h)
equal the same layers run one by one (each mixer and FFN its own native call: the route that
tests/model/test_fused_decode.py ties to the general path), bit for bit: the logits of every step and every
tensor of the cache after them.

The reference route is the same model with `set_fast_decode(True, one_call=False)`. Counters show that the
one-call route really ran (`decoder_layers` once a step, no layer-by-layer kernel call, no general MoE
forward), so a silent fallback, which would equal the reference trivially, fails them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
from collections.abc import Callable

import pytest
import torch
from decode_steps import prefilled, with_bf16_weights
from kimi_linear_oracle import tiny_kimi_linear
from native_counting import Counting

import k3.model.attn_res as attn_res_module
import k3.model.fused as fused
import k3.model.norm as norm_module
from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.model.cache import ModelCache
from k3.model.moe import MoE
from k3.model.norm import Linear, RMSNorm
from k3.model.routing import record_routing
from k3.ops.decode.native import load_native

pytestmark = pytest.mark.skipif(
    load_native() is None and os.environ.get("CI") != "true", reason="native kernels unavailable (k3 doctor)"
)


@pytest.fixture
def counting(monkeypatch) -> Counting:
    """The native module, counting its calls; `general_moe` counts the MoE forwards of the general path,
    `python_picks` the chosen experts picked in Python (moe_experts_arguments) rather than in the loop."""
    counter = Counting(load_native())
    monkeypatch.setattr(fused, "load_native", lambda: counter)
    forward, pick = MoE.forward, fused.moe_experts_arguments

    def counted(self, *args, **kwargs):
        counter.calls["general_moe"] += 1
        return forward(self, *args, **kwargs)

    def picked(*args, **kwargs):
        counter.calls["python_picks"] += 1
        return pick(*args, **kwargs)

    monkeypatch.setattr(MoE, "forward", counted)
    monkeypatch.setattr(fused, "moe_experts_arguments", picked)
    return counter


@contextlib.contextmanager
def layer_by_layer(model: K3ForCausalLM):
    """The reference route: every step's layers one by one (k3.model.fused's per-layer functions)."""
    model.set_fast_decode(True, one_call=False)
    try:
        yield
    finally:
        model.set_fast_decode(True)


def cache_tensors(cache: ModelCache) -> list[torch.Tensor]:
    """Every tensor the cache holds, layer by layer (KDA: convolution tails and recurrent state; MLA:
    lengths, latents and rope keys)."""
    found = []
    for state in cache.layers:
        for field in dataclasses.fields(state):
            value = getattr(state, field.name)
            if isinstance(value, torch.Tensor):
                found.append(value)
    return found


def steps_both_ways(model: K3ForCausalLM, lengths: list[int], counting: Counting, steps: int = 4) -> tuple:
    """(logits of each step, cache tensors after) on the one-call route, then on the reference route, and
    the calls `counting` saw during the decode steps of both (not the prefills)."""
    results, during_steps = [], collections.Counter()
    for route in (contextlib.nullcontext, layer_by_layer):
        cache, token = prefilled(model, lengths, seed=7)
        before = collections.Counter(counting.calls)
        with route(model), torch.no_grad():
            logits = [model(token + t, cache) for t in range(steps)]
        during_steps += collections.Counter(counting.calls) - before
        results.append((logits, cache_tensors(cache)))
    return results[0], results[1], during_steps


def assert_same_bits(one: tuple[list, list], reference: tuple[list, list]) -> None:
    for kind, (got_all, want_all) in (("logits", (one[0], reference[0])), ("cache", (one[1], reference[1]))):
        assert len(got_all) == len(want_all) > 0
        for i, (got, want) in enumerate(zip(got_all, want_all, strict=True)):
            assert got.shape == want.shape and torch.equal(got, want), (
                f"{kind} {i}: {(got - want).abs().max()}"
            )


def kimi_linear(tmp_path) -> K3ForCausalLM:
    tiny_kimi_linear(16, 2).save_pretrained(tmp_path)  # low-rank q, grouped routing, no AttnRes
    return K3ForCausalLM.from_pretrained(tmp_path)


MODELS: dict[str, Callable] = {
    "tiny, MXFP4 experts": lambda _: K3ForCausalLM.from_config(K3Config.preset("tiny"), seed=3),
    "tiny, plain experts": lambda _: K3ForCausalLM.from_config(
        K3Config.preset("tiny"), seed=3, quantized_experts=False
    ),
    "mini, 5 layers (AttnRes blocks)": lambda _: K3ForCausalLM.from_config(
        K3Config.preset("mini"), seed=3, num_layers=5
    ),
    "mini, BF16 weights": lambda _: with_bf16_weights(
        K3ForCausalLM.from_config(K3Config.preset("mini"), seed=3, num_layers=5)
    ),
    "tiny, int8 expert inputs": lambda _: K3ForCausalLM.from_config(
        K3Config.preset("tiny"), seed=3
    ).set_int8_expert_inputs(True),
    "tiny, grouped routing": lambda _: K3ForCausalLM.from_config(
        dataclasses.replace(K3Config.preset("tiny"), num_expert_group=4, topk_group=2, kda_l2norm_eps=1e-2),
        seed=5,
        quantized_experts=False,
    ),
    "Kimi Linear (transformers' save_pretrained)": kimi_linear,
}


@pytest.mark.parametrize("lengths", [[9], [5, 12, 3]])
@pytest.mark.parametrize("name", list(MODELS))
def test_one_call_equals_the_layers_one_by_one(tmp_path, counting, name, lengths):
    model = MODELS[name](tmp_path)
    one, reference, calls = steps_both_ways(model, lengths, counting)
    assert_same_bits(one, reference)
    assert max(logits.abs().max().item() for logits in one[0]) > 0.1
    assert calls["decoder_layers"] == 4  # one call a step, on the one-call route only
    assert calls["general_moe"] == 0  # every MoE through the kernels, on both routes
    moes = sum(layer.is_moe for layer in model.model.layers)
    assert calls["python_picks"] == 4 * moes  # the reference route's: the loop picks its experts itself
    assert calls["kda_mixer"] + calls["mla_mixer"] == 4 * model.num_layers  # the reference route's


def test_a_one_call_step_is_two_native_calls_and_nothing_between(counting, monkeypatch):
    """The ends of a one-call step run natively too: the tokens' embedding rows and the output read inside
    `decoder_layers`, the final norm in lm_head's `project`. Counted wherever the model loads the kernels,
    and nn.Embedding's and RMSNorm's forwards: three steps are three of each call and nothing else."""
    model = K3ForCausalLM.from_config(K3Config.preset("mini"), seed=3, num_layers=5)  # AttnRes blocks
    monkeypatch.setattr(attn_res_module, "load_native", lambda: counting)
    monkeypatch.setattr(norm_module, "load_native", lambda: counting)
    forwards: collections.Counter = collections.Counter()

    def counted(module: type) -> Callable:
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            forwards[module.__name__] += 1
            return original(self, x)

        original = module.forward
        return forward

    for module in (torch.nn.Embedding, RMSNorm):
        monkeypatch.setattr(module, "forward", counted(module))
    cache, token = prefilled(model, [6, 2], seed=7)
    assert forwards["Embedding"] > 0  # the prefill's, counted
    counting.calls.clear()
    forwards.clear()
    with torch.no_grad():
        logits = [model(token + t, cache) for t in range(3)]
    calls = {name: n for name, n in counting.calls.items() if name != "ExpertTable"}  # the plan's, once
    assert calls == {"decoder_layers": 3, "project": 3} and not forwards
    assert all(x.shape == (2, 1, model.config.vocab_size) and x.abs().max() > 0.1 for x in logits)


@pytest.mark.parametrize("cause", ["recorded routing", "a replaced dispatch", "experts in two modes"])
def test_an_moe_the_kernels_do_not_take_runs_its_general_forward_from_inside_the_call(counting, cause):
    """Recorded routing (router hooks), a dispatch replaced on the instance (k3.dist's expert parallelism)
    and chosen experts in two modes (some with int8 inputs, some exact) make an MoE take its general forward,
    called back from the native loop: the same bits as the layers one by one, and the hooks and the
    dispatch run as often on both routes."""
    model = K3ForCausalLM.from_config(K3Config.preset("tiny"), seed=0)
    moes = [layer.block_sparse_moe for layer in model.model.layers if layer.is_moe]
    with contextlib.ExitStack() as stack:
        if cause == "recorded routing":
            trace = stack.enter_context(record_routing(model))
        elif cause == "a replaced dispatch":
            dispatch = moes[0].dispatch
            object.__setattr__(
                moes[0], "dispatch", lambda *a: counting.calls.update(["dispatch"]) or dispatch(*a)
            )
        else:
            for moe in moes:
                for i, expert in enumerate(moe.experts):
                    expert.w1.int8_inputs = expert.w3.int8_inputs = expert.w2.int8_inputs = i % 2 == 0
        one, reference, calls = steps_both_ways(model, [5, 9], counting, steps=2)
    assert_same_bits(one, reference)
    assert calls["decoder_layers"] == 2
    if cause == "recorded routing":  # every router's hooks, on both routes: two prefills and two steps
        assert all(trace.calls(layer) == 2 * (2 + 2) for layer in trace.layers)
        assert calls["general_moe"] == 2 * 2 * len(moes)
    elif cause == "a replaced dispatch":
        assert calls["dispatch"] == 2 * 2 and calls["general_moe"] == 2 * 2
    else:  # the layers whose rows chose experts of both modes (the same ones on both routes)
        assert calls["general_moe"] > 0 and calls["general_moe"] % 2 == 0


def test_the_stream_handed_to_a_python_ffn_is_not_written_into_afterwards(tmp_path, counting):
    """The native loop adds a block's later updates into its own partial sum in place; a partial sum it has
    handed out (here, without AttnRes, the FFN's input, to an FFN that runs in Python because its routing is
    recorded) must keep its values after the step, for whatever holds it (a hook here)."""
    model = kimi_linear(tmp_path)  # no AttnRes: each FFN reads the partial sum itself
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in model.model.layers:
        layer.post_attention_layernorm.register_forward_pre_hook(
            lambda _module, args: seen.append((args[0], args[0].clone()))
        )
    cache, token = prefilled(model, [5, 9], seed=7)
    seen.clear()
    with record_routing(model), torch.no_grad():
        model(token, cache)
    assert counting.calls["decoder_layers"] == 1 and counting.calls["general_moe"] > 0
    assert len(seen) == sum(layer.is_moe for layer in model.model.layers)  # each MoE's input, from Python
    for i, (held, as_seen) in enumerate(seen):
        assert torch.equal(held, as_seen), f"MoE {i}'s input changed after it was handed out"


def test_a_cache_not_yet_prefilled_or_a_gradient_takes_the_layers_one_by_one(counting):
    """A first token into an empty cache (no KDA state to continue) and a step that records gradients (the
    kernels have no backward) do not take the one-call route, and still give the general path's logits."""
    model = K3ForCausalLM.from_config(K3Config.preset("tiny"), seed=1)
    token = torch.tensor([[3], [7]])
    with torch.no_grad():
        first = model(token, model.new_cache(2))
        want = model.set_fast_decode(False)(token, model.new_cache(2))
        model.set_fast_decode(True)
    assert torch.allclose(first, want, rtol=0, atol=1e-5 * want.abs().max().item())
    cache, token = prefilled(model, [4], seed=7)
    model(token, cache)  # grad enabled
    assert counting.calls["decoder_layers"] == 0


def test_a_malformed_layer_or_token_is_a_clear_error():
    native = load_native()
    ids, table = torch.zeros(1, 1, dtype=torch.long), torch.zeros(4, 8)

    def step(layers: list, ids: torch.Tensor = ids, table: torch.Tensor = table) -> tuple:
        return native.decoder_layers(ids, table, 0, layers, lambda *a: None, None)

    with pytest.raises(RuntimeError, match="a layer is"):
        step([(0, None, None, "kda")])
    with pytest.raises(RuntimeError, match="mixer_kind must be"):
        step([(0, None, None, "ssm", (), "mlp", ())])
    with pytest.raises(RuntimeError, match="kda_mixer: expected 25 arguments, got 2"):
        step([(0, None, None, "kda", (1, 2), "mlp", ())])
    with pytest.raises(RuntimeError, match=r"token id 4 is outside the vocabulary \[0, 4\)"):
        step([], ids=torch.tensor([[4]]))
    with pytest.raises(RuntimeError, match="ids must be a contiguous int64"):
        step([], ids=torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(RuntimeError, match="the embedding table must be"):
        step([], table=torch.zeros(4, 8, dtype=torch.float16))


def test_the_steps_embedding_rows_are_the_tables_rows_in_fp32():
    """With no layer the call returns the tokens' embedding rows (the running sum read as it is): fp32 or
    BF16 tables, each row exact in fp32, as the general path's embedding then `.float()`."""
    native = load_native()
    ids = torch.tensor([[5], [0], [5], [11]])
    for dtype in (torch.float32, torch.bfloat16):
        table = torch.randn(12, 40, generator=torch.Generator().manual_seed(0)).to(dtype)
        h, states = native.decoder_layers(ids, table, 0, [], lambda *a: None, None)
        assert states == [] and h.dtype == torch.float32
        assert torch.equal(h, torch.nn.functional.embedding(ids, table).float())


def test_the_plan_is_built_once_and_sees_what_changes_between_steps(counting):
    """The one-call route looks a layer's weights up once (k3.model.fused.DecodePlan) and still follows a
    weight or a module replaced between steps (torch's registration hooks), a BF16 norm changed in place (its
    fp32 copy is made again), experts' matrices replaced or their inputs rounded to int8, a converted model
    (either way), router hooks and on-demand reads of experts added after the plan was built: each time the
    same bits as the layers one by one afterwards, and logits that moved with the weights. The loop picks
    the chosen experts itself but when they are read on demand (Python picks them, reading them first)."""
    model = with_bf16_weights(K3ForCausalLM.from_config(K3Config.preset("tiny"), seed=4))
    plan, layer = model.model.decode_plan, model.model.layers[1]
    during: collections.Counter = collections.Counter()

    def steps() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(logits of three steps, the cache's tensors after them); the calls counted during the steps (not
        the prefill) in `during`"""
        cache, token = prefilled(model, [5, 9], seed=7)
        before = collections.Counter(counting.calls)
        with torch.no_grad():
            logits = [model(token + t, cache) for t in range(3)]
        during.clear()
        during.update(collections.Counter(counting.calls) - before)
        return logits, cache_tensors(cache)

    def replace_weight():
        layer.self_attn.o_proj.weight = torch.nn.Parameter(layer.self_attn.o_proj.weight.detach() * 3)

    def change_norm_in_place():
        with torch.no_grad():
            layer.post_attention_layernorm.weight.mul_(-2)  # BF16: the kernels take an fp32 copy

    o_proj = layer.self_attn.o_proj
    replacement = Linear(o_proj.in_features, o_proj.out_features)  # made before any plan: only its
    replacement.weight = torch.nn.Parameter(o_proj.weight.detach() * -1)  # registration as a child clears one

    def replace_module():
        layer.self_attn.o_proj = replacement

    def replace_experts():  # every routed expert's packed w2 codes in every MoE layer
        for moe in (layer.block_sparse_moe for layer in model.model.layers if layer.is_moe):
            for expert in moe.experts:
                expert.w2.weight_packed = expert.w2.weight_packed ^ 0x11

    def int8_experts():  # read at each step, not kept
        model.set_int8_expert_inputs(True)

    def to_fp32():
        model.float()

    def to_bf16():  # (the fp32 weights the plan holds as they are take BF16 data)
        model.bfloat16()

    def record():
        return record_routing(model)

    reads = collections.Counter()

    @contextlib.contextmanager
    def read_on_demand():  # as k3.model.on_demand sets it (here reading nothing), then unset
        moes = [layer.block_sparse_moe for layer in model.model.layers if layer.is_moe]
        for moe in moes:
            moe.load_experts = lambda indices: reads.update(["read"])
        try:
            yield
        finally:
            for moe in moes:
                moe.load_experts = None

    changes = (  # (change, plan builds it causes)
        (replace_weight, 1),
        (replace_module, 1),
        (change_norm_in_place, 1),
        (replace_experts, 1),
        (int8_experts, 0),
        (to_fp32, 1),
        (to_bf16, 1),
        (record, 0),
        (read_on_demand, 0),
    )
    for change, builds in changes:
        before = steps()  # the plan built (again: the reference route below clears it) and current
        built = plan.builds
        assert steps()[0][-1].equal(before[0][-1]) and plan.builds == built  # reused
        with contextlib.ExitStack() as stack:
            if (entered := change()) is not None:
                stack.enter_context(entered)
            got = steps()
            assert plan.builds == built + builds, change.__name__
            calls = collections.Counter(during)
            with layer_by_layer(model):
                want = steps()
        assert_same_bits(got, want)
        if change not in (record, read_on_demand):  # (recorded routing: the general MoE, other rounding)
            assert not torch.equal(got[0][-1], before[0][-1]), change.__name__
        moes = sum(layer.is_moe for layer in model.model.layers)
        assert calls["general_moe"] == (3 * moes if change is record else 0), change.__name__  # hooks
        assert calls["python_picks"] == (3 * moes if change is read_on_demand else 0), change.__name__
    assert reads["read"] > 0
