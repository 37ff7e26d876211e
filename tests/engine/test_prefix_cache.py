"""The engine's prefix cache on a random `tiny` model: a prompt resumed from any stored boundary gives the
very logits (bit for bit) and tokens of a fresh prefill with the same chunk boundaries; against the engine
without the cache (other chunk boundaries) within a stated bound; experts, seeds, n > 1, cancellation,
eviction, and state files (restart, foreign / outdated / truncated / corrupt ones refused)."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from k3.config import K3Config
from k3.engine import state_store
from k3.engine.generate import Engine
from k3.engine.images import load_image
from k3.engine.prefix_cache import PrefixCache, PromptImages
from k3.engine.sampling import SamplingParams
from k3.engine.sequence import EngineError, Status
from k3.model import K3ForCausalLM, K3ForConditionalGeneration

INTERVAL = 16
GREEDY = SamplingParams(temperature=0, max_tokens=4)
# Logits of the engine with the cache (chunks end every 16 tokens) against the engine without it (one
# 2,048-token chunk): measured max |diff| 1.5e-6 on logits of max |value| 3.4 (fp32, this model).
CHUNKING_BOUND = 1e-4


@pytest.fixture(scope="module")
def model() -> K3ForCausalLM:
    return K3ForCausalLM.from_config(K3Config.preset("tiny"), seed=0)


def ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def cache(model: K3ForCausalLM, **kw) -> PrefixCache:
    return PrefixCache(
        kw.pop("interval", INTERVAL), kw.pop("max_bytes", 2**30), state_store.checkpoint_identity(model), **kw
    )


def run(model, pc, prompt, params=GREEDY, **kw):
    """(sequence, logits [steps, V] every token was drawn from) of one prompt on a fresh engine."""
    engine = Engine(model, record_logits=True, prefix_cache=pc)
    seq = engine.submit(prompt, params, **kw)
    logits = []
    while engine.has_work:
        logits += [e.logits for e in engine.step() if e.logits is not None]
    return seq, torch.stack(logits)


def test_resume_from_every_boundary_equals_fresh_prefill(model) -> None:
    """A 85-token prompt resumed from each boundary 0, 16, ..., 80 (the cache warmed by a prompt that
    ends just past it) gives the fresh prefill's logits bit for bit, and `cached` says where it resumed."""
    prompt = ids(85)
    fresh, want = run(model, cache(model), prompt)
    assert fresh.cached == 0
    for b in range(0, 81, INTERVAL):
        pc = cache(model)
        if b:
            run(model, pc, prompt[:b] + [7])
        seq, got = run(model, pc, prompt)
        assert seq.cached == b
        assert seq.output == fresh.output
        assert torch.equal(got, want), f"resumed at {b}: max diff {(got - want).abs().max()}"


def test_same_prompt_again_resumes_below_its_end(model) -> None:
    """A prompt of exactly 4 blocks asked twice: the second resumes at 48 (one token is left to prefill:
    its logits give the first token) and equals the first."""
    pc, prompt = cache(model), ids(64, seed=1)
    first, want = run(model, pc, prompt)
    again, got = run(model, pc, prompt)
    assert (first.cached, again.cached) == (0, 48)
    assert torch.equal(got, want) and again.output == first.output


def test_against_the_engine_without_cache_within_the_bound(model) -> None:
    prompt = ids(300, seed=2)
    with_cache, a = run(model, cache(model), prompt, SamplingParams(temperature=0, max_tokens=8))
    without, b = run(model, None, prompt, SamplingParams(temperature=0, max_tokens=8))
    assert with_cache.output == without.output
    assert (a - b).abs().max() < CHUNKING_BOUND


def test_experts_seeds_and_n_choices(model) -> None:
    """Two sampled choices of one prompt (seeds 5 and 6) submitted together with record_experts: the
    second resumes from the first's blocks; both equal their runs alone on an empty cache: the tokens and
    the prompt's experts exactly, the log-probs up to the rounding of a 2-row decode batch against 1 row."""
    pc, prompt = cache(model), ids(70, seed=3)
    engine = Engine(model, prefix_cache=pc)
    params = [SamplingParams(temperature=1.0, max_tokens=5, seed=s) for s in (5, 6)]
    done = engine.complete([prompt, prompt], params, record_experts=True)
    seqs_cached = [pc.stats.hits, pc.stats.cached_tokens]
    assert seqs_cached == [1, 64]
    for c, p in zip(done, params, strict=True):
        [alone] = Engine(model, prefix_cache=cache(model)).complete([prompt], p, record_experts=True)
        assert c.tokens == alone.tokens
        assert max(abs(x - y) for x, y in zip(c.logprobs, alone.logprobs, strict=True)) < 1e-5
        assert c.experts.shape == alone.experts.shape
        assert torch.equal(c.experts[: len(prompt)], alone.experts[: len(prompt)])


