"""Prompts with images through the stream: the vision stage (tower + projector) before the embedding,
against the same schedule with every weight resident (bit for bit) and against
`K3ForConditionalGeneration`'s ordinary forward (to rounding, the text stream's bound); `k3 stream` reads
`"images"` on prompt lines and `k3 stream compare` takes the result."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from test_exactness import MODEL_BOUND, greedy, same
from typer.testing import CliRunner

from k3.checkpoint import open_checkpoint
from k3.cli import app
from k3.engine.images import image_prompt_ids, load_image
from k3.model.multimodal import K3ForConditionalGeneration
from k3.stream.api import stream_logits
from k3.stream.runner import StreamError, StreamOptions, fingerprint
from k3.tokenizer.kimi import Tokenizer
from k3.vision.preprocess import prepare


def picture(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def test_image_prompts_equal_the_multimodal_forward_and_the_resident_run(checkpoints):
    path = checkpoints("tiny")
    pad = open_checkpoint(path).config.media_placeholder_token_id
    a, b, c = (prepare([picture(w, h, s)]) for s, (w, h) in enumerate([(56, 84), (90, 40), (28, 28)]))
    prompts = [
        [5, 6, pad, 7, 8],  # the one-pad form: expanded by the runner
        [9, *[pad] * b.tokens, 10, *[pad] * c.tokens, 11],  # the expanded form, two images
        [12, 13, 14],  # no image
    ]
    images = [[a], [b, c], []]
    options = StreamOptions(all_positions=True, max_new_tokens=2)
    streamed = stream_logits(path, prompts, options, images=images)
    resident = stream_logits(path, prompts, options, images=images, resident=True)
    for key, value in streamed.outputs.items():
        assert same(value.contiguous(), resident.outputs[key].contiguous()), key
    vision = streamed.summary["dense_bytes_per_pass"][0] - streamed.summary["dense_bytes_per_pass"][1]
    assert vision > 0  # the first pass read the tower, the second did not (besides other embedding rows)

    model = K3ForConditionalGeneration.from_pretrained(path)
    expanded = [[5, 6, *[pad] * a.tokens, 7, 8], prompts[1], prompts[2]]
    assert streamed.outputs["lengths"].tolist() == [len(p) for p in expanded]
    worst = 0.0
    with torch.no_grad():
        for p, (ids, ims) in enumerate(zip(expanded, images, strict=True)):
            want = model(torch.tensor([ids]), images=ims)[0]  # [T, V]
            got = streamed.outputs["logits"][p, : len(ids)]
            worst = max(worst, float((got - want).abs().max() / want.abs().max()))
            cache = model.new_cache(1)
            first = int(model(torch.tensor([ids]), cache, images=ims)[0, -1].argmax())
            then = int(model(torch.tensor([[first]]), cache)[0, -1].argmax())
            assert streamed.outputs["generated"][p].tolist() == [first, then]
    print(f"image prompts: max |dlogit| / max |logit| = {worst:.2e}")
    assert worst <= MODEL_BOUND
    # the text-only prompt is what it is without the others' images
    assert streamed.outputs["generated"][2].tolist() == greedy(model, prompts[2], 2)


def test_bad_image_prompts_and_the_fingerprint(checkpoints):
    path = checkpoints("tiny")
    pad = open_checkpoint(path).config.media_placeholder_token_id
    a = prepare([picture(56, 84, 0)])
    with pytest.raises(StreamError, match=r"2 <\|media_pad\|> placeholders.*need 6"):
        stream_logits(path, [[1, pad, pad, 2]], images=[[a]])
    with pytest.raises(StreamError, match="1 prompts, images for 2"):
        stream_logits(path, [[1, pad]], images=[[a], []])
    other = prepare([picture(56, 84, 1)])  # same size, other pixels: another job for a scratch folder
    options = StreamOptions()
    assert fingerprint("x", 1, [[1, pad]], options, [[a]]) != fingerprint(
        "x", 1, [[1, pad]], options, [[other]]
    )
    assert fingerprint("x", 1, [[1]], options, [[]]) == fingerprint("x", 1, [[1]], options)


def test_cli_image_lines_and_compare(tmp_path):
    path = tmp_path / "tiny"  # `k3 init`: with a tokenizer, for the text line
    assert CliRunner().invoke(app, ["init", str(path), "--preset", "tiny", "--seed", "3"]).exit_code == 0
    tok = Tokenizer.from_dir(path)
    picture(56, 84, 0).save(tmp_path / "a.png")
    picture(90, 40, 1).save(tmp_path / "b.png")
    pad = tok.special_tokens["<|media_pad|>"]
    rows = [{"text": "what is this", "images": ["a.png"]}, {"input_ids": [3, pad, 4], "images": ["b.png"]}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    args = ["stream", str(path), "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out)]
    result = CliRunner().invoke(app, [*args, "--all-positions", "--threads", "1"])
    assert result.exit_code == 0, result.output

    # the other engine: K3ForConditionalGeneration on the prompt `k3 generate --image` builds
    a, b = (load_image((tmp_path / n).read_bytes()) for n in ("a.png", "b.png"))
    ids = [image_prompt_ids(tok, a) + tok.encode("what is this"), [3, *[pad] * b.tokens, 4]]
    model = K3ForConditionalGeneration.from_pretrained(path)
    T = max(map(len, ids))
    logits = torch.zeros(2, T, model.config.vocab_size)
    with torch.no_grad():
        for p, (x, im) in enumerate(zip(ids, [a, b], strict=True)):
            logits[p, : len(x)] = model(torch.tensor([x]), images=[im.item])[0]
    from safetensors.torch import save_file

    save_file(
        {"logits": logits, "lengths": torch.tensor([len(x) for x in ids])}, str(tmp_path / "o.safetensors")
    )
    compared = CliRunner().invoke(
        app, ["stream", "compare", str(out), str(tmp_path / "o.safetensors"), "--json"]
    )
    assert compared.exit_code == 0, compared.output
    for row, x in zip(json.loads(compared.output), ids, strict=True):
        assert row["positions"] == len(x) and row["top1"] == 1.0 and row["max_abs"] < 1e-4

    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "x", "images": ["missing.png"]}) + "\n")
    bad = CliRunner().invoke(
        app, ["stream", str(path), "--prompts", str(tmp_path / "bad.jsonl"), "--out", str(out)]
    )
    assert bad.exit_code != 0 and "bad.jsonl:1: missing.png: no such image file" in bad.output


def test_the_memory_bound_counts_the_vision_stage(checkpoints):
    from k3.stream.bound import memory_bound
    from k3.stream.plan import StreamPlan
    from k3.vision.bound import vision_memory_bound

    path = checkpoints("tiny")
    a = prepare([picture(56, 84, 0)])
    with open_checkpoint(path) as ckpt:
        plan = StreamPlan(ckpt)
    cfg = plan.config
    text = memory_bound(plan, StreamOptions(), [[1, 2]])
    with_image = memory_bound(plan, StreamOptions(), [[1, 2]], [[a]])
    assert "vision" not in text
    tower = vision_memory_bound(cfg.vision_config, a.pixels.shape[0], cfg.hidden_size)["total"]
    assert with_image["vision"] == plan.vision.nbytes + tower
    assert with_image["total"] == text["total"] + with_image["vision"]
