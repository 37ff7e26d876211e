"""Tool calling and reasoning through `k3 serve`, driven by the official `openai` client.

The model is a random `tiny` checkpoint forced to write a planted reply (a logit bias on the next token of
a script, at the last position of every forward), so the parsed tool calls are known in advance. The
prompts the engine was given are recorded and compared with the release's encoder (NeMo Automodel
0.7.0's K3 tokenizer over the same tokenizer files), with /tokenize and with `k3 tokenize --chat`."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
import typer
from typer.testing import CliRunner

from k3.chat.encoder import render_chat
from k3.engine import commands
from k3.engine.generate import Engine
from k3.engine.server import create_app
from k3.model import K3ForCausalLM
from k3.tokenizer.kimi import Tokenizer

NAME = "k3-tiny"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}},
]
CALL = '<|open|>call tool="get_weather" index="1"<|sep|>'
SCRIPT = (
    "Need the weather.<|close|>think<|sep|><|open|>response<|sep|>Let me check.<|close|>response<|sep|>"
    "<|open|>tools<|sep|>"
    + CALL
    + '<|open|>argument key="city" type="string"<|sep|>París<|close|>argument<|sep|>'
    '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
    '<|open|>argument key="opts" type="object"<|sep|>{"units": "C", "hourly": false}<|close|>argument<|sep|>'
    '<|close|>call<|sep|><|open|>call tool="calc" index="2"<|sep|><|close|>call<|sep|>'
    "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
)
WANT_CALLS = [
    ("get_weather", {"city": "París", "days": 3, "opts": {"units": "C", "hourly": False}}),
    ("calc", {}),
]
BROKEN = (
    "<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>" + CALL
    + '<|open|>argument key="days" type="number"<|sep|>three<|close|>argument<|sep|><|close|>call<|sep|>'
    "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
)  # fmt: skip
MESSAGES = [{"role": "user", "content": "¿Qué tiempo hace en París?"}]


class Scripted(Engine):
    """An engine whose model writes `script` (token ids), then `<|end_of_msg|>`: every forward's last
    position gets +1e4 on the sequence's next scripted token and -1e4 elsewhere. Records each prompt."""

    def __init__(self, model: K3ForCausalLM, end: int, **kw) -> None:
        super().__init__(model, **kw)
        self.script: list[int] = []
        self.end = end
        self.prompts: dict[str, list[int]] = {}

    def _forward(self, ids, cache, seqs, keep):
        logits = super()._forward(ids, cache, seqs, keep)  # [B, T, V]
        for row, seq in enumerate(seqs):
            self.prompts[seq.id] = list(seq.prompt)
            n = len(seq.output)
            target = self.script[n] if n < len(self.script) else self.end
            logits[row, -1] = -1e4
            logits[row, -1, target] = 1e4
        return logits

    def last_prompt(self) -> list[int]:
        return list(self.prompts.values())[-1]


@pytest.fixture(scope="module")
def served(tiny_checkpoint, live_server) -> Iterator[tuple[str, Tokenizer, Scripted]]:
    tok = Tokenizer.from_dir(tiny_checkpoint)
    engine = Scripted(K3ForCausalLM.from_pretrained(tiny_checkpoint), tok.special.end_of_msg, max_batch=4)
    with live_server(create_app(engine, tok, NAME)) as base:
        yield base, tok, engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def release(tiny_checkpoint):
    tokenization = pytest.importorskip("nemo_automodel.components.models.kimi_k3.tokenization")
    return tokenization.TikTokenTokenizer.from_pretrained(str(tiny_checkpoint))


def plant(served, text: str) -> None:
    _, tok, engine = served
    engine.script = tok.encode(text, allowed_special="all")