def test_blocks_without_experts_are_completed_by_a_recording_prompt(model) -> None:
    pc, prompt = cache(model), ids(40, seed=4)
    run(model, pc, prompt)  # stores 2 blocks, no experts
    seq, _ = run(model, pc, prompt, record_experts=True)
    assert seq.cached == 0  # they cannot give experts: recomputed, and now they have them
    assert all(b.experts is not None for b in pc.blocks.values())
    seq, _ = run(model, pc, prompt, record_experts=True)
    assert seq.cached == 32


def test_cancelled_prefill_leaves_its_finished_blocks(model) -> None:
    pc, prompt = cache(model), ids(100, seed=5)
    engine = Engine(model, prefix_cache=pc)
    seq = engine.submit(prompt, GREEDY)
    for _ in range(3):  # three 16-token chunks
        engine.step()
    engine.cancel(seq)
    assert seq.status is Status.FINISHED and len(pc.blocks) == 3
    again, _ = run(model, pc, prompt)
    fresh, _ = run(model, cache(model), prompt)
    assert again.cached == 48 and again.output == fresh.output


def test_eviction_under_a_tiny_budget(model) -> None:
    """Room for 2 blocks: a 100-token prompt keeps its first 2 blocks (storing never evicts a block's own
    ancestors); another prompt's blocks then evict them (least recently used first); the budget is never
    passed and every request still runs, unchanged. A budget below one block stores nothing."""
    one = cache(model)
    run(model, one, ids(20))
    block = next(iter(one.blocks.values())).nbytes
    pc = cache(model, max_bytes=2 * block + block // 2)
    prompt = ids(100, seed=6)
    seq, got = run(model, pc, prompt)
    _, want = run(model, cache(model), prompt)
    assert torch.equal(got, want)
    assert pc.bytes <= pc.max_bytes and sorted(b.end for b in pc.blocks.values()) == [16, 32]
    again, got = run(model, pc, prompt)
    assert again.cached == 32 and torch.equal(got, want)
    other = ids(40, seed=60)
    run(model, pc, other)
    assert pc.stats.evicted == 2 and pc.bytes <= pc.max_bytes
    assert run(model, pc, other)[0].cached == 32 and run(model, pc, prompt)[0].cached == 0
    tiny = cache(model, max_bytes=block // 2)  # not even one block fits: nothing stored, nothing fails
    seq, got = run(model, tiny, prompt)
    assert len(tiny.blocks) == 0 and torch.equal(got, want)


def test_prompt_logprobs_are_recomputed(model) -> None:
    """Scoring needs every position's logits: such a prompt never resumes from the cache (it may store)."""
    pc, prompt = cache(model), ids(50, seed=7)
    run(model, pc, prompt)
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    seq, _ = run(model, pc, prompt, scoring)
    ref, _ = run(model, None, prompt, scoring)
    assert seq.cached == 0 and len(seq.prompt_logprobs) == 50
    diff = torch.tensor(seq.prompt_logprobs[1:]) - torch.tensor(ref.prompt_logprobs[1:])
    assert diff.abs().max() < CHUNKING_BOUND


def test_state_dir_survives_a_restart_and_refuses_bad_files(model, tmp_path: Path, caplog) -> None:
    prompt = ids(90, seed=8)
    first, want = run(model, cache(model, state_dir=tmp_path), prompt)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) == 5
    restarted = cache(model, state_dir=tmp_path)  # a new server on the same folder
    assert len(restarted.blocks) == 5
    seq, got = run(model, restarted, prompt)
    assert seq.cached == 80 and torch.equal(got, want)

    # damage the chain: block 2 truncated, block 3 from another checkpoint, block 4 of an older format
    by_end = {int(state_store.read(f, restarted.identity)[1]["end"]): f for f in files}
    by_end[32].write_bytes(by_end[32].read_bytes()[:-100])
    for end, meta in ((48, {"identity": "another-checkpoint"}), (64, {"format": "k3-state-0"})):
        tensors, old = state_store.read(by_end[end], restarted.identity)
        state_store.write(by_end[end], tensors, meta.get("identity", restarted.identity), old)
        if "format" in meta:
            raw = by_end[end].read_bytes().replace(state_store.FORMAT.encode(), b"k3-state-0")
            by_end[end].write_bytes(raw)
    with caplog.at_level(logging.WARNING, logger="k3.prefix_cache"):
        again = cache(model, state_dir=tmp_path)
    refused = "\n".join(r.getMessage() for r in caplog.records)
    assert "not a readable safetensors file" in refused
    assert "written for checkpoint 'another-checkpoint'" in refused
    assert "format 'k3-state-0'" in refused
    assert "parent block is missing" in refused  # block 5 hangs off the refused ones
    assert len(again.blocks) == 1  # block 1 only
    seq, got = run(model, again, prompt)
    assert seq.cached == 16 and torch.equal(got, want)  # recomputed from 16 on, same logits
    assert len(cache(model, state_dir=tmp_path).blocks) == 5  # the recomputed blocks replaced the bad files


def test_a_corrupt_file_is_refused(model, tmp_path: Path) -> None:
    run(model, cache(model, state_dir=tmp_path), ids(20, seed=9))
    [f] = tmp_path.glob("*.safetensors")
    raw = bytearray(f.read_bytes())
    raw[-5] ^= 0xFF  # one byte of tensor data
    f.write_bytes(bytes(raw))
    pc = cache(model, state_dir=tmp_path)
    assert not pc.blocks and "does not match its checksum" in pc.stats.refused[0]


def test_new_weights_empty_the_cache(model) -> None:
    pc = cache(model)
    engine = Engine(model, prefix_cache=pc)
    engine.complete([ids(40)], GREEDY)
    assert pc.blocks
    engine.load_weights(model.state_dict(), version=1)
    assert not pc.blocks and pc.identity == engine.identity()


def test_save_and_restore_one_sequence_state(model, tmp_path: Path) -> None:
    """llama.cpp's slot save/restore: a finished sequence's state (prompt + reply) saved to a file, read by
    a new engine, continued with the next turn: the logits equal the same forwards run without the file."""
    prompt, turn = ids(30, seed=10), ids(12, seed=11)
    engine = Engine(model)
    seq = engine.submit(prompt, SamplingParams(temperature=0, max_tokens=5), keep_state=True)
    while engine.has_work:
        engine.step()
    state = engine.state_of(seq)
    assert state.tokens == (prompt + seq.output)[: len(prompt) + 4]  # the last token was never fed
    engine.save_state(state, str(tmp_path / "slot.safetensors"))

    other = Engine(model, record_logits=True)
    loaded = other.load_state(str(tmp_path / "slot.safetensors"))
    assert loaded.tokens == state.tokens
    nxt = state.tokens + [seq.output[-1]] + turn
    cont = other.submit(nxt, SamplingParams(temperature=0, max_tokens=3), state=loaded)
    got = []
    while other.has_work:
        got += [e.logits for e in other.step() if e.logits is not None]
    assert cont.cached == len(state.tokens)

    want = []  # the reference: the same forwards by hand (prefill, 4 decode steps, then the rest)
    with torch.no_grad():
        c = model.new_cache(1)
        model(torch.tensor([prompt]), c, logits_to_keep=1)
        for t in seq.output[:4]:
            model(torch.tensor([[t]]), c)
        step = model(torch.tensor([nxt[len(state.tokens) :]]), c, logits_to_keep=1)[0, -1]
        for t in cont.output[:2]:
            want.append(step)
            step = model(torch.tensor([[t]]), c)[0, -1]
        want.append(step)
    assert torch.equal(torch.stack(got), torch.stack(want))

    with pytest.raises(EngineError, match="extend"):
        other.submit(prompt, GREEDY, state=loaded)
    foreign = Engine(K3ForCausalLM.from_config(K3Config.preset("tiny"), seed=1))
    with pytest.raises(state_store.StateFileError, match="written for checkpoint"):
        foreign.load_state(str(tmp_path / "slot.safetensors"))


def test_prompt_images_key_the_rows_their_pads_hold() -> None:
    """`PromptImages.media` names, for a span of positions, each image (by content hash) and its rows
    there, from the pad positions alone: written out here by walking the prompt."""
    pad = 9
    prompt = [1, 2, pad, pad, pad, 3, pad, pad, 4, 5]  # image "a": 3 pads at 2-4, image "b": 2 at 6-7
    images = PromptImages(prompt, pad, [("a", 3), ("b", 2)])
    assert images.media(0, 2) == b"" and images.media(8, 10) == b""
    assert images.media(0, 4) == b"a[0:2]"
    assert images.media(4, 8) == b"a[2:3]|b[0:2]"
    assert images.media(0, 10) == b"a[0:3]|b[0:2]"
    assert images.media(7, 8) == b"b[1:2]"


@pytest.fixture(scope="module")
def vision_model() -> K3ForConditionalGeneration:
    return K3ForConditionalGeneration.from_config(K3Config.preset("tiny"), seed=2)


def image(seed: int, w: int = 64, h: int = 48):
    buf = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, "PNG")
    return load_image(buf.getvalue())


