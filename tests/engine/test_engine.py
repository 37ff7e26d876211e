"""The engine against one full forward pass: chunked prefill, batched decode of unequal lengths,
sequences joining and leaving, cache sizes, seeds, cancellation."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from mla_forms import record_mla_forms

from k3.config import K3Config, Mixer
from k3.engine.generate import Engine
from k3.engine.sampling import SamplingParams
from k3.engine.sequence import EngineError, Status
from k3.engine.sequence_cache import cache_bytes_formula
from k3.model import K3ForCausalLM
from k3.model.mla import MLAttention


def variant(kind: str) -> K3Config:
    cfg = K3Config.preset("tiny")
    every = list(range(cfg.num_hidden_layers))
    if kind == "kda":  # every layer KDA
        return dataclasses.replace(cfg, kda_layers=every, mla_layers=[])
    if kind == "mla":  # every layer MLA
        return dataclasses.replace(cfg, kda_layers=[], mla_layers=every)
    return cfg  # hybrid: 3 KDA + 2 MLA


@pytest.fixture(scope="module", params=["hybrid", "kda", "mla"])
def model(request: pytest.FixtureRequest) -> K3ForCausalLM:
    return K3ForCausalLM.from_config(variant(request.param), seed=1)


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 768, (n,), generator=g).tolist() for n in lengths]


def test_engine_logits_equal_full_forward(model: K3ForCausalLM) -> None:
    """Prompts of 13, 5 and 22 tokens, prefilled in chunks of 4, decoded together (the third joins a
    running batch, the first leaves early); every step's logits equal those of one full forward."""
    engine = Engine(model, prefill_chunk=4, record_logits=True)
    ps = prompts([13, 5, 22])
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (6, 10, 6)]
    seqs = [engine.submit(p, sp) for p, sp in zip(ps[:2], params[:2], strict=True)]
    logits: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
    batch_sizes = set()
    for step in range(200):
        if step == 6:  # the first two are decoding by now
            seqs.append(engine.submit(ps[2], params[2]))
        batch_sizes.add(len(engine.running))
        for event in engine.step():
            logits[seqs.index(event.seq)].append(event.logits)
        if not engine.has_work and len(seqs) == 3:
            break
    assert {1, 2} <= batch_sizes  # decoded alone and together
    for i, seq in enumerate(seqs):
        assert seq.status is Status.FINISHED and len(seq.output) == params[i].max_tokens
        full = model(torch.tensor([seq.prompt + seq.output[:-1]]))[0]  # [T, V]
        want = full[len(seq.prompt) - 1 :]
        got = torch.stack(logits[i])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert seq.output == want.argmax(-1).tolist()  # greedy


def chunk_plan(engine: Engine, tokens: int) -> list[int]:
    sizes: list[int] = []
    while sum(sizes) < tokens:
        sizes.append(engine.chunk_size(sum(sizes), tokens - sum(sizes)))
    return sizes


