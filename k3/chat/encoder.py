"""A conversation -> XTML segments -> the token ids K3 prefills, exactly as the release's encoder.

The prompt, in order (every message ends `<|close|>message<|sep|><|end_of_msg|>`):

1. the tool declarations, if any: `<|open|>message role="system" type="tool-declare"<|sep|># Tools ...`
   with the tools as compact, key-sorted JSON;
2. the thinking effort (thinking mode only; `max` unless told otherwise, as the release's tokenizer):
   `<|open|>message role="system" type="thinking-effort"<|sep|>...`;
3. the messages: system, user (with an optional `name` attribute), assistant (think channel, in thinking
   mode, then the response channel, then a `tools` element with one `call` per tool call), tool results
   (`role="tool" tool="NAME" index="N"`, N counting from 1 after each assistant message), a system
   message with `tools` (tools added mid-conversation: "New Tools Available"); other roles are skipped,
   as the release skips them;
4. `tool_choice` "required" or "none" and `response_format` json_object / json_schema, as system
   messages of type `tool-choice` and `response-format`;
5. the generation prompt: `<|open|>message role="assistant"<|sep|>` then `<|open|>think<|sep|>`
   (thinking) or `<|open|>response<|sep|>` (not thinking).

Image content parts become `<|kimi_image_placeholder|>`, or, given `image_prompts`, the next image prompt
(special text) for each part and each placeholder typed in text. docs/chat.md shows every element.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from k3.chat.normalize import JSON_BLOCK, normalize_message, order_tool_results, sort_keys
from k3.chat.xtml import (
    END_OF_MSG,
    IMAGE_PLACEHOLDER,
    THINKING_EFFORTS,
    ChatFormatError,
    Segment,
    as_assistant,
    close_tag,
    compact_json,
    control,
    open_tag,
    text,
    value_text,
    value_type,
)
from k3.tokenizer.kimi import Tokenizer

DEFAULT_THINKING_EFFORT = "max"  # the release's tokenizer asks for `max` unless told otherwise

TOOLS_BODY = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```"
NEW_TOOLS_BODY = (
    "## New Tools Available\n"
    "The system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\n"
    "Here are the specs for the extended tools.\n\n"
    "```json\n{}\n```"
)
EFFORT_BODY = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
    "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={}`."
)
TOOL_CHOICE_BODY = {
    "required": "The system is invoked with `tool_choice=required`.\n"
    "You MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\n"
    "You MUST NOT call any tools in the next message.",
}
RAW_JSON = (
    "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
)
JSON_OBJECT_BODY = f"The system is invoked with `response_format=json_object`.\n{RAW_JSON}"
JSON_SCHEMA_BODY = (
    f"The system is invoked with `response_format=json_schema`.\n{RAW_JSON}\n"
    "The JSON data must match the following schema:\n```json\n{}\n```"
)


class _Images:
    """Hands out image prompts in order (or the bare placeholder when none were given)."""

    def __init__(self, prompts: list[str] | None) -> None:
        self.prompts, self.used = prompts, 0

    def next(self) -> list[Segment]:
        if self.prompts is None:
            return control(IMAGE_PLACEHOLDER)
        if self.used >= len(self.prompts):
            raise ChatFormatError("More image placeholders than image prompts.")
        self.used += 1
        return control(self.prompts[self.used - 1])

    def body(self, value: Any) -> list[Segment]:
        """Text that may hold placeholders: each becomes the next image prompt, when prompts are given."""
        s = str(value)
        if self.prompts is None or IMAGE_PLACEHOLDER not in s:
            return text(s)
        out: list[Segment] = []
        for i, part in enumerate(s.split(IMAGE_PLACEHOLDER)):
            out += (self.next() if i else []) + text(part)
        return out

    def check_all_used(self) -> None:
        if self.prompts is not None and self.used != len(self.prompts):
            raise ChatFormatError(
                f"image prompt count {len(self.prompts)} != consumed placeholder count {self.used}"
            )


def _field(message: dict, key: str, where: str) -> Any:
    try:
        return message[key]
    except (KeyError, TypeError) as e:
        raise ChatFormatError(f"{where}: no {key!r}") from e


def _content(content: Any, images: _Images, where: str) -> list[Segment]:
    """A message's content: a string, or parts (image parts -> image prompts, others -> their text)."""
    if content is None:
        return []
    if isinstance(content, str):
        return images.body(content)
    if not isinstance(content, list | tuple):
        raise ChatFormatError(f"{where}: content must be a string or a list of parts")
    out: list[Segment] = []
    for i, part in enumerate(content):
        kind = _field(part, "type", f"{where}.content[{i}]")
        out += images.next() if kind in ("image", "image_url") else images.body(_field(part, "text", where))
    return out