def test_images_are_cached_by_their_pixels_bit_for_bit(vision_model, tmp_path: Path) -> None:
    """A prompt with an image (text, the image's pads, text) is stored past its image: asked again with
    the same image it resumes past the pads, with the same image after a restart from the state dir too,
    and gives a fresh prefill's logits bit for bit. The same ids with other pixels resume only from the
    text before the first pad, and give their own fresh prefill's logits (they had never been cached)."""
    a, b = image(1), image(2)
    assert a.tokens == b.tokens and a.key != b.key
    pad = vision_model.media_pad_id
    prompt = ids(21, seed=5) + [pad] * a.tokens + ids(30, seed=6)
    first_pad = 21
    pc = cache(vision_model, state_dir=tmp_path)
    _, want_a = run(vision_model, cache(vision_model), prompt, images=[a])  # fresh, the same chunks
    _, want_b = run(vision_model, cache(vision_model), prompt, images=[b])
    assert not torch.equal(want_a, want_b)  # the pixels matter

    stored, got = run(vision_model, pc, prompt, images=[a])
    assert stored.cached == 0 and torch.equal(got, want_a)
    deepest = (len(prompt) - 1) // INTERVAL * INTERVAL
    for again in (pc, cache(vision_model, state_dir=tmp_path)):  # the same cache, then read back
        seq, got = run(vision_model, again, prompt, images=[a])
        assert seq.cached == deepest > first_pad + a.tokens
        assert torch.equal(got, want_a)
    seq, got = run(vision_model, pc, prompt, images=[b])
    assert seq.cached == first_pad // INTERVAL * INTERVAL > 0
    assert torch.equal(got, want_b)
    text_only, _ = run(vision_model, pc, prompt)  # the same ids without pixels: not the image's blocks
    assert text_only.cached == first_pad // INTERVAL * INTERVAL


