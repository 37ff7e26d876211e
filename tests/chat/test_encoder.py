"""K3's chat encoder against the release's (NeMo Automodel 0.7.0 `kimi_k3/encoding.py` + its tokenizer):
the same segments and the same token ids for a generated corpus covering every element, and the same
refusals for invalid conversations."""

from __future__ import annotations

import copy
import json

import pytest
from chat_corpus import conversation

from k3.chat.encoder import chat_segments, encode_chat, render_chat
from k3.chat.xtml import ChatFormatError
from k3.tokenizer.kimi import release_pieces

CORPUS = range(64)


def segments_of(messages, tools, options) -> list[tuple[str, bool, bool]]:
    return [(s.text, s.special, s.assistant) for s in chat_segments(messages, tools, **options)]


def test_corpus_covers_every_element() -> None:
    """The corpus really holds every element (so the comparison below is over all of them)."""
    texts = set()
    for seed in CORPUS:
        messages, options = conversation(seed)
        options = dict(options)
        texts.add(render_chat(messages, options.pop("tools", None), **options))
    rendered = "\n".join(texts)
    for element in [
        'role="system"<|sep|>',
        'role="system" name=',
        'role="user" name="Zoë &quot;Z&quot; &amp; co"',
        'role="assistant" name=',
        'type="tool-declare"<|sep|># Tools',
        "## New Tools Available",
        *[f"thinking_effort={e}`" for e in ("low", "medium", "high", "max")],
        "<|open|>think<|sep|><|close|>think<|sep|>",  # empty reasoning, still structural
        "<|open|>response<|sep|><|close|>response<|sep|>",  # empty content
        '<|open|>call tool="odd &quot;name&quot; &amp; co" index="2"<|sep|>',
        *[f'type="{t}"<|sep|>' for t in ("string", "number", "boolean", "null", "object", "array")],
        '<|open|>json type="object"<|sep|>not json {',
        'role="tool" tool="get_weather" index="3"',
        'type="tool-choice"<|sep|>The system is invoked with `tool_choice=required`',
        "`tool_choice=none`",
        "`response_format=json_object`",
        "`response_format=json_schema`",
        "<|kimi_image_placeholder|>",
        "<|reserved_token_800|>",
        'role="assistant"<|sep|><|open|>think<|sep|>',  # generation prompt, thinking
    ]:
        assert element in rendered, element
    assert any(t.endswith('role="assistant"<|sep|><|open|>response<|sep|>') for t in texts)
    # several tool results re-sorted into call order, by id
    assert any(
        [m["tool_call_id"] for m in conversation(seed)[0] if "tool_call_id" in m]
        != sorted(m["tool_call_id"] for m in conversation(seed)[0] if "tool_call_id" in m)
        for seed in CORPUS
    )


@pytest.mark.parametrize("seed", CORPUS)
def test_segments_and_ids_equal_the_release(seed: int, tok, release) -> None:
    encoding, release_tok = release
    messages, options = conversation(seed)
    tools = options.pop("tools", None)
    before = copy.deepcopy(messages)
    want = [
        (s.text, s.allow_special, s.is_assistant)
        for s in encoding.build_chat_segments(messages, tools, **options)
    ]
    assert segments_of(messages, tools, options) == want
    ids = release_tok.apply_chat_template(messages, tools=tools, tokenize=True, **options)
    assert encode_chat(tok, messages, tools, **options) == ids
    assert messages == before  # the caller's messages are not touched


def test_thinking_effort_defaults_to_max_as_the_release_tokenizer(tok, release) -> None:
    _, release_tok = release
    messages = [{"role": "user", "content": "hola"}]
    want = release_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert encode_chat(tok, messages) == want
    off = release_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, thinking=False)
    assert encode_chat(tok, messages, thinking=False) == off
    assert "thinking-effort" not in render_chat(messages, thinking=False)


def test_long_runs_are_cut_as_the_release_cuts_them(tok, release) -> None:
    """Runs of over 25,000 non-space or space characters are encoded in pieces (ids depend on the cut)."""
    _, release_tok = release
    text = "ab" * 13_000 + " " * 25_003 + "x"
    assert [len(p) for p in release_pieces(text)] == [25_000, 1_000 + 25_000, 3 + 1]
    assert tok.encode(text) == release_tok.encode(text, allow_special_tokens=False)
    messages = [{"role": "user", "content": text}]
    assert encode_chat(tok, messages) == release_tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True
    )


BAD = [
    ([{"role": "user", "content": "x"}], {"thinking_effort": "extreme"}),
    ([{"role": "tool", "content": "orphan"}], {}),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}, {"role": "tool"},
      {"role": "tool"}], {}),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]}], {}),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 7}}]}], {}),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}], {}),
    ([{"role": "assistant", "tool_calls": [{"function": "f"}]}], {}),
    ([{"content": "no role"}], {}),
    ([{"role": "user", "content": [{"text": "no type"}]}], {}),
    ([{"role": "user", "content": [{"type": "text"}]}], {}),
    ([{"role": "user", "content": 42}], {}),
    ([{"role": "user", "content": [{"type": "image"}]}], {"image_prompts": []}),
    ([{"role": "user", "content": [{"type": "image"}]}], {"image_prompts": ["<a>", "<b>"]}),
    ([{"role": "user", "content": "two <|kimi_image_placeholder|><|kimi_image_placeholder|>"}],
     {"image_prompts": ["<a>"]}),
]  # fmt: skip


@pytest.mark.parametrize("case", range(len(BAD)))
def test_invalid_conversations_are_refused_as_the_release_refuses_them(case: int, release) -> None:
    encoding, _ = release
    messages, options = BAD[case]
    with pytest.raises(Exception) as theirs:
        encoding.build_chat_segments(messages, **{"thinking_effort": None, **options})
    with pytest.raises(ChatFormatError) as ours:
        chat_segments(messages, **{"thinking_effort": None, **options})
    assert "\n" not in str(ours.value)
    if type(theirs.value) is ValueError:  # the release's own messages: the same words
        assert str(theirs.value) in str(ours.value)


def test_thinking_off_ignores_the_effort_and_drops_the_think_channel(release) -> None:
    encoding, _ = release
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "r"},
    ]
    want = [s.text for s in encoding.build_chat_segments(messages, thinking=False, thinking_effort="bogus")]
    got = [s.text for s in chat_segments(messages, thinking=False, thinking_effort="bogus")]
    assert got == want and "think" not in "".join(got)


def test_arguments_of_every_type_are_written_with_their_type() -> None:
    args = {"s": "x", "n": 2.5, "i": 3, "b": True, "z": None, "o": {"k": [1]}, "a": [1, "2"]}
    call = {"id": "c1", "function": {"name": "f", "arguments": json.dumps(args)}}
    text = render_chat([{"role": "assistant", "tool_calls": [call]}], add_generation_prompt=False)
    for key, kind, value in [
        ("s", "string", "x"),
        ("n", "number", "2.5"),
        ("i", "number", "3"),
        ("b", "boolean", "true"),
        ("z", "null", "null"),
        ("o", "object", '{"k": [1]}'),
        ("a", "array", '[1, "2"]'),
    ]:
        assert f'<|open|>argument key="{key}" type="{kind}"<|sep|>{value}<|close|>argument<|sep|>' in text
