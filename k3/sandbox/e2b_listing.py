"""E2B's list queries, as the `e2b` SDK sends them: `GET /v2/sandboxes` (`Sandbox.list`) filtered by
metadata, state, start time and template, sorted by start time, and `GET /snapshots`
(`Sandbox.list_snapshots`) filtered by source sandbox and name; both in pages of `limit` (1-100), the next
page named by the `x-next-token` response header and asked for by `nextToken`.

A token is the sort key of the last item of its page (start time and id for sandboxes, id for snapshots),
so a page goes on after it even when items before it ended in between. Bad values are SandboxErrors
(400s) that name the parameter.
"""

from __future__ import annotations

import base64
import binascii
import json
import urllib.parse
from collections.abc import Callable, MutableMapping, Sequence
from datetime import datetime

from k3.sandbox.types import SandboxError

MAX_LIMIT = 100  # E2B's most items a page (the SDK's default)
NEXT_TOKEN_HEADER = "x-next-token"


def metadata_filter(text: str | None) -> dict[str, str]:
    """The `metadata` parameter: `k=v&k2=v2`, each key and value percent-quoted once more by the SDK."""
    if not text:
        return {}
    try:
        pairs = urllib.parse.parse_qsl(text, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        raise SandboxError(f"metadata: {text!r} is not k=v pairs joined by &") from None
    return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in pairs}


def started_after(text: str | None) -> datetime | None:
    """The `startedAfter` parameter: an ISO 8601 time with its offset."""
    if not text:
        return None
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise SandboxError(f"startedAfter: {text!r} is not an ISO 8601 time") from None
    if when.tzinfo is None:
        raise SandboxError(f"startedAfter: {text!r} has no UTC offset")
    return when


def page(
    items: Sequence[dict],
    key: Callable[[dict], list[str]],
    limit: int,
    token: str | None,
    headers: MutableMapping[str, str],
    descending: bool = False,
) -> list[dict]:
    """One page of `items` sorted by `key` (strings, unique per item): up to `limit` items after the one
    `token` names; the next page's token goes into the response's `headers` (none on the last page)."""
    if not 1 <= limit <= MAX_LIMIT:
        raise SandboxError(f"limit: {limit} is not in 1..{MAX_LIMIT}")
    ordered = sorted(items, key=key, reverse=descending)
    if token:
        after = _read_token(token)
        ordered = [i for i in ordered if (key(i) < after if descending else key(i) > after)]
    taken = ordered[:limit]
    if len(ordered) > limit:
        headers[NEXT_TOKEN_HEADER] = _token(key(taken[-1]))
    return taken


def _token(key: list) -> str:
    return base64.urlsafe_b64encode(json.dumps(key).encode()).decode()


def _read_token(token: str) -> list:
    try:
        key = json.loads(base64.urlsafe_b64decode(token.encode()))
    except (binascii.Error, ValueError):
        key = None
    if not isinstance(key, list) or not all(isinstance(part, str) for part in key):
        raise SandboxError(f"nextToken: {token!r} is not a token this server gave")
    return key
