"""`k3 conform` against k3's own server (every scenario passes) and against servers built on k3's engine
with one deliberate break each: exactly the scenarios the break affects fail, and the report names the
request and the position where the engine first parts from k3."""

from __future__ import annotations

import pytest
from broken_engines import PixelBlindCache, SharedSlot, WrongBoundaryCache, drop_attn_res_read

from k3.conform.client import EngineClient
from k3.conform.reference import reference_model
from k3.conform.report import THRESHOLDS
from k3.conform.scenarios import SCENARIOS, Run, run_scenarios
from k3.conform.texts import (
    chat_ids,
    equal_length_prompts,
    growing_chat,
    image_chats,
    prompt_ids,
)
from k3.engine.chat import chat_prompt
from k3.engine.generate import Engine
from k3.engine.prefix_cache import PrefixCache
from k3.engine.server import create_app
from k3.engine.state_store import checkpoint_identity
from k3.model import K3ForCausalLM
from k3.tokenizer.kimi import Tokenizer
from k3.vision.prompt import image_prompt

ALL = list(SCENARIOS)


def conform(serve, checkpoint, reference, engine: Engine, names: list[str], max_tokens: int = 4):
    tokenizer = Tokenizer.from_source(checkpoint)
    with serve(create_app(engine, tokenizer, "tiny")) as base:
        client = EngineClient(f"{base}/v1", tokenizer)
        results = run_scenarios(Run(client, reference, THRESHOLDS["exact"], max_tokens), names)
        client.close()
    return {r.name: r for r in results}


def failing(results) -> set[str]:
    return {name for name, r in results.items() if not r.passed}


@pytest.mark.parametrize("interval", [2048, 64, None])
def test_k3_serve_passes_every_scenario(serve, checkpoint, reference, interval):
    """k3's engine as `k3 serve` builds it: with its exact prefix cache (the default interval, 2,048 prompt
    tokens, and 64) and without (`--no-prefix-cache`)."""
    model = reference_model(checkpoint)  # with its vision tower, as `k3 serve` loads it
    cache = PrefixCache(interval, 2**30, checkpoint_identity(model), None) if interval else None
    results = conform(serve, checkpoint, reference, Engine(model, prefix_cache=cache), ALL)
    assert not failing(results), {n: r.notes for n, r in results.items()}
    assert all(r.skipped is None for r in results.values())
    assert max(r.max_dlogprob for r in results.values()) < 1e-4  # float rounding only
    assert all(r.top1 == 1.0 for r in results.values())
    if interval == 64:
        assert cache.stats.hits > 0  # the chats did resume from cached states


def broken_engine(checkpoint, break_: str) -> Engine:
    model = reference_model(checkpoint)
    if break_ == "pixels":  # a block every 16 tokens: the image chats' pads fill whole blocks
        return PixelBlindCache(model, prefix_cache=PrefixCache(16, 2**30, checkpoint_identity(model), None))
    if break_ == "boundary":
        return WrongBoundaryCache(model, Tokenizer.from_source(checkpoint).special.end_of_msg)
    if break_ == "slot":
        return SharedSlot(model)
    drop_attn_res_read(model, 3)
    return Engine(model)


FAILS = {
    "boundary": {"prefix", "tools", "images"},  # the chats, whose later requests restore an earlier state
    "slot": {"concurrent"},  # only prompts prefilled together share a slot
    "pixels": {"images"},  # only prompts with images hold pads
    "attn_res": {"prefix", "tools", "concurrent", "cancel", "shifted", "long", "repeat", "images"},  # decode
}


@pytest.mark.parametrize("break_", list(FAILS))
def test_each_break_fails_exactly_its_scenarios(serve, checkpoint, reference, break_):
    tokenizer = Tokenizer.from_source(checkpoint)
    results = conform(serve, checkpoint, reference, broken_engine(checkpoint, break_), ALL)
    assert failing(results) == FAILS[break_], {n: r.notes for n, r in results.items()}
    if break_ == "boundary":
        # turn 1 filled the cache; turn 2 is the first to restore it, and parts at its first generated token
        parting = results["prefix"].parting
        assert (parting.request, parting.position) == ("turn 2", len(chat_ids(tokenizer, growing_chat()[1])))
        assert results["tools"].parting.request == "turn 2"
    elif break_ == "slot":
        # the lone requests agree; the first token comes from the (right) prefill, the second is the first
        # decoded on the shared state
        parting = results["concurrent"].parting
        assert parting.request.endswith("(concurrent)")
        assert parting.position == len(equal_length_prompts(tokenizer)[0]) + 1
    elif break_ == "pixels":
        # image a filled the cache; image b, the same ids, resumes from a's blocks: its first token parts
        name, messages, b = image_chats()[1]
        parting = results["images"].parting
        assert (parting.request, parting.position) == (name, len(chat_ids(tokenizer, messages, b)))
    else:
        parting = results["repeat"].parting
        assert (parting.request, parting.position) == ("repeat 1", len(prompt_ids(tokenizer)["en"]) + 1)


def test_images_are_skipped_without_a_tower_on_either_side(serve, checkpoint, reference):
    """`images` needs k3's reference to see pixels (a checkpoint with a vision tower) and the engine to take
    them: a text-only reference, or an engine that answers images with a 4xx, skip it saying which."""
    from k3.conform.reference import CheckpointReference

    text_only = CheckpointReference(K3ForCausalLM.from_pretrained(checkpoint))
    results = conform(serve, checkpoint, text_only, Engine(reference_model(checkpoint)), ["images"])
    assert results["images"].passed and "no vision tower" in results["images"].skipped
    results = conform(
        serve, checkpoint, reference, Engine(K3ForCausalLM.from_pretrained(checkpoint)), ["images"]
    )
    assert results["images"].passed and "the engine refuses images: " in results["images"].skipped
    assert "HTTP 400" in results["images"].skipped and "no vision tower" in results["images"].skipped


def test_an_image_prompt_other_than_k3s_is_named_by_tokenize(serve, checkpoint, reference, monkeypatch):
    """An engine that writes an image's prompt otherwise (here k3's own server with the size left out of
    `image WxH`) parts from k3 in `images`, and its /tokenize ids show where: at the size's first token."""
    import k3.engine.chat_inputs

    def sizeless(original, tokens):
        return image_prompt((0, 0), tokens)

    monkeypatch.setattr(k3.engine.chat_inputs, "image_prompt", sizeless)
    results = conform(serve, checkpoint, reference, Engine(reference_model(checkpoint)), ["images"])
    tokenizer = Tokenizer.from_source(checkpoint)
    name, messages, images = image_chats()[0]
    want = chat_ids(tokenizer, messages, images)
    monkeypatch.undo()
    assert not results["images"].passed
    sizeless_prompts = [image_prompt((0, 0), im.tokens) for im in images]
    theirs = chat_prompt(messages, image_prompts=sizeless_prompts).ids(tokenizer, add_generation_prompt=True)
    first = next(i for i, (a, b) in enumerate(zip(theirs, want, strict=False)) if a != b)
    assert tokenizer.decode(want[first:]).startswith(("112x84", "12x84", "2x84", "x84", "84"))
    assert (
        f"{name} (/tokenize): the engine's chat ids part from k3's at token {first}"
        in results["images"].notes
    )