def _message(attrs: list[tuple[str, Any]], body: list[Segment]) -> list[Segment]:
    return [*open_tag("message", attrs), *body, *close_tag("message"), *control(END_OF_MSG)]


def _system(kind: str, body: str) -> list[Segment]:
    return _message([("role", "system"), ("type", kind)], text(body.strip()))


def _function(call: Any, where: str) -> dict:
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        raise ChatFormatError(f"{where}: a tool call must be an object with a function")
    return fn


def _tool_calls(calls: list, images: _Images, where: str) -> list[Segment]:
    out = open_tag("tools")
    for index, call in enumerate(calls, start=1):
        fn = _function(call, f"{where}.tool_calls[{index - 1}]")
        out += open_tag(
            "call", [("tool", _field(fn, "name", f"{where}.tool_calls[{index - 1}]")), ("index", index)]
        )
        arguments = fn.get("arguments", {})
        if fn.get(JSON_BLOCK) is not None:
            out += [*open_tag("json", [("type", "object")]), *images.body(fn[JSON_BLOCK]), *close_tag("json")]
        elif isinstance(arguments, dict):
            for key, value in arguments.items():
                out += open_tag("argument", [("key", key), ("type", value_type(value))])
                out += [*images.body(value_text(value)), *close_tag("argument")]
        out += close_tag("call")
    return out + close_tag("tools")


def _assistant(message: dict, images: _Images, thinking: bool, where: str) -> list[Segment]:
    """The channels of an assistant message (after its `message` header)."""
    out: list[Segment] = []
    if thinking:  # the think channel is structural: written even when empty
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        out += open_tag("think")
        if reasoning is not None and str(reasoning).strip():
            out += images.body(reasoning)
        out += close_tag("think")
    out += [*open_tag("response"), *_content(message.get("content"), images, where), *close_tag("response")]
    if message.get("tool_calls"):
        out += _tool_calls(message["tool_calls"], images, where)
    return out


def response_schema(response_format: Any) -> Any:
    """The JSON schema inside an OpenAI `response_format` ({"type": "json_schema", "json_schema":
    {"name", "schema"}}), read as the release reads it; None without one."""
    if response_format is None:
        return None
    holder = (
        response_format.get("json_schema")
        if isinstance(response_format, dict)
        else getattr(response_format, "json_schema", None)
    )
    if holder is None:
        return None
    if isinstance(holder, dict):
        return holder.get("schema", holder.get("json_schema", holder))
    for key in ("schema", "json_schema"):
        if getattr(holder, key, None) is not None:
            return getattr(holder, key)
    return holder


def _format_type(response_format: Any) -> Any:
    return (
        response_format.get("type", response_format) if isinstance(response_format, dict) else response_format
    )


def chat_segments(
    messages: list[Any],
    tools: list[dict] | None = None,
    *,
    add_generation_prompt: bool = True,
    thinking: bool = True,
    thinking_effort: str | None = DEFAULT_THINKING_EFFORT,
    tool_choice: Any = None,
    response_format: Any = None,
    image_prompts: list[str] | None = None,
    **schema: Any,
) -> list[Segment]:
    """The segments of a conversation (OpenAI-style message dicts). `schema` may hold `response_schema`,
    which then replaces the one inside `response_format` (as the release's keyword of that name).
    A conversation the release refuses raises ChatFormatError (also for values of the wrong type, where
    the release raises Python's own errors)."""
    try:
        return _segments(
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            thinking=thinking,
            thinking_effort=thinking_effort,
            tool_choice=tool_choice,
            response_format=response_format,
            image_prompts=image_prompts,
            **schema,
        )
    except ChatFormatError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ChatFormatError(f"the conversation cannot be encoded ({type(e).__name__}: {e})") from e


