"""`k3 chat` with images: `--image` and `/image PATH` attach images to the next user turn; the prompt is
the spec's image prompt placed by K3's chat encoder, and the reply is a direct forward's greedy token."""

from __future__ import annotations

import io

import numpy as np
import torch
import typer
from PIL import Image
from typer.testing import CliRunner

from k3.chat.encoder import encode_chat
from k3.engine import commands
from k3.engine.generate import Engine
from k3.model import K3ForConditionalGeneration
from k3.tokenizer.kimi import Tokenizer
from k3.vision.preprocess import open_image, prepare

app = typer.Typer()
app.command()(commands.chat)
app.command()(commands.generate)


def png(w: int, h: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def spelled(data: bytes) -> tuple[str, object]:
    """The spec's image prompt (K3-vision.md section 6) written out, and the prepared image."""
    item = prepare([open_image(data)])
    w, h = item.geometry.original
    return f"<|media_begin|>image {w}x{h}<|media_content|>{'<|media_pad|>' * item.tokens}<|media_end|>", item


def test_chat_attaches_images_to_the_next_turn(tiny_checkpoint, tmp_path, monkeypatch):
    a, b = png(61, 45, 1), png(30, 40, 2)
    (tmp_path / "a.png").write_bytes(a)
    (tmp_path / "b.png").write_bytes(b)
    calls = []  # (prompt ids, images, tokens yielded, engine) per turn
    original = Engine.stream

    def recording(self, prompt, params, images=None):
        calls.append((list(prompt), images, [], self))
        for token in original(self, prompt, params, images):
            calls[-1][2].append(token)
            yield token

    monkeypatch.setattr(Engine, "stream", recording)
    lines = f"/image {tmp_path / 'b.png'}\n¿Qué hay?\n/image {tmp_path / 'missing.png'}\nOtra vez\n"
    args = [
        "chat",
        str(tiny_checkpoint),
        "-n",
        "2",
        "-t",
        "0",
        "--no-thinking",
        "--image",
        str(tmp_path / "a.png"),
    ]
    r = CliRunner().invoke(app, args, input=lines)
    assert r.exit_code == 0, r.output
    assert "[b.png: 30x40, 4 tokens, next turn]" in r.output and "missing.png: " in r.output
    assert len(calls) == 2

    tok = Tokenizer.from_dir(tiny_checkpoint)
    (pa, ia), (pb, ib) = spelled(a), spelled(b)
    parts = [{"type": "image_url", "image_url": {"url": "x"}}] * 2 + [{"type": "text", "text": "¿Qué hay?"}]
    want = encode_chat(
        tok,
        [{"role": "user", "content": parts}],
        thinking=False,
        thinking_effort="max",
        image_prompts=[pa, pb],
    )
    ids, images, tokens, engine = calls[0]
    assert ids == want and [im.item.grid for im in images] == [ia.grid, ib.grid]
    model = K3ForConditionalGeneration.from_pretrained(tiny_checkpoint)
    with torch.no_grad():
        first = int(model(torch.tensor([want]), images=[ia, ib])[0, -1].argmax())
    assert tokens[0] == first
    # the second turn: text only, the first turn's images still in the prompt, not encoded again
    ids2, images2, _, _ = calls[1]
    pad = tok.special_tokens["<|media_pad|>"]
    assert ids2.count(pad) == ia.tokens + ib.tokens and len(images2) == 2
    assert engine.image_cache.encoded == 2


def test_chat_image_without_a_tower_is_one_line(tmp_path):
    from k3.config import K3Config
    from k3.model.init import init_checkpoint
    from k3.tokenizer.build import write_tokenizer

    cfg = K3Config.preset("tiny")
    cfg.vision_config = None
    init_checkpoint(cfg, tmp_path / "t")
    write_tokenizer(tmp_path / "t", 1024)
    (tmp_path / "a.png").write_bytes(png(20, 20, 0))
    r = CliRunner().invoke(
        app, ["chat", str(tmp_path / "t"), "--image", str(tmp_path / "a.png")], input="hi\n"
    )
    assert r.exit_code == 1 and "--image: this checkpoint has no vision tower" in r.output