def calls_of(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


def test_tool_calls_reach_the_openai_client(served, client, release) -> None:
    plant(served, SCRIPT)
    r = client.chat.completions.create(
        model=NAME, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=400
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert calls_of(choice.message.tool_calls) == WANT_CALLS
    assert [c.id for c in choice.message.tool_calls] == ["functions.get_weather:0", "functions.calc:1"]
    assert choice.message.content == "Let me check."
    assert choice.message.model_extra["reasoning_content"] == "Need the weather."
    prompt = served[2].last_prompt()  # what the engine prefilled == the release's encoding
    assert prompt == release.apply_chat_template(
        MESSAGES, tools=TOOLS, tokenize=True, add_generation_prompt=True
    )
    assert r.usage.prompt_tokens == len(prompt)
    body = {"model": NAME, "messages": MESSAGES, "tools": TOOLS}
    assert httpx.post(f"{served[0]}/tokenize", json=body).json()["tokens"] == prompt


def test_streamed_deltas_add_up_to_the_plain_answer(served, client) -> None:
    plant(served, SCRIPT)
    plain = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, temperature=0)
    chunks = list(
        client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, temperature=0, stream=True)
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for call in d.tool_calls or []:
            got = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            got["id"] += call.id or ""
            got["name"] += call.function.name or ""
            got["arguments"] += call.function.arguments or ""
    message = plain.choices[0].message
    assert reasoning == message.model_extra["reasoning_content"] and content == message.content
    assert [calls[i] for i in sorted(calls)] == [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls
    ]
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason == "tool_calls"
    assert sum(1 for d in deltas if d.content or (d.model_extra or {}).get("reasoning_content")) > 2


def test_tool_results_and_options_prefill_what_the_release_encodes(served, client, release) -> None:
    plant(served, SCRIPT)
    first = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, temperature=0)
    said = first.choices[0].message.model_dump(exclude_none=True)
    calls = said["tool_calls"]
    results = [  # out of call order: the release puts them back in order, by id
        {"role": "tool", "tool_call_id": calls[1]["id"], "content": "4"},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": '{"temp": 21, "sky": "claro & "}'},
    ]
    history = [*MESSAGES, said, *results]
    schema = {"type": "object", "properties": {"temp": {"type": "number"}}}
    cases = [
        ({}, {}),
        ({"reasoning_effort": "low"}, {"thinking_effort": "low"}),
        ({"reasoning_effort": "none"}, {"thinking": False}),
        (
            {"extra_body": {"chat_template_kwargs": {"thinking_effort": "medium"}}},
            {"thinking_effort": "medium"},
        ),
        ({"extra_body": {"chat_template_kwargs": {"thinking": False}}}, {"thinking": False}),
        ({"tool_choice": "required"}, {"tool_choice": "required"}),
        ({"tool_choice": "none"}, {"tool_choice": "none"}),
        ({"response_format": {"type": "json_object"}}, {"response_format": {"type": "json_object"}}),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}},
            {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}},
        ),
    ]
    for asked, options in cases:
        r = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS, max_tokens=4, **asked)
        want = release.apply_chat_template(
            history, tools=TOOLS, tokenize=True, add_generation_prompt=True, **options
        )
        assert served[2].last_prompt() == want, asked
        assert r.usage.prompt_tokens == len(want)


def test_a_broken_or_cut_call_is_reported_not_a_crash(served, client) -> None:
    plant(served, BROKEN)
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, temperature=0)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content.startswith(CALL)  # the raw call, kept
    chunks = list(client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, stream=True))
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    )
    plant(served, SCRIPT)
    cut = len(served[1].encode(SCRIPT.split("<|close|>call")[0], allowed_special="all"))
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=cut)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
    assert (
        r.choices[0].message.content
        == "Let me check." + SCRIPT.split("<|close|>call")[0].split("<|open|>tools<|sep|>")[1]
    )


def test_bad_chat_requests_are_400_naming_the_problem(served) -> None:
    base = served[0]
    for body, words in [
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"chat_template_kwargs": {"enable_thinking": True}}, "enable_thinking"),
        ({"chat_template_kwargs": {"thinking_effort": "lots"}}, "thinking_effort"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "resolvable tool name"),
    ]:
        r = httpx.post(f"{base}/v1/chat/completions", json={"model": NAME, "messages": MESSAGES, **body})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    r = httpx.post(f"{base}/tokenize", json={"messages": MESSAGES, "continue_final_message": True})
    assert r.status_code == 400


