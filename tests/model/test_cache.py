"""Inference state: prefill + decode equals one full forward; padded batches; absorbed MLA equals plain."""

from __future__ import annotations

import pytest
import torch
from mla_forms import record_mla_forms

from k3.config import K3Config, Mixer
from k3.model import K3ForCausalLM, ModelCache
from k3.model.mla import MLAttention


@pytest.fixture(scope="module")
def model():
    return K3ForCausalLM.from_config(K3Config.preset("tiny"), seed=1)


def ids_of(B, T, seed=0):
    return torch.randint(0, 1024, (B, T), generator=torch.Generator().manual_seed(seed))


def close(a, b, ref):
    return (a - b).abs().max().item() <= 1e-4 * ref.abs().max().item()


@torch.no_grad()
def test_prefill_then_decode_equals_full_forward(model):
    assert {p.mixer for p in model.config.layer_plan} == {Mixer.KDA, Mixer.MLA}
    ids = ids_of(2, 80)
    full = model(ids)
    cache = model.new_cache(2)
    steps = [model(ids[:, :70], cache)]  # one chunk past the KDA chunk size (64)
    steps += [model(ids[:, 70:73], cache)]  # a short chunk
    steps += [model(ids[:, t : t + 1], cache) for t in range(73, 80)]  # decode steps
    assert close(torch.cat(steps, dim=1), full, full)
    assert cache.tokens.tolist() == [80, 80]
    assert cache.nbytes() > 0


@torch.no_grad()
def test_right_padded_batch_and_per_row_lengths(model):
    a, b = ids_of(1, 30, seed=1), ids_of(1, 19, seed=2)
    nxt = ids_of(2, 3, seed=3)
    batch = torch.zeros(2, 30, dtype=torch.long)
    batch[0], batch[1, :19] = a[0], b[0]
    batch[1, 19:] = 7  # padding: any token, it must not matter
    cache = model.new_cache(2)
    prefill = model(batch, cache, lengths=[30, 19])
    decoded = [model(nxt[:, t : t + 1], cache) for t in range(3)]  # rows now at different lengths
    for row, seq in enumerate((a, b)):
        full = model(torch.cat([seq, nxt[row : row + 1]], dim=1))[0]
        n = seq.shape[1]
        assert close(prefill[row, :n], full[:n], full)
        assert close(torch.cat([d[row] for d in decoded]), full[n:], full)
    assert cache.tokens.tolist() == [33, 22]


@torch.no_grad()
def test_caches_prefilled_alone_stack_into_a_batch(model):
    a, b = ids_of(1, 12, seed=4), ids_of(1, 5, seed=5)
    ca, cb = model.new_cache(1), model.new_cache(1)
    model(a, ca)
    model(b, cb)
    cache = ModelCache.stack([ca, cb])
    step = ids_of(2, 1, seed=6)
    out = model(step, cache)
    for row, seq in enumerate((a, b)):
        full = model(torch.cat([seq, step[row : row + 1]], dim=1))[0, -1]
        assert close(out[row, 0], full, full)
    only_b = cache.select([1])
    out_b = model(ids_of(1, 1, seed=7), only_b)
    full_b = model(torch.cat([b, step[1:2], ids_of(1, 1, seed=7)], dim=1))[0, -1]
    assert close(out_b[0, 0], full_b, full_b)


@torch.no_grad()
def test_absorbed_mla_equals_plain(model):
    mla = next(layer.self_attn for layer in model.model.layers if isinstance(layer.self_attn, MLAttention))
    gen = torch.Generator().manual_seed(8)
    B, T, S = 2, 5, 13
    x = torch.randn(B, T, model.config.hidden_size, generator=gen)
    q_nope, q_rope = mla.queries(x)
    c, k_rope = mla.latents(torch.randn(B, S, model.config.hidden_size, generator=gen))
    offsets = torch.tensor([S - T, 3])
    visible = torch.arange(S)[None, None, :] <= (offsets[:, None] + torch.arange(T))[:, :, None]
    plain = mla.attend_plain(q_nope, q_rope, c, k_rope, visible)
    absorbed = mla.attend_absorbed(q_nope, q_rope, c, k_rope, visible)
    assert close(absorbed, plain, plain)
    causal_plain = mla.attend_plain(q_nope, q_rope, c[:, :T], k_rope[:, :T], None)
    causal_absorbed = mla.attend_absorbed(q_nope, q_rope, c[:, :T], k_rope[:, :T], None)
    assert close(causal_absorbed, causal_plain, causal_plain)
    # and the whole layer, both ways, through a cache
    states = [model.new_cache(B).layers[mla_index(model)] for _ in range(2)]
    outs = [
        [mla(x[:, t : t + 1], s, absorb=flag) for t in range(T)]
        for s, flag in zip(states, (False, True), strict=True)
    ]
    assert close(torch.cat(outs[1], 1), torch.cat(outs[0], 1), torch.cat(outs[0], 1))


def mla_index(model):
    return next(i for i, p in enumerate(model.config.layer_plan) if p.mixer is Mixer.MLA)


@torch.no_grad()
def test_a_chunk_past_the_plain_budget_takes_the_absorbed_form(model, monkeypatch):
    """The plain form expands every cached key (kv_b's output, keys and values padded): a chunk whose context
    would take more than `plain_budget` bytes so takes the absorbed form, whose scores the engine's chunks
    bound; the logits stay those of one full forward."""
    layers = [layer.self_attn for layer in model.model.layers if isinstance(layer.self_attn, MLAttention)]
    forms = record_mla_forms(model, monkeypatch)
    for mla in layers:
        monkeypatch.setattr(mla, "plain_budget", mla.plain_bytes(8, 8, 4))  # 8 keys fit, 9 do not
    ids = ids_of(1, 24, seed=9)
    full = model(ids)[0]  # [T, V], no cache: plain
    assert forms == ["plain"] * len(layers)
    forms.clear()
    cache = model.new_cache(1)
    chunks = torch.cat([model(ids[:, s : s + 8], cache) for s in (0, 8, 16)], dim=1)[0]
    assert forms == ["plain"] * len(layers) + ["absorbed"] * 2 * len(layers)  # contexts of 8, 16, 24 keys
    assert close(chunks, full, full)


@torch.no_grad()
@pytest.mark.parametrize("B", [1, 2])
def test_a_chunk_after_cached_context_counts_its_mask(model, monkeypatch, B):
    """After cached context the plain form also holds the visibility mask of every query and key (B rows of
    it): a chunk of 8 over 16 keys whose expanded positions alone would fit the budget, but not with the mask
    (or not with the mask of every row), takes the absorbed form; with room for all of it, the plain form."""
    layers = [layer.self_attn for layer in model.model.layers if isinstance(layer.self_attn, MLAttention)]
    mla = layers[0]
    cases = [
        (mla.plain_bytes(16, 16, 4, B), "absorbed"),  # every row's positions, no mask
        (mla.plain_bytes(16, 8, 4, B), "plain"),  # and the mask
    ]
    if B == 2:
        cases.append((mla.plain_bytes(16, 8, 4), "absorbed"))  # one row's positions and mask
    ids = ids_of(B, 16, seed=11)
    for budget, form in cases:
        for layer in layers:
            monkeypatch.setattr(layer, "plain_budget", budget)
        cache = model.new_cache(B)
        model(ids[:, :8], cache)  # the first chunk: no mask, within either budget
        forms = record_mla_forms(model, monkeypatch)
        model(ids[:, 8:], cache)
        assert forms == [form] * len(layers)
        monkeypatch.undo()
