"""The model's output ids -> OpenAI's reply structures, token by token.

Generation starts inside the assistant message, in the think channel (thinking) or the response channel
(not thinking), so the output reads

    reasoning <|close|>think<|sep|> <|open|>response<|sep|> content <|close|>response<|sep|>
    <|open|>tools<|sep|> <|open|>call tool="NAME" index="1"<|sep|>
        <|open|>argument key="KEY" type="TYPE"<|sep|> value <|close|>argument<|sep|> ...
    <|close|>call<|sep|> ... <|close|>tools<|sep|> <|close|>message<|sep|><|end_of_msg|>

`ReplyParser.push` routes each id: think-channel text to `reasoning`, response-channel text to `content`,
and each finished `call` to a `ToolCall` whose arguments are JSON text, every value read back as its
XTML type (`number` "3" -> 3, `object` -> the object...; a `json` element holds arguments kept verbatim).
Markers and headers are never text. An element opened where it does not belong closes the ones it cannot
sit in (a `response` inside `think` ends the think channel); a closing tag closes everything inside it.

A tool call that cannot be read (a value not of its type, text or an element where none belongs, no
tool name) or that the output ends inside (truncated) is not dropped: `error` says why, and the call's raw
text (markers written out) goes to `content` when its `tools` block ends or at `flush`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from k3.chat.xtml import decode_value, unescape_attr
from k3.tokenizer.kimi import StreamDecoder, Tokenizer

# Where each element may open: the element it sits in.
PARENT = {"think": "message", "response": "message", "tools": "message", "call": "tools", "argument": "call"}
PARENT["json"] = "call"
_HEADER = re.compile(r'\s*([^\s="]+)((?:\s+[^\s="]+="[^"]*")*)\s*')
_ATTR = re.compile(r'([^\s="]+)="([^"]*)"')


@dataclass(frozen=True)
class ToolCall:
    index: int  # 0-based, in the order the model wrote them
    id: str
    name: str
    arguments: str  # JSON text of an object (or the verbatim text of a `json` element)

    def openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class Delta:
    """What one token (or the end) adds."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class Reply:
    reasoning: str
    content: str
    tool_calls: list[ToolCall]
    error: str | None  # why a tool call could not be read, if one could not


def parse_header(header: str) -> tuple[str, dict[str, str]] | None:
    """`call tool="f" index="1"` -> ("call", {"tool": "f", "index": "1"}); None if it is not a header."""
    m = _HEADER.fullmatch(header)
    if m is None:
        return None
    return m.group(1), {k: unescape_attr(v) for k, v in _ATTR.findall(m.group(2))}


TOOL_ELEMENTS = ("tools", "call", "argument", "json")
MAX_HEADER = 64  # ids after a marker before it stops counting as a tag header