def test_tokenizer_endpoints_round_trip_and_agree_with_k3_tokenize(served, tiny_checkpoint) -> None:
    base, tok, engine = served
    text = "Hola <|open|> mundo"
    r = httpx.post(f"{base}/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"])
    assert "".join(r["token_strs"]) == text and r["max_model_len"] == engine.max_context
    assert httpx.post(f"{base}/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": text}
    body = {"messages": MESSAGES, "tools": TOOLS, "add_generation_prompt": False, "reasoning_effort": "high"}
    chat = httpx.post(f"{base}/tokenize", json=body).json()["tokens"]
    shown = render_chat(MESSAGES, TOOLS, add_generation_prompt=False, thinking_effort="high")
    assert httpx.post(f"{base}/detokenize", json={"tokens": chat}).json() == {"prompt": shown}
    app = typer.Typer()
    app.command()(commands.tokenize)
    app.command()(commands.chat)
    for request in (body, MESSAGES):
        cli = CliRunner().invoke(
            app, ["tokenize", "--chat", "--ids", "-c", str(tiny_checkpoint), json.dumps(request)]
        )
        assert cli.exit_code == 0, cli.output
        want = (
            chat
            if request is body
            else httpx.post(f"{base}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        )
        assert json.loads(cli.stdout) == want
    cli = CliRunner().invoke(app, ["tokenize", "--ids", "-c", str(tiny_checkpoint), text])
    assert cli.exit_code == 0 and json.loads(cli.stdout) == r["tokens"]
    info = httpx.get(f"{base}/tokenizer_info").json()
    assert info["tokenizer_class"] == "TikTokenTokenizer" and info["model_max_length"] == engine.max_context
    assert info["added_tokens_decoder"][str(tok.special.open)]["content"] == "<|open|>"
    assert len(info["added_tokens_decoder"]) == len(tok.special_tokens)


def test_k3_chat_shows_reasoning_and_tool_calls(served, tiny_checkpoint, tmp_path, monkeypatch) -> None:
    """`k3 chat --tools`: the planted call is shown, and the next line is its result."""
    _, tok, engine = served
    planted = tok.encode(SCRIPT, allowed_special="all")

    def forced(model, **kw):
        e = Scripted(model, tok.special.end_of_msg, **kw)
        e.script = planted
        return e

    monkeypatch.setattr("k3.engine.generate.Engine", forced)
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    app = typer.Typer()
    app.command()(commands.chat)
    app.command()(commands.tokenize)
    r = CliRunner().invoke(
        app, ["chat", str(tiny_checkpoint), "--tools", str(tools), "-n", "400"], input="hola\n21\n4\n"
    )
    assert r.exit_code == 0, r.output
    assert "Need the weather." in r.output and "Let me check." in r.output
    assert '[tool call functions.get_weather:0] get_weather({"city": "París"' in r.output
    assert "tool get_weather> 21" in r.output and "tool calc> 4" in r.output
    assert r.output.count("k3> ") == 2  # the results sent back, the model answered again


def test_k3_chat_refuses_malformed_tools_before_loading(tmp_path) -> None:
    """`k3 chat --tools FILE`: a declaration OpenAI's API would refuse is one line naming the file and the
    tool, before any checkpoint is read (the path given does not exist)."""
    app = typer.Typer()
    app.command()(commands.chat)
    app.command()(commands.tokenize)
    tools = tmp_path / "tools.json"
    for declared, words in (
        ([{"type": "function", "function": {"description": "no name"}}], "tools[0].function.name"),
        ([TOOLS[0], TOOLS[0]], "declared twice"),
        ({"type": "function"}, "a list of tool declarations"),
    ):
        tools.write_text(json.dumps(declared))
        r = CliRunner().invoke(
            app, ["chat", str(tmp_path / "nowhere"), "--tools", str(tools)], input="hola\n"
        )
        assert r.exit_code == 1 and f"--tools {tools}" in r.output and words in r.output, r.output
        assert "no such" not in r.output and len(r.output.strip().splitlines()) == 1
