"""The prompt's media tokens, K3ForConditionalGeneration (a checkpoint with its tower: written by `k3 init`,
loaded, validated; text paths unchanged; images isolated), and the config's vision_config."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import noise_image

from k3.census import census_from_headers
from k3.checkpoint import open_checkpoint, save_checkpoint
from k3.config import ConfigError, K3Config
from k3.model import K3ForCausalLM, K3ForConditionalGeneration, ModelLoadError
from k3.model.init import init_checkpoint, random_tensors
from k3.tokenizer.build import builtin_tokenizer
from k3.vision.config import VisionConfig, VisionConfigError, media_token_ids
from k3.vision.preprocess import prepare
from k3.vision.prompt import PromptError, expand_placeholders, image_prompt

PAD = 9


def test_expand_placeholders_both_forms_and_the_error():
    one_pad = [1, PAD, 2, PAD, 3]
    expanded = [1, PAD, PAD, PAD, 2, PAD, PAD, 3]
    assert expand_placeholders(one_pad, PAD, [3, 2]) == expanded
    assert expand_placeholders(expanded, PAD, [3, 2]) == expanded
    with pytest.raises(PromptError, match=r"has 3 <\|media_pad\|> placeholders.*need 5 \(\[3, 2\]"):
        expand_placeholders([1, PAD, PAD, PAD, 2], PAD, [3, 2])
    with pytest.raises(PromptError, match="has 1 .* 2 images need 5"):
        expand_placeholders([1, PAD], PAD, [3, 2])


def test_image_prompt_tokens():
    """`<|media_begin|>image {w}x{h}<|media_content|>` + N pads + `<|media_end|>`, ids 163602-163605 in K3."""
    assert media_token_ids(163840) == {"begin": 163602, "content": 163603, "end": 163604, "pad": 163605}
    tok = builtin_tokenizer(1024)
    ids = media_token_ids(1024)
    text = image_prompt((303, 181), 3)
    got = tok.encode(text, allowed_special="all")
    assert got[0] == ids["begin"] and got[-5:] == [ids["content"], *[ids["pad"]] * 3, ids["end"]]
    assert tok.decode(got[1:-5]) == "image 303x181"
    assert image_prompt((1, 1), 1, expanded=False).count("<|media_pad|>") == 1


def test_config_parses_vision_and_round_trips():
    cfg = K3Config.preset("k3")
    v = cfg.vision_config
    assert (v.vt_hidden_size, v.head_dim, v.vt_num_hidden_layers, v.projector_ln_eps) == (1024, 128, 27, 1e-5)
    assert cfg.media_placeholder_token_id == 163605
    assert K3Config.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()
    text_only = cfg.to_dict()
    del text_only["vision_config"], text_only["media_placeholder_token_id"]
    assert K3Config.from_dict(text_only).vision_config is None
    with pytest.raises(VisionConfigError, match="vision_config.norm_type"):
        VisionConfig(norm_type="layernorm")
    with pytest.raises(ConfigError, match="media_placeholder_token_id"):
        K3Config.from_dict({**cfg.to_dict(), "media_placeholder_token_id": 10**9})


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("vision") / "tiny"
    init_checkpoint(K3Config.preset("tiny"), out, seed=3)
    return out


def test_loads_and_runs_and_text_is_unchanged(tiny_dir):
    model = K3ForConditionalGeneration.from_pretrained(tiny_dir)
    text = K3ForCausalLM.from_pretrained(tiny_dir)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(model(ids), text(ids))
    cache_a, cache_b = model.new_cache(), text.new_cache()  # prefill + one fused decode step, unchanged
    model(ids, cache_a), text(ids, cache_b)
    step = torch.tensor([[9]])
    assert torch.equal(model(step, cache_a), text(step, cache_b))


def test_isolation_of_text_before_an_image_and_of_other_images(tiny_dir):
    """Changing image B changes nothing of image A's rows (bit for bit) nor of the logits before B (causal
    text model; to float rounding: the batched kernels' sums run over the whole chunk)."""
    model = K3ForConditionalGeneration.from_pretrained(tiny_dir)
    pad = model.media_pad_id
    a, b = prepare([noise_image(50, 30, seed=1)]), prepare([noise_image(40, 40, seed=2)])
    b2 = prepare([noise_image(40, 40, seed=3)])
    ids = expand_placeholders([1, 2, pad, 3, 4, pad, 5], pad, [a.tokens, b.tokens])
    x = torch.tensor([ids])
    first, second = model(x, images=[a, b]), model(x, images=[a, b2])
    before_b = ids.index(pad, ids.index(3))
    assert (first[:, :before_b] - second[:, :before_b]).abs().max() < 1e-5 * first.abs().max()
    assert (first[:, before_b:] - second[:, before_b:]).abs().max() > 1e-2 * first.abs().max()
    fa, _ = model.encode_images([a, b])
    fa2, _ = model.encode_images([a, b2])
    assert torch.equal(fa, fa2)
    with pytest.raises(PromptError, match="placeholders"):
        model(torch.tensor([[1, pad, 2]]), images=[a])


