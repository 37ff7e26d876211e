"""Token-in/token-out (`Engine.complete`, `Engine.load_weights`) against a teacher-forced forward of the
same ids: logprobs under the distribution each token was drawn from (recomputed here from the forward's
logits by a float64 reference written from the definitions), the experts `record_routing` reports for that
forward, `route_with` replaying them, and weights swapped between requests only."""

from __future__ import annotations

import math

import pytest
import torch

from k3.config import K3Config
from k3.engine.generate import Engine
from k3.engine.sampling import SamplingParams
from k3.engine.sequence import Completion, EngineError
from k3.model import K3ForCausalLM
from k3.model.routing import record_routing, route_with


@pytest.fixture(scope="module")
def model() -> K3ForCausalLM:
    return K3ForCausalLM.from_config(K3Config.preset("tiny"), seed=1)


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 768, (n,), generator=g).tolist() for n in lengths]


def reference_logprob(logits: torch.Tensor, p: SamplingParams, token: int) -> float:
    """log P(token) under temperature, then top-k, then top-p (smallest prefix reaching top_p), float64;
    greedy: the log-softmax of the logits."""
    x = logits.double()
    if p.temperature == 0:
        return float(torch.log_softmax(x, -1)[token])
    x = (x / p.temperature).tolist()
    order = sorted(range(len(x)), key=lambda i: -x[i])
    allowed = order[: p.top_k] if p.top_k else order
    z = sum(math.exp(x[i]) for i in allowed)
    probs = {i: math.exp(x[i]) / z for i in allowed}
    if p.top_p < 1:
        kept, mass = [], 0.0
        for i in allowed:  # already most likely first
            if mass >= p.top_p:
                break
            kept.append(i)
            mass += probs[i]
        probs = {i: probs[i] / mass for i in kept}
    assert token in probs, "the engine drew a token its distribution excludes"
    return math.log(probs[token])