class ReplyParser:
    """Routes generated ids into reasoning, content and tool calls as they come (see the module)."""

    def __init__(self, tokenizer: Tokenizer, thinking: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stack = ["message", "think" if thinking else "response"]
        self.marker: int | None = None  # <|open|> or <|close|> whose header is being read
        self.header: list[int] = []
        self.decoders = {"think": StreamDecoder(tokenizer), "response": StreamDecoder(tokenizer)}
        self.value: list[int] = []  # ids of the argument or json element being read
        self.argument: tuple[str | None, str] = (None, "string")  # its key and XTML type
        self.call: dict[str, Any] | None = None  # the call being read: name, arguments, verbatim text
        self.call_ids: list[int] | None = None  # every id since that call opened (its raw form)
        self.broken = False  # the call being read cannot be read: ids go to `call_ids` only
        self.calls: list[ToolCall] = []
        self.reasoning = ""
        self.content = ""
        self.error: str | None = None
        self.done = False

    @property
    def channel(self) -> str:
        """ "reasoning", "content", "tools" or "done" (where the next text goes)."""
        if self.done:
            return "done"
        return {"think": "reasoning", "response": "content", "message": "content"}.get(
            self.stack[-1], "tools"
        )

    def push(self, token: int) -> Delta:
        out = Delta()
        if self.done:
            return out
        s = self.tokenizer.special
        if token == s.end_of_msg:
            self._finish(out, "the message ended inside a tool call")
            return out
        if self.call_ids is not None:
            self.call_ids.append(token)
        if self.marker is not None:
            if token == s.sep:
                self._marker_done(out)
            elif token in (s.open, s.close):  # a header cut short: the new marker starts over
                if self._in_tools():
                    self._break(
                        out, "a tag header interrupted by another marker", [self.marker, *self.header]
                    )
                self.marker, self.header = token, []
            else:
                self.header.append(token)
                if len(self.header) > MAX_HEADER:
                    self._not_a_header(out)
        elif token in (s.open, s.close):
            self.marker, self.header = token, []
            self._flush_text(out)
        elif not self.broken and not self.tokenizer.is_special(token):
            self._text(token, out)
        return out

    def flush(self) -> Delta:
        """The end of the output: held-back text, and the raw text of an unfinished tool call."""
        out = Delta()
        if not self.done:
            self._finish(out, "the output ended inside a tool call (truncated)")
        return out

    def reply(self) -> Reply:
        return Reply(self.reasoning, self.content, list(self.calls), self.error)

    # ---- internals -------------------------------------------------------------------------------------
    def _not_a_header(self, out: Delta) -> None:
        """A marker not followed by a header: dropped; what came after it is text again."""
        ids, self.marker, self.header = self.header, None, []
        if self._in_tools():
            self._break(out, "a marker without a tag header", [])
        elif not self.broken:
            for token in ids:
                if not self.tokenizer.is_special(token):
                    self._text(token, out)

    def _in_tools(self) -> bool:
        return self.stack[-1] in TOOL_ELEMENTS

    def _text(self, token: int, out: Delta) -> None:
        top = self.stack[-1]
        if top in ("argument", "json"):
            self.value.append(token)
        elif top in ("tools", "call"):
            if self.tokenizer.decode([token]).strip():
                self._break(out, f"text inside a {top} element", [token])
        else:
            channel = "think" if top == "think" else "response"
            self._emit(out, channel, self.decoders[channel].push(token))

    def _emit(self, out: Delta, channel: str, text: str) -> None:
        if channel == "think":
            self.reasoning += text
            out.reasoning += text
        else:
            self.content += text
            out.content += text

    def _flush_text(self, out: Delta) -> None:
        for channel, decoder in self.decoders.items():
            self._emit(out, channel, decoder.flush())

    def _marker_done(self, out: Delta) -> None:
        marker, ids = self.marker, self.header
        self.marker, self.header = None, []
        tag_ids = [marker, *ids, self.tokenizer.special.sep]
        header = parse_header(self.tokenizer.decode(ids))
        if marker == self.tokenizer.special.close:
            name = header[0] if header and not header[1] else None
            if not self.broken and name in self.stack:
                inside = self.stack[self.stack.index(name) + 1 :]
                if not any(t in ("call", "argument", "json") for t in inside):
                    self._close(name, out)
                    return
                self._break(out, f"a closing {name} tag inside an unfinished tool call", tag_ids)
            elif not self.broken and self._in_tools():
                self._break(out, f"a closing tag {name or '?'} where none is open", tag_ids)
            if self.broken and name in ("tools", "message"):
                assert self.call_ids is not None
                if self.call_ids[-len(tag_ids) :] == tag_ids:
                    del self.call_ids[-len(tag_ids) :]  # the raw text ends before this closing tag
                self._release_raw(out)
                self._close(name, out)
            return
        if self.broken:
            return
        tag, attrs = header if header is not None else ("?", {})
        parent = PARENT.get(tag)
        misplaced = self._in_tools() and self.stack[-1] != parent
        if parent is None or parent not in self.stack or self.stack[-1] in ("argument", "json") or misplaced:
            if self._in_tools() or tag in ("call", "argument", "json"):
                self._break(out, f"a {tag} element where none belongs", tag_ids)
            return  # an element the format does not have, outside tool calls: ignored
        while self.stack[-1] != parent:
            self._close(self.stack[-1], out)
        self.stack.append(tag)
        if tag == "call":
            self.call = {"name": attrs.get("tool"), "arguments": {}, "verbatim": None}
            self.call_ids = list(tag_ids)
            if not self.call["name"]:
                self._break(out, "a tool call without a tool name", [])
        elif tag == "argument":
            self.value, self.argument = [], (attrs.get("key"), attrs.get("type", "string"))
            if self.argument[0] is None:
                self._break(out, "an argument without a key", [])
        elif tag == "json":
            self.value = []

    def _close(self, name: str, out: Delta) -> None:
        """Close `name` and everything opened inside it."""
        while self.stack:
            top = self.stack.pop()
            if top == "argument":
                self._end_argument(out)
            elif top == "json" and self.call is not None:
                self.call["verbatim"] = self.tokenizer.decode(self.value)
            elif top == "call":
                self._end_call(out)
            if top == name:
                break
        if name == "message" or not self.stack:
            self._flush_text(out)
            self.done = True

    def _end_argument(self, out: Delta) -> None:
        if self.call is None or self.broken:
            return
        key, kind = self.argument
        try:
            self.call["arguments"][key] = decode_value(kind, self.tokenizer.decode(self.value))
        except (ValueError, RecursionError) as e:
            self._break(out, f"argument {key!r} is not a {kind}: {e}", [])

    def _end_call(self, out: Delta) -> None:
        call, self.call, self.call_ids = self.call, None, None
        if call is None or self.broken:
            return
        arguments = call["verbatim"]
        if arguments is None:
            arguments = json.dumps(call["arguments"], ensure_ascii=False)
        n = len(self.calls)
        made = ToolCall(n, f"functions.{call['name']}:{n}", call["name"], arguments)
        self.calls.append(made)
        out.tool_calls.append(made)

    def _break(self, out: Delta, why: str, ids: list[int]) -> None:
        """The tool call being read cannot be read: from now on keep its raw ids (see the module)."""
        self.error = self.error or why
        self.broken = True
        if self.call_ids is None:
            self.call_ids = list(ids)

    def _release_raw(self, out: Delta) -> None:
        if self.call_ids:
            self._emit(out, "response", self.tokenizer.decode(self.call_ids))
        self.call, self.call_ids, self.broken = None, None, False

    def _finish(self, out: Delta, why: str) -> None:
        if not self.broken and any(t in self.stack for t in ("call", "argument", "json")):
            self._break(out, why, [])
        if self.marker is not None:
            self._not_a_header(out)
        if self.broken:
            self._release_raw(out)
        self._flush_text(out)
        self.done = True


def parse_reply(tokenizer: Tokenizer, ids: list[int], thinking: bool = True) -> Reply:
    """The reply in a finished output (the same routing as `ReplyParser`)."""
    parser = ReplyParser(tokenizer, thinking)
    for token in ids:
        parser.push(token)
    parser.flush()
    return parser.reply()
