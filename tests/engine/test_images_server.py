"""Images through the OpenAI server (a `tiny` checkpoint with its small tower), driven by the `openai`
client: a data-URL image's answer has the logprobs of one direct forward of the same ids and pixels
(built here from the spec's prompt format, not by the server); usage counts the image tokens; the encoded
image is cached by content hash; every bad-image class is a 400 naming it, and the server keeps serving."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from k3.chat.encoder import encode_chat
from k3.engine.generate import Engine
from k3.engine.server import create_app
from k3.model import K3ForConditionalGeneration
from k3.tokenizer.kimi import Tokenizer
from k3.vision.preprocess import open_image, prepare

NAME = "k3-tiny-vision"


def png(w: int, h: int, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_message(url: str, text: str = "¿Qué hay?") -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}],
        }
    ]


@pytest.fixture(scope="module")
def served(
    tiny_checkpoint, live_server
) -> Iterator[tuple[str, Tokenizer, K3ForConditionalGeneration, Engine]]:
    tok = Tokenizer.from_dir(tiny_checkpoint)
    engine = Engine(K3ForConditionalGeneration.from_pretrained(tiny_checkpoint), max_batch=4)
    app = create_app(engine, tok, NAME, max_images=2, max_image_tokens=40)
    with live_server(app) as base:
        yield base, tok, K3ForConditionalGeneration.from_pretrained(tiny_checkpoint), engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0, timeout=60)


def expected_prompt(tok: Tokenizer, data: bytes, text: str) -> tuple[list[int], object]:
    """The spec's image prompt (K3-vision.md section 6) written out here,
    `<|media_begin|>image WxH<|media_content|>` + N pads + `<|media_end|>`, placed by K3's chat encoder
    (k3.chat, checked against the release's) where the image part is."""
    item = prepare([open_image(data)])
    w, h = item.geometry.original
    prompt = f"<|media_begin|>image {w}x{h}<|media_content|>{'<|media_pad|>' * item.tokens}<|media_end|>"
    content = [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": text}]
    ids = encode_chat(tok, [{"role": "user", "content": content}], image_prompts=[prompt])
    sp = tok.special_tokens
    start = ids.index(sp["<|media_begin|>"])
    assert ids[start + 1 + len(tok.encode(f"image {w}x{h}"))] == sp["<|media_content|>"]
    assert ids.count(sp["<|media_pad|>"]) == item.tokens
    return ids, item


def test_logprobs_equal_a_direct_forward_and_usage_counts_image_tokens(served, client):
    _, tok, model, engine = served
    data = png(61, 45, seed=1)
    prompt, item = expected_prompt(tok, data, "¿Qué hay?")
    r = client.chat.completions.create(
        model=NAME, messages=image_message(data_url(data)), max_tokens=5, temperature=0, logprobs=True
    )
    assert r.usage.prompt_tokens == len(prompt) and item.tokens == 6  # 61x45 -> 84x56: 3 x 2 tokens
    content = r.choices[0].logprobs.content
    id_of = {tok.token_bytes(i): i for i in range(tok.vocab_size)}
    out = [id_of[bytes(e.bytes)] for e in content]
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids, images=[item])[0].double(), -1)
    want = logp[len(prompt) - 1 : -1].gather(1, torch.tensor(out)[:, None])[:, 0]
    torch.testing.assert_close(
        torch.tensor([e.logprob for e in content], dtype=torch.float64), want, atol=1e-5, rtol=0
    )
    # the same image again (a second turn): served from the content-hash cache, not encoded again
    before = engine.image_cache.encoded
    client.chat.completions.create(
        model=NAME, messages=image_message(data_url(data), "Otra vez"), max_tokens=1
    )
    assert engine.image_cache.encoded == before


def test_tokenize_gives_the_ids_a_chat_with_images_prefills(served):
    """vLLM's /tokenize of a chat with an image gives the ids /v1/chat/completions prefills (the spec's
    image prompt, written out here), under the server's image settings (it had refused image parts)."""
    import httpx

    base, tok, _, _ = served
    data = png(61, 45, seed=1)
    prompt, _ = expected_prompt(tok, data, "¿Qué hay?")
    r = httpx.post(f"{base}/tokenize", json={"messages": image_message(data_url(data))})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == prompt and r.json()["count"] == len(prompt)
    r = httpx.post(f"{base}/tokenize", json={"messages": image_message(data_url(png(200, 200)))})
    assert r.status_code == 400 and "over the limit of 40" in r.json()["error"]["message"]


