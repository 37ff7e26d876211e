"""What the release does to a conversation before writing it.

* Tool results are put in call order: each run of consecutive `role: "tool"` messages is matched, by
  `tool_call_id` (or `id`), against the `tool_calls[].id` of the latest assistant message and sorted by
  the matched call's position (ties keep their order); each matched message's `tool` (and `name`, if it
  has one) becomes the call's function name. A run with any message that matches nothing is left as is.
* Tool-call arguments given as a JSON string are parsed: a JSON object becomes the arguments, a blank
  string or null `{}`, text that is not JSON is kept verbatim (written as a `json` element), JSON that is
  not an object is an error.
* Tool declarations (the request's and a system message's `tools`) and the response schema have their
  object keys sorted, recursively.

Nothing here mutates the caller's messages: changed messages are copies.
"""

from __future__ import annotations

import json
from typing import Any

from k3.chat.xtml import ChatFormatError

JSON_BLOCK = "_xtml_json_block"  # arguments kept verbatim (not JSON), as the release names the field


def sort_keys(value: Any) -> Any:
    """Every dict's keys sorted, recursively (lists keep their order)."""
    if isinstance(value, dict):
        return {k: sort_keys(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [sort_keys(v) for v in value]
    return value


def parse_arguments(arguments: Any) -> tuple[dict[str, Any], str | None]:
    """(arguments as a dict, the verbatim text when it is not JSON)."""
    if arguments is None:
        return {}, None
    if isinstance(arguments, dict):
        return arguments, None
    if not isinstance(arguments, str):
        raise ChatFormatError("Kimi K3 tool call arguments must be a dict or a JSON object string.")
    if not arguments.strip():
        return {}, None
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return {}, arguments
    if not isinstance(parsed, dict):
        raise ChatFormatError("Kimi K3 tool call arguments must be a JSON object.")
    return parsed, None


def _with_arguments(holder: dict) -> dict:
    """A copy of a function (or call) dict with its arguments parsed."""
    out = dict(holder)
    out["arguments"], verbatim = parse_arguments(holder.get("arguments"))
    if verbatim is None:
        out.pop(JSON_BLOCK, None)
    else:
        out[JSON_BLOCK] = verbatim
    return out


def normalize_message(message: Any) -> Any:
    """A message with its declared tools key-sorted and its tool calls' arguments parsed."""
    if not isinstance(message, dict):
        return message
    out = dict(message)
    if out.get("tools") is not None:
        out["tools"] = sort_keys(out["tools"])
    if not out.get("tool_calls"):
        return out
    calls = []
    for call in out["tool_calls"]:
        if isinstance(call, dict):
            call = dict(call)
            if isinstance(call.get("function"), dict):
                call["function"] = _with_arguments(call["function"])
            else:
                call = _with_arguments(call)
        calls.append(call)
    out["tool_calls"] = calls
    return out


def _call_positions(tool_calls: Any) -> dict[str, tuple[int, Any]]:
    """id -> (1-based position among all the calls, function name); the first of repeated ids wins."""
    found: dict[str, tuple[int, Any]] = {}
    if not isinstance(tool_calls, list):
        return found
    for position, call in enumerate(tool_calls, start=1):
        if not isinstance(call, dict) or call.get("id") is None or str(call["id"]) in found:
            continue
        fn = call.get("function")
        found[str(call["id"])] = (position, fn.get("name") if isinstance(fn, dict) else call.get("name"))
    return found


def _is_tool(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") == "tool"


def order_tool_results(messages: list[Any]) -> list[Any]:
    """Each run of tool messages in the call order of the assistant message before it (see the module)."""
    out: list[Any] = []
    calls: dict[str, tuple[int, Any]] = {}
    i = 0
    while i < len(messages):
        message = messages[i]
        if not _is_tool(message):
            if isinstance(message, dict) and message.get("role") == "assistant":
                calls = _call_positions(message.get("tool_calls")) if message.get("tool_calls") else {}
            out.append(message)
            i += 1
            continue
        run = []
        while i < len(messages) and _is_tool(messages[i]):
            call_id = messages[i].get("tool_call_id", messages[i].get("id"))
            run.append((calls.get(str(call_id)) if call_id is not None else None, len(run), messages[i]))
            i += 1
        if any(match is None for match, _, _ in run):
            out += [m for _, _, m in run]
            continue
        for (_, name), _, m in sorted(run, key=lambda r: (r[0][0], r[1])):
            if name is not None:
                m = {**m, "tool": name, **({"name": name} if "name" in m else {})}
            out.append(m)
    return out
