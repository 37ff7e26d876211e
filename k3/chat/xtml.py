"""XTML's pieces: the structural markers, segments, tags with attributes, and the value types.

An element is written `<|open|>tag key="value" ...<|sep|>` body `<|close|>tag<|sep|>`. The release encodes
it segment by segment: every marker is one special id, and every other piece (the tag, each attribute's
` key`, `="`, the escaped value, the closing `"`, the body) is BPE-encoded on its own, so the token ids
depend on this split and a marker typed inside text stays text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from k3.errors import K3Error

OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
THINKING_EFFORTS = ("low", "medium", "high", "max")


class ChatFormatError(K3Error):
    """A conversation the release's encoder refuses (or an output the parser cannot read)."""


@dataclass(frozen=True)
class Segment:
    """One piece of the prompt. `special`: special-token text in it becomes the special ids (markers,
    image prompts); otherwise it is plain text. `assistant`: written by the assistant (for loss masks)."""

    text: str
    special: bool = False
    assistant: bool = False


def text(value: Any) -> list[Segment]:
    """Plain text as a segment (none for the empty string), as `str(value)`."""
    s = str(value)
    return [Segment(s)] if s else []


def control(value: str) -> list[Segment]:
    return [Segment(value, special=True)] if value else []


def escape_attr(value: Any) -> str:
    """An attribute value: `&` and `"` escaped (nothing else)."""
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def open_tag(tag: str, attrs: list[tuple[str, Any]] | tuple = ()) -> list[Segment]:
    out = [*control(OPEN), *text(tag)]
    for key, value in attrs:
        out += [*text(f" {key}"), *text('="'), *text(escape_attr(value)), *text('"')]
    return out + control(SEP)


def close_tag(tag: str) -> list[Segment]:
    return [*control(CLOSE), *text(tag), *control(SEP)]


def as_assistant(segments: list[Segment]) -> list[Segment]:
    return [replace(s, assistant=True) for s in segments]


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def value_type(value: Any) -> str:
    """The XTML type of a JSON value: boolean, null, number, string, object, array (anything else)."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def value_text(value: Any) -> str:
    """How a value is written: a string as itself, anything else as JSON (default separators)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise ChatFormatError(f"a tool-call argument is not JSON-serialisable: {e}") from e


def decode_value(kind: str, written: str) -> Any:
    """The value of an argument written as `written` with XTML type `kind` (ValueError if it does not
    read as that type)."""
    if kind == "string":
        return written
    value = json.loads(written)
    if value_type(value) != kind:
        raise ValueError(f"{written[:40]!r} is not of type {kind}")
    return value