def test_validation_names_the_wrong_tensor(tmp_path):
    cfg = K3Config.preset("tiny")
    bad = "vision_tower.encoder.blocks.1.wo.weight"
    tensors = ((n, torch.zeros(3, 3) if n == bad else t) for n, t in random_tensors(cfg, vision=True))
    save_checkpoint(tensors, cfg, tmp_path / "bad")
    with pytest.raises(ModelLoadError, match=rf"mis-shaped.*\n.*{bad}: \[3, 3\] in the checkpoint"):
        K3ForConditionalGeneration.from_pretrained(tmp_path / "bad")
    K3ForCausalLM.from_pretrained(tmp_path / "bad")  # the text model does not read the tower
    with open_checkpoint(tmp_path / "bad") as ckpt:  # `k3 inspect`'s cross-check names it too
        headers = [(t.name, t.dtype, t.shape) for t in ckpt.tensors()]
    findings = census_from_headers(cfg, headers, "bad").findings
    assert findings == [
        f"1 mis-shaped tensor(s) vs config: {bad}: (3, 3) in the checkpoint, (32, 32) from the config"
    ]


def test_text_only_checkpoint_loads_as_today(tmp_path):
    cfg = K3Config.preset("tiny")
    raw = cfg.to_dict()
    del raw["vision_config"], raw["media_placeholder_token_id"]
    text_cfg = K3Config.from_dict(raw)
    init_checkpoint(text_cfg, tmp_path / "t")
    assert "vision_config" not in json.loads((tmp_path / "t" / "config.json").read_text())
    K3ForCausalLM.from_pretrained(tmp_path / "t")
    with pytest.raises(Exception, match="no vision_config"):
        K3ForConditionalGeneration.from_pretrained(tmp_path / "t")


def test_projector_width_is_the_text_models():
    """Where vision_config.text_hidden_size and the text model's hidden_size differ, the projector writes the
    text model's width, as NeMo (`_projector_config`) and vLLM do."""
    raw = K3Config.preset("tiny").to_dict()
    raw["vision_config"]["text_hidden_size"] = 7
    model = K3ForConditionalGeneration.from_config(K3Config.from_dict(raw))
    rows = model.encode_images([prepare([noise_image(30, 30)])])[0]
    assert rows.shape == (4, 64) and model.mm_projector.post_norm.weight.shape == (64,)


def test_prompts_with_images_resume_only_where_their_pixels_match(tiny_dir):
    """Two prompts of the same ids with different pixels: the second is not served the first one's stored
    states past the text before its pads (ids do not say which pixels the pads stand for: the blocks' keys
    name the images); the first image again resumes past its pads."""
    from helpers import png_bytes

    from k3.engine.generate import Engine
    from k3.engine.images import image_prompt_ids, load_image
    from k3.engine.prefix_cache import PrefixCache
    from k3.engine.sampling import SamplingParams
    from k3.engine.state_store import checkpoint_identity
    from k3.tokenizer.build import builtin_tokenizer

    model = K3ForConditionalGeneration.from_pretrained(tiny_dir)
    tok = builtin_tokenizer(model.config.vocab_size)
    cache = PrefixCache(4, 10**8, checkpoint_identity(model))
    engine = Engine(model, prefix_cache=cache)
    rng = torch.Generator().manual_seed(0)
    images = [
        load_image(png_bytes(torch.randint(0, 256, (30, 40, 3), generator=rng, dtype=torch.uint8).numpy()))
        for _ in range(2)
    ]

    def first_logprob(eng, image) -> float:
        seq = eng.submit(ids(image), SamplingParams(temperature=0, max_tokens=1), images=[image])
        while seq.status != "finished":
            eng.step()
        return seq.logprobs[0]

    def ids(image) -> list[int]:
        return image_prompt_ids(tok, image) + tok.encode("and then some more words")

    first_pad = ids(images[1]).index(model.media_pad_id)
    first_logprob(engine, images[0])
    got = first_logprob(engine, images[1])
    assert cache.stats.inserted > 0 and cache.stats.cached_tokens == first_pad // 4 * 4  # the text only
    again = cache.stats.cached_tokens
    first_logprob(engine, images[0])
    assert cache.stats.cached_tokens - again == (len(ids(images[0])) - 1) // 4 * 4  # past its pads
    # what a plain engine gives (to rounding: with a prefix cache chunks still end at its interval)
    assert got == pytest.approx(first_logprob(Engine(model), images[1]), rel=1e-5)