def test_preparing_an_image_leaves_the_server_answering(served, monkeypatch):
    """An image is decoded and resized off the event loop: while one is being prepared (a large one, or a
    slow remote URL), the server answers others (it had waited for it: here, for ever)."""
    import threading

    import httpx

    from k3.engine import images

    base = served[0]
    load_image, started, answered = images.load_image, threading.Event(), threading.Event()

    def held_until_health_answers(*args, **kwargs):
        started.set()
        answered.wait(20)  # with the loop blocked, /health cannot answer: its timeout ends the wait
        return load_image(*args, **kwargs)

    monkeypatch.setattr(images, "load_image", held_until_health_answers)
    body = {"messages": image_message(data_url(png(61, 45, seed=1)))}
    tokenize = threading.Thread(
        target=httpx.post, args=(f"{base}/tokenize",), kwargs={"json": body, "timeout": 60}
    )
    tokenize.start()
    try:
        assert started.wait(10)
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200  # ReadTimeout: the loop was held
    finally:
        answered.set()
        tokenize.join()


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        (data_url(png(40, 30)[:60]), "truncated or corrupt"),
        (data_url(b"not an image at all"), "not an image Pillow can read"),
        (data_url(b"P6\n2 2\n255\n" + bytes(12), "image/x-portable-pixmap"), "unsupported image format PPM"),
        (data_url(bytes.fromhex("89504e470d0a1a0a0000000d4948445200000000000000050802000000")), "zero-size"),
        (data_url(png(200, 200)), "needs 64 tokens after resizing, over the limit of 40"),
        ("file:///etc/passwd", "file URL scheme is refused"),
        ("https://example.com/cat.png", "remote URLs are refused"),
        ("data:image/png;base64,@@@", "not valid base64"),
    ],
)
def test_bad_images_are_400_naming_the_problem(served, client, url, problem):
    with pytest.raises(openai.BadRequestError, match=problem):
        client.chat.completions.create(model=NAME, messages=image_message(url), max_tokens=1)
    r = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hola"}], max_tokens=1
    )
    assert r.choices[0].finish_reason in ("stop", "length")  # still serving


def test_too_many_images_and_decompression_bomb(served, client, monkeypatch):
    part = {"type": "image_url", "image_url": {"url": data_url(png(28, 28))}}
    with pytest.raises(openai.BadRequestError, match=r"more than 2 images in one request \(--max-images\)"):
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": [part] * 3}], max_tokens=1
        )
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # Pillow's own limit, in this process
    with pytest.raises(openai.BadRequestError, match="decompression bomb"):
        client.chat.completions.create(
            model=NAME, messages=image_message(data_url(png(30, 30))), max_tokens=1
        )


def test_new_weights_drop_the_image_rows_of_the_old_tower(tiny_checkpoint):
    """Images are cached as the tower's rows by content hash; after `Engine.load_weights` those rows belong
    to the old tower. An image seen before the swap is encoded again, and the answer is a fresh engine's on
    the new weights, logprobs included (with the old rows it was not)."""
    import hashlib

    from k3.engine.images import ImageInput
    from k3.engine.sampling import SamplingParams

    tok = Tokenizer.from_dir(tiny_checkpoint)
    data = png(61, 45, seed=2)
    prompt, item = expected_prompt(tok, data, "¿Qué hay?")
    image = ImageInput(hashlib.sha256(data).hexdigest(), item)
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1)

    def answer(engine: Engine) -> tuple[list[int], list[float]]:
        seq = engine.submit(prompt, params, images=[image])
        while engine.has_work:
            engine.step()
        return seq.output, seq.logprobs

    engine = Engine(K3ForConditionalGeneration.from_pretrained(tiny_checkpoint))
    before = answer(engine)
    new = K3ForConditionalGeneration.from_pretrained(tiny_checkpoint)
    with torch.no_grad():
        for name, weight in new.named_parameters():
            if name.startswith(("vision_tower.", "mm_projector.")):  # the tower and its projector only
                weight.mul_(1.5)
    engine.load_weights(new.state_dict(), 1)
    encoded = engine.image_cache.encoded
    after = answer(engine)
    assert engine.image_cache.encoded == encoded + 1
    assert after == answer(Engine(new)) and after[1] != before[1]
