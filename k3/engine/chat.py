"""OpenAI's chat API <-> K3's chat format (k3.chat): what a request asks the encoder for, and the reply.

A request maps onto the release encoder's arguments (docs/chat.md has the table):

* `messages`: passed as they are (OpenAI message dicts, with `name`, `tool_calls`, `tool_call_id`,
  `reasoning_content`); `developer` is `system`; image parts only with `image_prompts` (a model with a
  vision tower: each part becomes its image's prompt in place, k3.chat.encoder), else text parts only;
* `tools` -> the tool declarations; `tool_choice` "required" / "none" -> the tool-choice system
  message ("auto" and a named function write nothing, as in the release); `response_format` as is. Both
  are checked first as OpenAI's API states them (each tool `{"type": "function", "function": {"name", ...}}`,
  names distinct; a choice of "none", "auto", "required" or one declared function), so that a malformed
  declaration is an error and not a prompt the model was never trained on;
* `reasoning_effort` -> `thinking_effort`: minimal/low -> low, medium, high, xhigh/max -> max, and
  "none" turns thinking off;
* `chat_template_kwargs` (as vLLM passes them to the chat template): the release encoder's own keywords
  `thinking` (bool), `thinking_effort`, `response_schema`; they win over `reasoning_effort`.

Unset, thinking is on with effort `max` (the release tokenizer's default). The reply: the think channel is
`reasoning_content`, the response channel `content`, the calls `tool_calls` (finish reason "tool_calls").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from k3.chat.encoder import DEFAULT_THINKING_EFFORT, encode_chat
from k3.chat.parser import ReplyParser, ToolCall
from k3.errors import K3Error
from k3.tokenizer.kimi import Tokenizer

TEMPLATE_KWARGS = ("thinking", "thinking_effort", "response_schema")
REASONING_EFFORT = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "max"}
REASONING_EFFORT["max"] = "max"


class ChatRequestError(K3Error):
    """A chat request the format cannot take (names the field)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class ChatPrompt:
    """A request as the encoder takes it."""

    messages: list[dict]
    tools: list[dict] | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def thinking(self) -> bool:
        return bool(self.options.get("thinking", True))

    def ids(self, tokenizer: Tokenizer, add_generation_prompt: bool = True) -> list[int]:
        try:
            return encode_chat(
                tokenizer,
                self.messages,
                self.tools,
                add_generation_prompt=add_generation_prompt,
                **self.options,
            )
        except K3Error as e:
            raise ChatRequestError(str(e), "messages") from e


def chat_prompt(
    messages: list[dict],
    tools: list[dict] | None = None,
    tool_choice: Any = None,
    response_format: Any = None,
    reasoning_effort: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    image_prompts: list[str] | None = None,
) -> ChatPrompt:
    """The encoder's arguments for an OpenAI chat request's fields (see the module). `image_prompts`: the
    prompt text of each image part, in order (k3.vision.prompt), for a model with a vision tower."""
    options: dict[str, Any] = {"thinking": True, "thinking_effort": DEFAULT_THINKING_EFFORT}
    if reasoning_effort == "none":
        options["thinking"] = False
    elif reasoning_effort is not None:
        if reasoning_effort not in REASONING_EFFORT:
            known = ", ".join(["none", *REASONING_EFFORT])
            raise ChatRequestError(f"{reasoning_effort!r} is not one of {known}", "reasoning_effort")
        options["thinking_effort"] = REASONING_EFFORT[reasoning_effort]
    kwargs = dict(chat_template_kwargs or {})
    unknown = sorted(set(kwargs) - set(TEMPLATE_KWARGS))
    if unknown:
        raise ChatRequestError(
            f"unknown keys {unknown}; K3's encoder takes {', '.join(TEMPLATE_KWARGS)}", "chat_template_kwargs"
        )
    if "thinking" in kwargs and not isinstance(kwargs["thinking"], bool):
        raise ChatRequestError("thinking must be true or false", "chat_template_kwargs")
    options.update(kwargs)
    check_tools(tools, tool_choice)
    if tool_choice is not None:
        options["tool_choice"] = tool_choice
    if response_format is not None:
        options["response_format"] = response_format
    if image_prompts is not None:
        options["image_prompts"] = image_prompts
    for m in messages:
        if isinstance(m.get("content"), list) and not all(_is_text_part(p) for p in m["content"]):
            if image_prompts is None:
                raise ChatRequestError(
                    "only text content parts are supported (image parts need the vision tower)", "messages"
                )
    roles = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    return ChatPrompt(roles, tools, options)


def check_tools(tools: list[dict] | None, tool_choice: Any) -> None:
    """Raise ChatRequestError unless `tools` and `tool_choice` are as OpenAI's API defines them."""
    if tools is not None and not isinstance(tools, list):
        raise ChatRequestError("must be a list of tool declarations", "tools")
    names: list[str] = []
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise ChatRequestError(f'{where}: must be {{"type": "function", "function": {{...}}}}', "tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ChatRequestError(f"{where}.function.name: must be a non-empty string", "tools")
        if name in names:
            raise ChatRequestError(f"{where}.function.name: {name!r} is declared twice", "tools")
        if not isinstance(function.get("parameters", {}), dict):
            raise ChatRequestError(f"{where}.function.parameters: must be a JSON Schema object", "tools")
        if not isinstance(function.get("description", ""), str):
            raise ChatRequestError(f"{where}.function.description: must be a string", "tools")
        names.append(name)
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if tool_choice == "required":
        if not names:
            raise ChatRequestError('"required" needs tools to choose from', "tool_choice")
        return
    chosen = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(chosen, dict) or tool_choice.get("type") != "function":
        raise ChatRequestError(
            'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if chosen.get("name") not in names:
        raise ChatRequestError(
            f"{chosen.get('name')!r} is not one of the declared tools {names}", "tool_choice"
        )


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def request_prompt(body: Any, messages: list[Any], image_prompts: list[str] | None = None) -> ChatPrompt:
    """The prompt of a request body (k3.engine.protocol's ChatFormatBody fields) and its messages."""
    return chat_prompt(
        [m.as_dict() for m in messages],
        body.tools,
        body.tool_choice,
        body.response_format,
        body.reasoning_effort,
        body.chat_template_kwargs,
        image_prompts,
    )


def reply_parser(tokenizer: Tokenizer, prompt: ChatPrompt) -> ReplyParser:
    """The parser for this request's output (in the think channel when thinking, else the response)."""
    return ReplyParser(tokenizer, thinking=prompt.thinking)


def finish_reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI's finish reason: "tool_calls" when the message ended with calls."""
    return "tool_calls" if calls and reason == "stop" else reason


def tool_call_deltas(calls: list[ToolCall]) -> list[dict]:
    """Streamed calls, each whole in one delta (`index` is its place among the reply's calls)."""
    return [{"index": c.index, **c.openai()} for c in calls]


def reply_message(reasoning: str, content: str, calls: list[ToolCall]) -> dict:
    """The assistant message of a finished reply (content null when there are only tool calls)."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content if content or not calls else None,
        "reasoning_content": reasoning,
    }
    if calls:
        message["tool_calls"] = [c.openai() for c in calls]
    return message