def _segments(
    messages: list[Any],
    tools: list[dict] | None,
    *,
    add_generation_prompt: bool,
    thinking: bool,
    thinking_effort: str | None,
    tool_choice: Any,
    response_format: Any,
    image_prompts: list[str] | None,
    **schema: Any,
) -> list[Segment]:
    if not isinstance(messages, list):
        raise ChatFormatError("messages must be a list of message objects")
    unknown = set(schema) - {"response_schema"}
    if unknown:
        raise ChatFormatError(f"unknown chat format options: {', '.join(sorted(unknown))}")
    messages = [normalize_message(m) for m in order_tool_results(messages)]
    tools = sort_keys(tools)
    rschema = schema["response_schema"] if "response_schema" in schema else response_schema(response_format)
    images = _Images(image_prompts)
    out: list[Segment] = []
    if tools:
        out += _system("tool-declare", TOOLS_BODY.format(compact_json(tools)))
    if thinking and thinking_effort is not None:
        if thinking_effort not in THINKING_EFFORTS:
            raise ChatFormatError(
                f"Unsupported thinking_effort={thinking_effort!r}; "
                f"supported values are {sorted(THINKING_EFFORTS)}."
            )
        out += _system("thinking-effort", EFFORT_BODY.format(thinking_effort))

    calls: list | None = None  # the latest assistant message's tool calls
    tool_index = 0  # tool results since then
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        where = f"messages[{i}]"
        role = _field(message, "role", where)
        name_attr = [("name", message["name"])] if message.get("name") else []
        if role == "user":
            out += _message([("role", "user"), *name_attr], _content(message.get("content"), images, where))
        elif role == "system" and message.get("tools"):
            out += _system("tool-declare", NEW_TOOLS_BODY.format(compact_json(message["tools"])))
        elif role == "system":
            out += _message([("role", "system"), *name_attr], _content(message.get("content"), images, where))
        elif role == "tool":
            tool_index += 1
            tool = message.get("tool", message.get("name"))
            if tool is None and calls is not None and tool_index <= len(calls):
                tool = _field(_function(calls[tool_index - 1], where), "name", where)
            if tool is None:
                raise ChatFormatError(
                    "Kimi K3 tool messages need a resolvable tool name: carry `tool`/`name`, "
                    "or match a preceding assistant tool_call by order."
                )
            attrs = [("role", "tool"), ("tool", tool), ("index", tool_index)]
            out += _message(attrs, _content(message.get("content"), images, where))
        elif role == "assistant":
            calls, tool_index = message.get("tool_calls"), 0
            body = [
                *_assistant(message, images, thinking, where),
                *close_tag("message"),
                *control(END_OF_MSG),
            ]
            out += [*open_tag("message", [("role", "assistant"), *name_attr]), *as_assistant(body)]

    if isinstance(tool_choice, str) and tool_choice in TOOL_CHOICE_BODY:
        out += _system("tool-choice", TOOL_CHOICE_BODY[tool_choice])
    kind = _format_type(response_format)
    if kind == "json_object":
        out += _system("response-format", JSON_OBJECT_BODY)
    elif kind == "json_schema":
        out += _system("response-format", JSON_SCHEMA_BODY.format(compact_json(sort_keys(rschema))))
    if add_generation_prompt:
        out += [*open_tag("message", [("role", "assistant")]), *open_tag("think" if thinking else "response")]
    images.check_all_used()
    return out


def segment_ids(tokenizer: Tokenizer, segments: Iterable[Segment]) -> list[int]:
    """The token ids of segments: each encoded on its own; special text only in special segments."""
    ids: list[int] = []
    for s in segments:
        ids += tokenizer.encode(s.text, allowed_special="all" if s.special else frozenset())
    return ids


def encode_chat(
    tokenizer: Tokenizer, messages: list[Any], tools: list[dict] | None = None, **options: Any
) -> list[int]:
    """The token ids of a conversation (`chat_segments`' options), as the model prefills them."""
    return segment_ids(tokenizer, chat_segments(messages, tools, **options))


def render_chat(messages: list[Any], tools: list[dict] | None = None, **options: Any) -> str:
    """The same conversation as text (for display; `encode_chat` is what the model reads)."""
    return "".join(s.text for s in chat_segments(messages, tools, **options))
