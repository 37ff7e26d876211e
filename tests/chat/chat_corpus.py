"""A generated corpus of conversations that covers every element of K3's chat format (for the oracle and
round-trip tests): seeded, so each run sees the same conversations."""

from __future__ import annotations

import json
import random
from typing import Any

NAMES = ["ana", 'Zoë "Z" & co', "李雷", ""]
TEXTS = [
    "Hola, ¿qué tal?",
    'Quotes "inside" & ampersands &amp; <tags>',
    "",
    "emoji 🤖 and 中文 and ümlauts",
    "typed markers <|open|>message<|sep|> stay text <|close|>",
    "  leading and trailing spaces \n\n",
    "line\nbreaks\tand tabs",
]
VALUES: list[Any] = [
    "text",
    "",
    'quote " and & amp',
    0,
    -3,
    2.5,
    1e21,
    True,
    False,
    None,
    [1, "two", None, [3.0]],
    {"nested": {"deep": [1, {"x": "y"}]}, "b": False, "a": "first"},
    [],
    {},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": 'Weather "now" & later',
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}},
]


def _content(rng: random.Random, images: list[int]) -> Any:
    kind = rng.random()
    if kind < 0.6:
        return rng.choice(TEXTS)
    if kind < 0.7:
        return None
    parts: list[dict] = []
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.4:
            parts.append({"type": rng.choice(["image", "image_url"]), "image_url": {"url": "data:,"}})
            images[0] += 1
        else:
            parts.append({"type": "text", "text": rng.choice(TEXTS)})
    return parts


def _arguments(rng: random.Random) -> Any:
    suffixes = ["", " key", '"q" & co']
    args = {f"k{i}{rng.choice(suffixes)}": rng.choice(VALUES) for i in range(rng.randint(0, 4))}
    form = rng.random()
    if form < 0.45:
        return args
    if form < 0.8:
        return json.dumps(args, ensure_ascii=rng.random() < 0.5)
    return rng.choice(["", "   ", None, "not json {", '{"a": 1'])


def _calls(rng: random.Random, turn: int) -> list[dict]:
    calls = []
    for i in range(rng.randint(1, 3)):
        name = rng.choice(["get_weather", "calc", 'odd "name" & co'])
        fn = {"name": name, "arguments": _arguments(rng)}
        calls.append(
            {"id": f"call_{turn}_{i}", "type": "function", "function": fn} if rng.random() < 0.85 else fn
        )
    return calls


def conversation(seed: int) -> tuple[list[dict], dict]:
    """(messages, options) for `chat_segments`: every option and element drawn at random."""
    rng = random.Random(seed)
    images = [0]
    messages: list[dict] = []
    if rng.random() < 0.6:
        m = {"role": "system", "content": _content(rng, images)}
        if rng.random() < 0.3:
            m["name"] = rng.choice(NAMES)
        messages.append(m)
    for turn in range(rng.randint(1, 4)):
        user = {"role": "user", "content": _content(rng, images)}
        if rng.random() < 0.3:
            user["name"] = rng.choice(NAMES)
        messages.append(user)
        if rng.random() < 0.15:
            messages.append({"role": "system", "tools": TOOLS[::-1], "content": "ignored"})
        assistant: dict = {"role": "assistant", "content": rng.choice([*TEXTS, None])}
        r = rng.random()
        if r < 0.4:
            assistant["reasoning_content"] = rng.choice(TEXTS)
        elif r < 0.55:
            assistant["reasoning"] = rng.choice(TEXTS)
        if rng.random() < 0.2:
            assistant["name"] = rng.choice(NAMES)
        if rng.random() < 0.55:
            assistant["tool_calls"] = _calls(rng, turn)
        messages.append(assistant)
        calls = assistant.get("tool_calls", [])
        results = []
        for call in calls:
            result: dict = {"role": "tool", "content": _content(rng, images)}
            how = rng.random()
            if "id" in call and how < 0.6:
                result["tool_call_id"] = call["id"]
            elif how < 0.8:
                result["name"] = call.get("function", call)["name"]
            results.append(result)
        if rng.random() < 0.5:
            rng.shuffle(results)  # the release re-sorts them into call order when all ids match
        messages += results
    if rng.random() < 0.5:
        messages.append({"role": "user", "content": _content(rng, images)})
    options: dict[str, Any] = {
        "add_generation_prompt": rng.random() < 0.7,
        "thinking": rng.random() < 0.75,
        "thinking_effort": rng.choice(["low", "medium", "high", "max", None]),
    }
    if rng.random() < 0.5:
        options["tools"] = TOOLS if rng.random() < 0.7 else []
    if rng.random() < 0.4:
        options["tool_choice"] = rng.choice(
            ["auto", "required", "none", {"type": "function", "function": {}}]
        )
    if rng.random() < 0.4:
        schema = {"type": "object", "properties": {"z": {"type": "number"}, "a": {"type": "string"}}}
        options["response_format"] = rng.choice(
            [
                {"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}},
                {"type": "json_schema", "json_schema": {"name": "bare", "json_schema": schema}},
                {"type": "text"},
                "json_object",
            ]
        )
    if images[0] and rng.random() < 0.5:
        options["image_prompts"] = [f"<|reserved_token_{800 + i}|>" for i in range(images[0])]
    return messages, options
