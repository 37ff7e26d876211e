"""The conform client reads llama.cpp's server (tools/server of the llama.cpp that llama-cpp-python 0.3.36
vendors, commit 0c1e570) as it answers: completions' logprobs in the chat format with each token's id, and
a chat prompt's ids through `/apply-template` then `/tokenize`, since its `/tokenize` ignores messages.
The answers below have the shape that server returned to `k3 conform` here (docs/conform.md)."""

from __future__ import annotations

import json
import math

import httpx

from k3.conform.client import EngineClient
from k3.conform.reference import Expected
from k3.conform.report import ScenarioResult, hold
from k3.tokenizer.kimi import Tokenizer


def entry(token: int, logprob: float, alternatives: list[tuple[int, float]]) -> dict:
    """One token as llama.cpp's server writes it (its `token` text is not what the client reads)."""
    return {
        "id": token,
        "token": f"\ufffd{token}",
        "bytes": [255, *str(token).encode()],
        "logprob": logprob,
        "top_logprobs": [
            {"id": t, "token": f"\ufffd{t}", "bytes": [255], "logprob": v} for t, v in alternatives
        ],
    }


def llama_server(seen: list[tuple[str, dict]]):
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        seen.append((request.url.path, body))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "mini-f32.gguf"}]})
        if request.url.path == "/v1/completions":
            content = [entry(7, -0.5, [(7, -0.5), (9, -1.25)]), entry(3, -0.25, [(3, -0.25), (7, -2.0)])]
            return httpx.Response(200, json={"choices": [{"text": "..", "logprobs": {"content": content}}]})
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [] if "messages" in body else [11, 12, 13]})
        if request.url.path == "/apply-template":
            return httpx.Response(200, json={"prompt": '<|open|>message role="user"<|sep|>hi'})
        return httpx.Response(404)

    return httpx.MockTransport(handle)


def client_on(checkpoint, seen: list) -> EngineClient:
    client = EngineClient("http://engine.test/v1", Tokenizer.from_source(checkpoint))
    client.http = httpx.Client(transport=llama_server(seen))
    return client


def test_completions_in_llama_cpps_format_are_read_by_token_id(checkpoint):
    client = client_on(checkpoint, [])
    gen = client.complete([1, 2, 3], max_tokens=2)
    assert gen.tokens == [7, 3]
    assert [r.logprob for r in gen.returned] == [-0.5, -0.25]
    assert gen.returned[0].top == {7: -0.5, 9: -1.25} and gen.returned[1].top == {3: -0.25, 7: -2.0}


def test_chat_ids_through_apply_template_and_tokenize(checkpoint):
    seen: list[tuple[str, dict]] = []
    client = client_on(checkpoint, seen)
    assert client.tokenize_chat([{"role": "user", "content": "hi"}]) == [11, 12, 13]
    paths = [path for path, _ in seen]
    assert paths[-3:] == ["/tokenize", "/apply-template", "/tokenize"]
    assert seen[-1][1] == {
        "model": "mini-f32.gguf",
        "content": seen[-1][1]["content"],
        "add_special": False,
        "parse_special": True,
    }
    assert seen[-1][1]["content"].startswith("<|open|>message")


def test_a_token_llama_cpp_folds_into_the_next_entry_keeps_its_position(checkpoint):
    """llama.cpp's server gives a token whose text is an incomplete UTF-8 sequence no entry of its own: its
    bytes lead the next entry's (seen on `mini`: 8 tokens generated, 7 entries). The client recovers it,
    without a logprob, so that the tokens after it keep their positions."""
    tokenizer = Tokenizer.from_source(checkpoint)
    folded, after = 300, 301
    merged = entry(after, -0.75, [(after, -0.75)])
    merged["bytes"] = list(tokenizer.token_bytes(folded) + tokenizer.token_bytes(after))

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        content = [entry(7, -0.5, [(7, -0.5)]), merged]
        return httpx.Response(200, json={"choices": [{"text": "..", "logprobs": {"content": content}}]})

    client = EngineClient("http://engine.test/v1", tokenizer)
    client.http = httpx.Client(transport=httpx.MockTransport(handle))
    gen = client.complete([1, 2], max_tokens=3)
    assert gen.tokens == [7, folded, after]
    assert math.isnan(gen.returned[1].logprob) and gen.returned[2].logprob == -0.75

    result = ScenarioResult("x")  # the report leaves the folded token unscored
    wants = [Expected([t], [lp], None) for t, lp in ((7, -0.5), (123, -9.0), (after, -0.75))]
    hold(result, "r", gen.returned, wants, [2, 3, 4], 2e-3, str)
    assert result.passed and result.positions == 2 and result.unscored == 1