def test_prefill_chunks_are_as_few_and_as_even_as_the_bounds_allow(
    model: K3ForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk reads every weight once however few its tokens: planted, 250 tokens under a 100-token chunk
    are 84 + 83 + 83 (not 100 + 100 + 50), and, where MLA's plain form holds no context, 610 under a budget
    of 150 queries' absorbed scores over 610 keys are 5 x 122 (not 4 x 150 + 10)."""
    assert chunk_plan(Engine(model, prefill_chunk=100), 250) == [84, 83, 83]
    heads = model.config.num_attention_heads
    engine = Engine(model, attention_budget=2 * 4 * heads * 610 * 150)  # scores + probabilities, fp32
    no_room = lambda keys, queries: engine.attention_budget * keys  # noqa: E731
    monkeypatch.setattr(model, "plain_attention_bytes", no_room)
    assert chunk_plan(engine, 610) == ([122] * 5 if model.config.mla_layers else [610])


@torch.no_grad()
def test_prefill_fills_mlas_plain_form_then_its_absorbed_one(
    model: K3ForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a budget in which the plain form holds 400 keys: a 300-token prompt goes in one chunk (the
    absorbed form's scores alone would have cut it in six), a 700-token one fills the plain form's 400 keys,
    then takes chunks whose absorbed scores fit. Every chunk's MLA layers attend in the form the plan
    counted on, within the budget, and the logits are those of one full forward."""
    if not model.config.mla_layers:  # no attention bound on the chunks, however small the budget
        assert chunk_plan(Engine(model, attention_budget=1), 700) == [700]
        return
    heads = model.config.num_attention_heads
    budget = model.plain_attention_bytes(400, 400)  # a first chunk of 400: no mask
    engine = Engine(model, attention_budget=budget)
    assert chunk_plan(engine, 300) == [300] and budget // (2 * 4 * heads * 300) < 300 // 5
    plan = chunk_plan(engine, 700)
    assert plan[0] == 400 and len(plan) > 2
    layers = [m for m in model.modules() if isinstance(m, MLAttention)]
    forms = record_mla_forms(model, monkeypatch)
    ids = torch.tensor(prompts([700], seed=3))
    cache, logits, done = model.new_cache(1), [], 0
    for size in plan:
        forms.clear()
        logits.append(model(ids[:, done : done + size], cache)[0])
        done += size
        if model.plain_attention_bytes(done, size) <= budget:
            assert forms == ["plain"] * len(layers)
        else:
            assert forms == ["absorbed"] * len(layers) and 2 * 4 * heads * size * done <= budget
    full = model(ids)[0]
    torch.testing.assert_close(torch.cat(logits), full, atol=1e-4, rtol=1e-4)


def test_the_engines_budget_bounds_mla_plain_form(model: K3ForCausalLM) -> None:
    """One budget for the chunks' scores and MLA's plain form (MLAttention.plain_budget): what the engine is
    given, not the layers' default."""
    Engine(model, attention_budget=3 * 2**20)
    layers = [m for m in model.modules() if isinstance(m, MLAttention)]
    assert len(layers) == len(model.config.mla_layers)
    assert all(m.plain_budget == 3 * 2**20 for m in layers)
    Engine(model)
    assert all(m.plain_budget == 512 * 2**20 for m in layers)


def test_cache_bytes_follow_the_formula(model: K3ForCausalLM) -> None:
    cfg = model.config
    engine = Engine(model, prefill_chunk=8)
    short, long_ = (engine.submit(p, SamplingParams(temperature=0, max_tokens=50)) for p in prompts([6, 30]))
    for _ in range(10):
        engine.step()
    assert short.status is long_.status is Status.RUNNING
    for seq in (short, long_):
        in_cache = seq.num_tokens - 1  # the newest token is fed at the next step
        assert engine.cache_bytes(seq) == cache_bytes_formula(cfg, in_cache)
    assert engine.cache_bytes(short)["kda"] == engine.cache_bytes(long_)["kda"]  # constant in length
    n_mla = sum(p.mixer is Mixer.MLA for p in cfg.layer_plan)
    per_token = n_mla * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    grown = engine.cache_bytes(long_)["mla"] - engine.cache_bytes(short)["mla"]
    assert grown == (long_.num_tokens - short.num_tokens) * per_token
    engine.cancel(long_)
    assert engine.cache_bytes(long_)["total"] == 0 and engine.running == [short]
    assert engine.batch is not None and engine.batch.batch_size == 1


def test_k3_formula_values() -> None:
    """576 values per token per MLA layer; a KDA layer's state is 96 x 128 x 128 fp32 (6.3 MB)."""
    cfg = K3Config.preset("k3")
    one, two = cache_bytes_formula(cfg, 1, torch.bfloat16), cache_bytes_formula(cfg, 2, torch.bfloat16)
    assert two["mla"] - one["mla"] == 24 * 576 * 2
    assert one["kda"] == two["kda"] == 69 * (96 * 128 * 128 * 4 + 3 * 3 * 12288 * 2)


def test_seeded_sampling_independent_of_batch() -> None:
    model = K3ForCausalLM.from_config(variant("hybrid"), seed=2)
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=6, seed=11)
    alone = Engine(model).generate(prompts([9]), p)[0]
    together = Engine(model).generate(
        prompts([9]) + prompts([4, 17], seed=5), [p, *[dataclasses.replace(p, seed=3)] * 2]
    )
    assert together[0] == alone
    streamed = list(Engine(model).stream(prompts([9])[0], p))
    assert streamed == alone


def test_stop_ids_and_bad_requests() -> None:
    model = K3ForCausalLM.from_config(variant("hybrid"), seed=2)
    engine = Engine(model)
    first = engine.generate(prompts([7]), SamplingParams(temperature=0, max_tokens=4))[0]
    stopped = engine.submit(prompts([7])[0], SamplingParams(temperature=0, max_tokens=4, stop_ids={first[2]}))
    while engine.has_work:
        engine.step()
    assert stopped.output == first[:2] and stopped.finish_reason == "stop"
    with pytest.raises(EngineError, match="empty"):
        engine.submit([], SamplingParams())
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.submit([5000], SamplingParams())


def test_prefill_chunks_respect_the_attention_budget() -> None:
    model = K3ForCausalLM.from_config(variant("hybrid"), seed=2)
    engine = Engine(model, prefill_chunk=2048, attention_budget=2**20)
    heads = model.config.num_attention_heads
    size = engine.chunk_size(done=100_000, remaining=50_000)
    assert 2 * 4 * heads * size * (100_000 + size) <= 2**20 or size == 16
    assert engine.chunk_size(done=0, remaining=10) == 10
