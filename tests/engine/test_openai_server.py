"""The OpenAI-compatible server on 127.0.0.1, serving a random `tiny` checkpoint, driven by the official
`openai` client (plain and streaming), plus raw HTTP for malformed requests, the full queue and
disconnects. Expected tokens come from the engine run directly (greedy), not from the server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from k3.config import K3Config
from k3.engine.chat import encode_chat, parse_reply
from k3.engine.generate import Engine
from k3.engine.sampling import SamplingParams
from k3.engine.server import create_app
from k3.model import K3ForCausalLM
from k3.model.init import init_checkpoint
from k3.tokenizer.build import write_tokenizer
from k3.tokenizer.kimi import Tokenizer

NAME = "k3-tiny"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    init_checkpoint(K3Config.preset("tiny"), out, seed=3)
    write_tokenizer(out, 1024)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(checkpoint: Path) -> Iterator[tuple[str, Engine, Tokenizer]]:
    model = K3ForCausalLM.from_pretrained(checkpoint)
    tok = Tokenizer.from_dir(checkpoint)
    engine = Engine(model, max_batch=2)
    app = create_app(engine, tok, NAME, max_queue=1)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.05)
    yield base, engine, tok
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0, timeout=60)


def expected(checkpoint: Path, prompt: list[int], max_tokens: int, stop: set[int]) -> list[int]:
    """Greedy tokens from a separate engine on the same checkpoint."""
    model = K3ForCausalLM.from_pretrained(checkpoint)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_ids=stop)
    return Engine(model).generate([prompt], params)[0]


def test_models_and_health(served, client) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(f"{served[0]}/health").json()["status"] == "ok"


def test_completion_plain_and_streamed(served, client, checkpoint) -> None:
    _, _, tok = served
    prompt = "El modelo lee el texto"
    stop = {tok.special.eos, tok.special.end_of_msg}
    want_ids = expected(checkpoint, tok.encode(prompt), 12, stop)
    want = tok.decode(want_ids)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == want
    assert r.usage.prompt_tokens == len(tok.encode(prompt))
    assert r.usage.completion_tokens == len(want_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason == ("length" if len(want_ids) == 12 else "stop")
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == len(want_ids)
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 1  # really streamed


def test_chat_plain_and_streamed(served, client, checkpoint) -> None:
    _, _, tok = served
    messages = [{"role": "system", "content": "Eres útil."}, {"role": "user", "content": "¿Qué es un token?"}]
    stop = {tok.special.eos, tok.special.end_of_msg}
    want_ids = expected(checkpoint, encode_chat(tok, messages), 10, stop)
    want = parse_reply(tok, want_ids)
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.content
    assert r.choices[0].message.model_extra["reasoning_content"] == want.reasoning
    assert r.usage.prompt_tokens == len(encode_chat(tok, messages))
    assert r.usage.completion_tokens == len(want_ids)
    stream = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content", "") for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (reasoning.strip(), content.strip()) == (want.reasoning, want.content)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_stop_strings(served, client, checkpoint) -> None:
    _, _, tok = served
    full = client.completions.create(model=NAME, prompt="Hola", max_tokens=12, temperature=0).choices[0].text
    if len(full) < 4:
        pytest.skip("the random model ended too early to plant a stop string")
    cut = full[2:4]
    r = client.completions.create(model=NAME, prompt="Hola", max_tokens=12, temperature=0, stop=[cut])
    assert r.choices[0].text == full[: full.index(cut)] and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": NAME}, 400, "prompt"),
        ({"model": NAME, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": NAME, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": NAME, "prompt": "x", "n": 2}, 400, "n"),
        ({"model": NAME, "prompt": ""}, 400, "prompt"),
        ({"model": NAME, "prompt": [99999]}, 400, "prompt"),
        ({"model": NAME, "prompt": "x", "max_tokens": 10**7}, 400, "max_tokens"),
        ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ],
)
def test_malformed_completions(served, body, status, param) -> None:
    r = httpx.post(f"{served[0]}/v1/completions", json=body)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param and error["message"]


def test_malformed_chat_and_json(served) -> None:
    base = served[0]
    r = httpx.post(f"{base}/v1/chat/completions", json={"model": NAME, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(
        f"{base}/v1/chat/completions", json={"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}
    )
    assert r.status_code == 400
    r = httpx.post(
        f"{base}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "error" in r.json()


def _open_stream(base: str, max_tokens: int = 8000) -> tuple[httpx.Client, httpx.Response, Iterator[str]]:
    """A streaming completion, read up to its first data line and left open (dropping the line iterator
    would close the connection)."""
    c = httpx.Client(timeout=60)
    body = {
        "model": NAME,
        "prompt": "uno dos tres",
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "stream": True,
        "ignore_eos": True,
    }
    r = c.send(c.build_request("POST", f"{base}/v1/completions", json=body), stream=True)
    assert r.status_code == 200
    lines = r.iter_lines()
    assert next(lines).startswith("data: ")
    return c, r, lines


def test_full_queue_429_and_disconnect_frees_cache(served) -> None:
    base, engine, _ = served
    open_ = [_open_stream(base) for _ in range(2)]  # max_batch 2: both decoding
    queued = httpx.Client(timeout=60)
    body = {"model": NAME, "prompt": "cuatro", "max_tokens": 8000, "stream": True, "ignore_eos": True}
    q = queued.send(
        queued.build_request("POST", f"{base}/v1/completions", json=body), stream=True
    )  # max_queue 1
    assert httpx.get(f"{base}/health").json()["in_flight"] == 3
    r = httpx.post(f"{base}/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    assert len(engine.running) == 2
    for c, resp, *_ in [*open_, (queued, q)]:  # the clients go away
        resp.close()
        c.close()
    for _ in range(300):
        if not engine.running and not engine.waiting and engine.batch is None:
            break
        time.sleep(0.05)
    assert not engine.running and not engine.waiting and engine.batch is None  # caches freed
    assert httpx.get(f"{base}/health").json()["in_flight"] == 0
    # and the server still answers
    r = httpx.post(f"{base}/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200


def test_disconnect_during_plain_request_frees_cache(served) -> None:
    base, engine, _ = served
    body = {"model": NAME, "prompt": "cinco", "max_tokens": 8000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", json=body, timeout=0.5)
    for _ in range(100):
        if not engine.running and not engine.waiting:
            break
        time.sleep(0.05)
    assert not engine.running and not engine.waiting and engine.batch is None
