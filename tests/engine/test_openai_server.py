"""The OpenAI-compatible server on 127.0.0.1, serving a random `tiny` checkpoint, driven by the official
`openai` client. Expected tokens come from the engine run directly (greedy), expected log-probabilities
from one full forward of a separate copy of the model, never from the server."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from k3.chat.encoder import encode_chat
from k3.chat.parser import parse_reply
from k3.engine.generate import Engine
from k3.engine.outputs import token_text
from k3.engine.sampling import SamplingParams
from k3.engine.server import create_app
from k3.model import K3ForCausalLM
from k3.tokenizer.kimi import Tokenizer

NAME = "k3-tiny"
TEXT = "El modelo lee el texto y cuenta las palabras"


@pytest.fixture(scope="module")
def served(tiny_checkpoint, live_server) -> Iterator[tuple[str, Tokenizer, K3ForCausalLM]]:
    """The server, its tokenizer, and a separate copy of the model for the expected values."""
    tok = Tokenizer.from_dir(tiny_checkpoint)
    app = create_app(Engine(K3ForCausalLM.from_pretrained(tiny_checkpoint), max_batch=4), tok, NAME)
    with live_server(app) as base:
        yield base, tok, K3ForCausalLM.from_pretrained(tiny_checkpoint)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0, timeout=60)


def greedy(model: K3ForCausalLM, prompt: list[int], max_tokens: int, stop: set[int]) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_ids=stop)
    return Engine(model).generate([prompt], params)[0]


def log_softmax(model: K3ForCausalLM, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] float64 log-softmax of one forward; row i predicts ids[i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0].double(), -1)


def stops(tok: Tokenizer) -> set[int]:
    return {tok.special.eos, tok.special.end_of_msg}


def test_models_and_health(served, client) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(f"{served[0]}/health").json()["status"] == "ok"


def test_completion_plain_and_streamed(served, client) -> None:
    _, tok, model = served
    want_ids = greedy(model, tok.encode(TEXT), 12, stops(tok))
    want = tok.decode(want_ids)
    r = client.completions.create(model=NAME, prompt=TEXT, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == want
    assert r.usage.prompt_tokens == len(tok.encode(TEXT))
    assert r.usage.completion_tokens == len(want_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason == ("length" if len(want_ids) == 12 else "stop")
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt=TEXT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == len(want_ids)
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 1  # really streamed


def test_chat_plain_and_streamed(served, client) -> None:
    _, tok, model = served
    messages = [{"role": "system", "content": "Eres útil."}, {"role": "user", "content": "¿Qué es un token?"}]
    want_ids = greedy(model, encode_chat(tok, messages), 10, stops(tok))
    want = parse_reply(tok, want_ids)
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.content
    assert r.choices[0].message.model_extra["reasoning_content"] == want.reasoning
    assert r.usage.prompt_tokens == len(encode_chat(tok, messages))
    assert r.usage.completion_tokens == len(want_ids)
    chunks = list(
        client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content", "") for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (reasoning, content) == (want.reasoning, want.content)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_echo_scoring_equals_one_forward(served, client) -> None:
    """max_tokens 0 + echo + logprobs (log-likelihood scoring): every prompt position's log-prob and its
    5 most likely alternatives, in order, equal the log-softmax of one full forward."""
    _, tok, model = served
    ids = tok.encode(TEXT)
    r = client.completions.create(model=NAME, prompt=TEXT, max_tokens=0, echo=True, logprobs=5)
    c = r.choices[0]
    assert c.text == TEXT and c.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)
    lp = c.logprobs
    assert lp.tokens == [token_text(tok, t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = log_softmax(model, ids)
    expected = want[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(
        torch.tensor(lp.token_logprobs[1:], dtype=torch.float64), expected, atol=1e-5, rtol=0
    )
    for i, top in enumerate(lp.top_logprobs[1:]):
        values, best = torch.topk(want[i], 5)
        assert list(top) == [token_text(tok, t) for t in best.tolist()]  # in order
        torch.testing.assert_close(
            torch.tensor(list(top.values()), dtype=torch.float64), values, atol=1e-5, rtol=0
        )
    assert lp.text_offset == [len(tok.decode(ids[:i])) for i in range(len(ids))]


def test_completion_logprobs_with_echo_cover_prompt_and_output(served, client) -> None:
    _, tok, model = served
    ids = tok.encode(TEXT)
    out = greedy(model, ids, 6, stops(tok))
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=6, echo=True, logprobs=2, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == tok.decode(ids) + tok.decode(out)
    assert lp.tokens == [token_text(tok, t) for t in ids + out]
    full = ids + out
    want = log_softmax(model, full)[:-1].gather(1, torch.tensor(full[1:])[:, None])[:, 0]
    torch.testing.assert_close(
        torch.tensor(lp.token_logprobs[1:], dtype=torch.float64), want, atol=1e-5, rtol=0
    )


def test_chat_logprobs_at_temperature_zero(served, client) -> None:
    """Chat logprobs of the greedy reply equal the forward's log-softmax; top_logprobs are its 5 largest,
    in order (the first being the chosen token)."""
    _, tok, model = served
    messages = [{"role": "user", "content": "Cuenta hasta tres."}]
    prompt = encode_chat(tok, messages)
    out = greedy(model, prompt, 8, stops(tok))
    r = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5
    )
    content = r.choices[0].logprobs.content
    assert [bytes(e.bytes) for e in content] == [tok.token_bytes(t) for t in out]
    want = log_softmax(model, prompt + out)[len(prompt) - 1 : -1]
    got = torch.tensor([e.logprob for e in content], dtype=torch.float64)
    torch.testing.assert_close(got, want.gather(1, torch.tensor(out)[:, None])[:, 0], atol=1e-5, rtol=0)
    for e, row in zip(content, want, strict=True):
        values, best = torch.topk(row, 5)
        assert [t.token for t in e.top_logprobs] == [token_text(tok, t) for t in best.tolist()]
        torch.testing.assert_close(
            torch.tensor([t.logprob for t in e.top_logprobs], dtype=torch.float64), values, atol=1e-5, rtol=0
        )
        assert e.top_logprobs[0].token == e.token


def test_n_with_seed_is_reproducible(served, client) -> None:
    """n=3 sampled choices at T=1: the same again with the same seed, different from each other, and each
    token's log-prob is the forward's log-softmax (T=1, top_p=1: the distribution sampled from)."""
    _, tok, model = served
    ids_of = {token_text(tok, i): i for i in range(tok.vocab_size)}

    def run():
        return client.completions.create(
            model=NAME, prompt=TEXT, max_tokens=10, n=3, seed=7, logprobs=0, temperature=1
        )

    a, b = run(), run()
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [(c.text, c.logprobs.token_logprobs) for c in a.choices] == [
        (c.text, c.logprobs.token_logprobs) for c in b.choices
    ]
    assert len({c.text for c in a.choices}) > 1
    assert a.usage.prompt_tokens == len(tok.encode(TEXT))
    assert a.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in a.choices)
    prompt = tok.encode(TEXT)
    for c in a.choices:
        out = [ids_of[t] for t in c.logprobs.tokens]
        want = log_softmax(model, prompt + out)[len(prompt) - 1 :].gather(1, torch.tensor(out)[:, None])[:, 0]
        torch.testing.assert_close(
            torch.tensor(c.logprobs.token_logprobs, dtype=torch.float64), want, atol=1e-5, rtol=0
        )
    chat = [{"role": "user", "content": "Hola"}]
    x, y = (
        client.chat.completions.create(model=NAME, messages=chat, max_tokens=6, n=3, seed=3) for _ in range(2)
    )
    assert [c.message.model_extra["reasoning_content"] for c in x.choices] == [
        c.message.model_extra["reasoning_content"] for c in y.choices
    ]


def test_streamed_choices_equal_plain_ones(served, client) -> None:
    """Two prompts x n=2, seeded: the streamed chunks, gathered by index, equal the plain response."""
    _, tok, _ = served
    kw = {"model": NAME, "prompt": [TEXT, "Otra"], "max_tokens": 6, "n": 2, "seed": 11, "logprobs": 0}
    plain = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts, logprobs = [""] * 4, [[] for _ in range(4)]
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] += choice.text
        logprobs[choice.index] += choice.logprobs.token_logprobs
    assert texts == [c.text for c in plain.choices]
    for got, want in zip(logprobs, [c.logprobs.token_logprobs for c in plain.choices], strict=True):
        assert got == pytest.approx(want, abs=1e-5)  # other batch compositions: rounding only
    assert chunks[-1].usage == plain.usage
    assert plain.usage.prompt_tokens == len(tok.encode(TEXT)) + len(tok.encode("Otra"))


def test_stop_string_across_token_boundaries(served, client) -> None:
    """A stop string made of the end of one generated token and the start of the next."""
    _, tok, model = served
    full = client.completions.create(
        model=NAME, prompt=TEXT, max_tokens=16, temperature=0, logprobs=0
    ).choices[0]
    text, pieces, offsets = full.text, full.logprobs.tokens, full.logprobs.text_offset

    def plain(piece: str) -> bool:
        return bool(piece) and not piece.startswith("bytes:") and "<|" not in piece

    found = [
        (i, stop)
        for i in range(len(pieces) - 1)
        if plain(pieces[i]) and plain(pieces[i + 1])
        for stop in [pieces[i][-1] + pieces[i + 1][0]]
        if text.index(stop) == offsets[i] + len(pieces[i]) - 1  # its first occurrence starts in token i
    ]
    assert found, f"no two plain neighbouring tokens in {pieces}"
    i, stop = found[0]
    cut = text[: text.index(stop)]
    r = client.completions.create(model=NAME, prompt=TEXT, max_tokens=16, temperature=0, stop=[stop, "zzzz"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens <= i + 2  # generation ended once the stop was seen
    chunks = list(
        client.completions.create(
            model=NAME, prompt=TEXT, max_tokens=16, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"


def test_token_id_prompts_equal_string_prompts(served, client) -> None:
    _, tok, _ = served
    other = "Una frase distinta"
    a, b = tok.encode(TEXT), tok.encode(other)

    def run(prompt):
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0, logprobs=1)
        return [(c.text, c.logprobs.token_logprobs) for c in r.choices], r.usage.prompt_tokens

    def same(x: list, y: list) -> None:  # texts equal; logprobs too, but for batch-order rounding
        assert [t for t, _ in x] == [t for t, _ in y]
        for (_, u), (_, v) in zip(x, y, strict=True):
            assert u == pytest.approx(v, abs=1e-5)

    same(run(TEXT)[0], run(a)[0])
    (both, used), (both_ids, used_ids) = run([TEXT, other]), run([a, b])
    same(both, both_ids)
    assert used == used_ids == len(a) + len(b)
    same(both, run(TEXT)[0] + run(other)[0])


def test_tokenize_and_detokenize(served) -> None:
    base, tok, _ = served
    r = httpx.post(f"{base}/tokenize", json={"model": NAME, "prompt": TEXT}).json()
    assert r["tokens"] == tok.encode(TEXT) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 8192
    assert httpx.post(f"{base}/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": TEXT}
    messages = [{"role": "user", "content": "Hola"}]
    r = httpx.post(f"{base}/tokenize", json={"messages": messages}).json()
    assert r["tokens"] == encode_chat(tok, messages)


def test_a_body_over_the_servers_limit_is_413_in_openais_shape(tiny_checkpoint, live_server) -> None:
    tok = Tokenizer.from_dir(tiny_checkpoint)
    engine = Engine(K3ForCausalLM.from_pretrained(tiny_checkpoint))
    with live_server(create_app(engine, tok, NAME, max_request_bytes=4096)) as base:
        limited = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        assert limited.completions.create(model=NAME, prompt=TEXT, max_tokens=1).choices[0].text is not None
        with pytest.raises(openai.APIStatusError) as refused:
            limited.completions.create(model=NAME, prompt=TEXT * 100, max_tokens=1)
        assert refused.value.status_code == 413 and "limit of 4,096 bytes" in refused.value.message
        assert refused.value.code == "request_too_large"
        assert httpx.get(f"{base}/health").json()["status"] == "ok"  # and it serves on
