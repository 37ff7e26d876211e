"""The reply parser: encode an assistant message as the release does, parse the ids back (at once and
token by token) and get the same structure; broken and truncated tool calls are reported, never raised;
markers never reach the text."""

from __future__ import annotations

import json
import random

import pytest
from chat_corpus import conversation

from k3.chat.encoder import chat_segments, segment_ids
from k3.chat.normalize import JSON_BLOCK, normalize_message
from k3.chat.parser import ReplyParser, parse_reply


def assistant_output(tok, message: dict, thinking: bool = True) -> list[int]:
    """The ids the model writes for `message`: its encoding after the generation prompt, i.e. without
    the `message` header and the channel the prompt already opened."""
    segments = chat_segments([message], add_generation_prompt=False, thinking=thinking, thinking_effort=None)
    body = [s for s in segments if s.assistant]
    assert [s.text for s in body[:3]] == ["<|open|>", "think" if thinking else "response", "<|sep|>"]
    return segment_ids(tok, body[3:])


def expected(message: dict) -> tuple[str, str, list[tuple[str, object]]]:
    """(reasoning, content, [(name, arguments)]) as the parser should read them back."""
    m = normalize_message(message)
    reasoning = m.get("reasoning_content") or m.get("reasoning")
    reasoning = str(reasoning) if reasoning is not None and str(reasoning).strip() else ""
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "<|kimi_image_placeholder|>") for p in content)
    calls = []
    for call in m.get("tool_calls") or []:
        fn = call.get("function", call)
        calls.append((fn["name"], fn[JSON_BLOCK] if JSON_BLOCK in fn else fn["arguments"]))
    return reasoning, content or "", calls


def assistants(seeds) -> list[dict]:
    out = []
    for seed in seeds:
        out += [m for m in conversation(seed)[0] if m["role"] == "assistant"]
    return out


def read_back(reply) -> list[tuple[str, object]]:
    calls = []
    for call in reply.tool_calls:
        try:
            calls.append((call.name, json.loads(call.arguments)))
        except ValueError:
            calls.append((call.name, call.arguments))
    return calls


@pytest.mark.parametrize("thinking", [True, False])
def test_encode_then_parse_gives_the_message_back(tok, thinking: bool) -> None:
    messages = [m for m in assistants(range(40)) if not isinstance(m.get("content"), list)]
    assert sum(bool(m.get("tool_calls")) for m in messages) > 15
    for message in messages:
        ids = assistant_output(tok, message, thinking)
        reply = parse_reply(tok, ids, thinking)
        reasoning, content, calls = expected(message)
        assert reply.error is None
        assert reply.reasoning == (reasoning if thinking else "")
        assert reply.content == content
        assert read_back(reply) == calls
        assert [c.index for c in reply.tool_calls] == list(range(len(calls)))


def test_token_by_token_deltas_add_up_to_the_whole(tok) -> None:
    for message in assistants(range(40, 64)):
        ids = assistant_output(tok, message)
        parser = ReplyParser(tok)
        reasoning, content, calls = "", "", []
        for token in ids:
            d = parser.push(token)
            reasoning, content, calls = reasoning + d.reasoning, content + d.content, calls + d.tool_calls
        d = parser.flush()
        reasoning, content, calls = reasoning + d.reasoning, content + d.content, calls + d.tool_calls
        whole = parse_reply(tok, ids)
        assert (reasoning, content, calls) == (whole.reasoning, whole.content, whole.tool_calls)
        assert parser.done


def xtml(tok, text: str) -> list[int]:
    return tok.encode(text, allowed_special="all")


CALL = '<|open|>call tool="get_weather" index="1"<|sep|>'
ARG = '<|open|>argument key="days" type="number"<|sep|>{}<|close|>argument<|sep|>'
GOOD = "<|open|>tools<|sep|>" + CALL + ARG.format("3") + "<|close|>call<|sep|>"


@pytest.mark.parametrize(
    "broken, why",
    [
        (ARG.format("three"), "not a number"),
        ('<|open|>argument key="x" type="object"<|sep|>[1]<|close|>argument<|sep|>', "not a object"),
        ("stray text", "text inside a call"),
        ('<|open|>argument type="string"<|sep|>v<|close|>argument<|sep|>', "without a key"),
        ("<|open|>response<|sep|>", "where none belongs"),
    ],
)
def test_a_broken_call_is_reported_with_its_raw_text(tok, broken: str, why: str) -> None:
    text = "r<|close|>think<|sep|><|open|>response<|sep|>ok<|close|>response<|sep|>" + GOOD
    text += CALL + broken + "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
    reply = parse_reply(tok, xtml(tok, text))
    assert why in (reply.error or "")
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("get_weather", {"days": 3})]
    assert reply.reasoning == "r" and reply.content.startswith("ok" + CALL)  # the raw call, as written
    assert broken.split("<|")[0] in reply.content or broken in reply.content


def test_a_truncated_call_is_kept_as_text(tok) -> None:
    text = "<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>" + GOOD + CALL
    text += '<|open|>argument key="city" type="string"<|sep|>Par'
    reply = parse_reply(tok, xtml(tok, text))
    assert "truncated" in reply.error
    assert (
        len(reply.tool_calls) == 1
        and reply.content == CALL + '<|open|>argument key="city" type="string"<|sep|>Par'
    )


def test_markers_never_leak_and_junk_never_raises(tok) -> None:
    """Random ids (a third of them markers) never raise, and well-formed channels never show markers."""
    rng = random.Random(0)
    s = tok.special
    pool = [s.open, s.close, s.sep, s.eos] + list(range(0, 700))
    for _ in range(300):
        ids = [
            rng.choice(pool) if rng.random() < 0.5 else rng.choice([s.open, s.close, s.sep])
            for _ in range(60)
        ]
        reply = parse_reply(tok, ids, thinking=rng.random() < 0.5)
        if reply.error is None:
            assert "<|open|>" not in reply.content + reply.reasoning
    reply = parse_reply(
        tok, xtml(tok, "a<|open|>bogus x<|sep|>b<|close|>think<|sep|>c<|close|>message<|sep|>z")
    )
    assert (reply.reasoning, reply.content, reply.error) == ("ab", "c", None)


def test_a_marker_without_a_header_gives_its_text_back(tok) -> None:
    words = "word " * 80
    reply = parse_reply(tok, xtml(tok, f"a<|open|>{words}<|close|>think<|sep|>b<|open|>tail"))
    assert (reply.reasoning, reply.content, reply.error) == ("a" + words, "btail", None)
    deep = "[" * 5000 + "]" * 5000
    text = "<|close|>think<|sep|>" + GOOD.replace(">3<", ">" + deep + "<").replace("number", "array")
    assert "not a array" in parse_reply(tok, xtml(tok, text)).error


def test_an_element_that_cannot_sit_here_closes_the_ones_it_cannot_sit_in(tok) -> None:
    """`<|open|>response` inside the think channel ends it; `<|close|>message` ends everything."""
    reply = parse_reply(tok, xtml(tok, "think<|open|>response<|sep|>say" + GOOD + "<|close|>message<|sep|>"))
    assert (reply.reasoning, reply.content, reply.error) == ("think", "say", None)
    assert [c.name for c in reply.tool_calls] == ["get_weather"]