def test_images_are_keyed_by_their_pixels_not_their_bytes(vision_model, tmp_path: Path) -> None:
    """States kept on disk name an image by what the tower read: an engine after a restart that prepares the
    same bytes into other pixels (another k3's preprocessing: here the same content hash given other pixels)
    resumes only from the text before the image; the same pixels resume past it."""
    from k3.engine.images import ImageInput

    a, b = image(1), image(2)
    pad = vision_model.media_pad_id
    prompt = ids(21, seed=5) + [pad] * a.tokens + ids(30, seed=6)
    run(vision_model, cache(vision_model, state_dir=tmp_path), prompt, images=[a])
    same_bytes_other_pixels = ImageInput(a.key, b.item)
    seq, got = run(
        vision_model, cache(vision_model, state_dir=tmp_path), prompt, images=[same_bytes_other_pixels]
    )
    assert seq.cached == 21 // INTERVAL * INTERVAL
    _, want = run(vision_model, cache(vision_model), prompt, images=[b])
    assert torch.equal(got, want)
    seq, _ = run(
        vision_model, cache(vision_model, state_dir=tmp_path), prompt, images=[ImageInput(b.key, a.item)]
    )
    assert seq.cached == (len(prompt) - 1) // INTERVAL * INTERVAL  # other bytes, the same pixels