def teacher_forced(model: K3ForCausalLM, c: Completion) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward over prompt + tokens[:-1]: logits [T, V], experts [T, n_moe, k], the ids [1, T]."""
    ids = torch.tensor([c.prompt + c.tokens[:-1]])
    with torch.no_grad(), record_routing(model) as trace:
        logits = model(ids)[0]
    experts = torch.stack([trace.indices(layer) for layer in trace.layers], 1)
    return logits, experts, ids


MIX = [
    SamplingParams(temperature=0, max_tokens=6),
    SamplingParams(temperature=1.0, max_tokens=12, seed=1),
    SamplingParams(temperature=0.7, top_k=20, max_tokens=8, seed=2),
    SamplingParams(temperature=1.2, top_p=0.9, max_tokens=10, seed=3),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.8, max_tokens=5, seed=4),
]


def test_rollouts_equal_teacher_forced_forward(model: K3ForCausalLM) -> None:
    """Seeded rollouts of unequal prompt and output lengths, 3 at a time in continuous batches, prefilled
    in chunks of 4, plus one greedy request ended by a planted stop id."""
    ps = prompts([13, 5, 22, 9, 3, 11])
    greedy = Engine(model).generate([ps[5]], SamplingParams(temperature=0, max_tokens=6))[0]
    params = [*MIX, SamplingParams(temperature=0, max_tokens=20, stop_ids={greedy[3]})]
    engine = Engine(model, max_batch=3, prefill_chunk=4)
    done = engine.complete(ps, params, record_experts=True)
    assert engine.steps < sum(len(c.tokens) for c in done)  # decoded together, not one by one
    assert not engine.has_work and engine.batch is None
    n_moe, k = len(model.routers()), model.config.num_experts_per_token
    for c, p, prompt in zip(done, params, ps, strict=True):
        assert c.prompt == prompt and len(c.logprobs) == len(c.versions) == len(c.tokens)
        assert c.versions == [0] * len(c.tokens)
        logits, experts, ids = teacher_forced(model, c)
        want = [
            reference_logprob(row, p, t) for row, t in zip(logits[len(prompt) - 1 :], c.tokens, strict=True)
        ]
        got = torch.tensor(c.logprobs, dtype=torch.float64)
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-5, rtol=0)
        assert c.experts is not None and c.experts.dtype == torch.long
        assert c.experts.shape == (len(prompt) + len(c.tokens) - 1, n_moe, k)
        assert torch.equal(c.experts, experts)
        replay = {layer: c.experts[:, j] for j, layer in enumerate(sorted(model.routers()))}
        with torch.no_grad(), route_with(model, replay):
            replayed = model(ids)[0]
        torch.testing.assert_close(replayed, logits, atol=1e-6, rtol=0)
    stopped = done[5]
    assert stopped.finish_reason == "stop" and stopped.tokens == greedy[:4]  # the stop id included
    assert [c.finish_reason for c in done[:5]] == ["length"] * 5
    assert [len(c.tokens) for c in done[:5]] == [p.max_tokens for p in MIX]


def test_replay_is_used(model: K3ForCausalLM) -> None:
    """route_with with other experts than recorded gives other logits (so the replay check above can fail)."""
    c = Engine(model).complete(
        prompts([9]), SamplingParams(temperature=0, max_tokens=4), record_experts=True
    )[0]
    logits, _, ids = teacher_forced(model, c)
    shuffled = {
        layer: (c.experts[:, j] + 1) % model.config.num_experts
        for j, layer in enumerate(sorted(model.routers()))
    }
    with torch.no_grad(), route_with(model, shuffled):
        other = model(ids)[0]
    assert (other - logits).abs().max() > 1e-3


def test_greedy_logprobs_and_alternatives_are_log_softmax(model: K3ForCausalLM) -> None:
    p = SamplingParams(temperature=0, max_tokens=7, logprobs=5)
    c = Engine(model).complete(prompts([10]), p)[0]
    logits, _, _ = teacher_forced(model, c)
    logp = torch.log_softmax(logits[9:].double(), -1)  # [7, V]
    torch.testing.assert_close(
        torch.tensor(c.logprobs, dtype=torch.float64), logp.max(-1).values, atol=1e-5, rtol=0
    )
    assert c.top_logprobs is not None and len(c.top_logprobs) == 7
    for row, top in zip(logp, c.top_logprobs, strict=True):
        values, ids = torch.topk(row, 5)
        assert [t for t, _ in top] == ids.tolist()
        torch.testing.assert_close(
            torch.tensor([v for _, v in top], dtype=torch.float64), values, atol=1e-5, rtol=0
        )


def test_prompt_logprobs_without_generation(model: K3ForCausalLM) -> None:
    """max_tokens 0 with prompt_logprobs: scoring only, across prefill chunks of 4."""
    prompt = prompts([14])[0]
    p = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=3)
    c = Engine(model, prefill_chunk=4).complete([prompt], p)[0]
    assert c.tokens == [] and c.finish_reason == "length" and c.prompt_logprobs is not None
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt]))[0].double(), -1)  # [14, V]
    want = logp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert c.prompt_logprobs[0] is None and len(c.prompt_logprobs) == len(prompt)
    torch.testing.assert_close(
        torch.tensor(c.prompt_logprobs[1:], dtype=torch.float64), want, atol=1e-5, rtol=0
    )


def test_load_weights_between_requests_only(model: K3ForCausalLM) -> None:
    cfg = model.config
    engine = Engine(K3ForCausalLM.from_config(cfg, seed=1))
    new = K3ForCausalLM.from_config(cfg, seed=9)
    p = SamplingParams(temperature=1.0, max_tokens=8, seed=5)
    prompt = prompts([7])[0]
    before = engine.complete([prompt], p)[0]

    seq = engine.submit(prompt, p)  # in flight: the swap is refused and changes nothing
    engine.step()
    with pytest.raises(EngineError, match="in flight"):
        engine.load_weights(new.state_dict(), 1)
    while engine.has_work:
        engine.step()
    assert seq.output == before.tokens and seq.logprobs == before.logprobs and engine.policy_version == 0

    bad = dict(new.state_dict())
    bad.pop("lm_head.weight")
    bad["model.norm.weight"] = torch.zeros(3)
    bad["extra"] = torch.zeros(1)
    with pytest.raises(
        EngineError, match=r"missing: lm_head\.weight.*unexpected: extra.*model\.norm\.weight"
    ):
        engine.load_weights(bad, 1)
    assert engine.complete([prompt], p)[0].logprobs == before.logprobs

    engine.load_weights(new.state_dict(), 7)
    after = engine.complete([prompt], p)[0]
    assert engine.policy_version == 7 and after.versions == [7] * len(after.tokens)
    fresh = Engine(new).complete([prompt], p)[0]
    assert after.tokens == fresh.tokens and after.logprobs == pytest.approx(fresh.logprobs, abs=1e-6)
    assert after.logprobs != pytest.approx(before.logprobs, abs=1e-3)


def test_load_weights_reaches_tiled_weights(monkeypatch) -> None:
    """A BF16 model laid out for the decode kernels (k3.model.tiling) hands its tiled weights out of
    `state_dict()` as copies in rows: new weights must reach the tiles themselves. After the swap the engine
    gives, bit for bit, what an engine built on the new weights gives (tiled the same way), and every weight
    reads back as the new one."""
    from k3.model import tiling
    from k3.model.tiling import is_tiled

    cfg = K3Config.preset("tiny")
    old, new = (
        K3ForCausalLM.from_config(cfg, seed=s).to(torch.bfloat16).requires_grad_(False) for s in (1, 9)
    )
    for m in (old, new):
        m.compute_dtype = torch.float32
        m.tile_weights()
    assert sum(is_tiled(p) for p in old.parameters()) > 10
    engine = Engine(old)
    p = SamplingParams(temperature=0.0, max_tokens=6)
    prompt = prompts([9])[0]
    before = engine.complete([prompt], p)[0]
    new_state = new.state_dict()
    with (
        monkeypatch.context() as patch
    ):  # the swap untiles none of the engine's matrices (~11 GB at k3-slice)
        patch.setattr(tiling, "rows_of", lambda *a: pytest.fail("load_weights untiled a matrix"))
        engine.load_weights(new_state, 3)
    after = engine.complete([prompt], p)[0]
    fresh = Engine(new).complete([prompt], p)[0]
    assert after.tokens == fresh.tokens and after.logprobs == fresh.logprobs
    assert after.logprobs != before.logprobs
    wanted = new.state_dict()
    assert all(torch.equal(t, wanted[name]) for name, t in old.state_dict().items())
