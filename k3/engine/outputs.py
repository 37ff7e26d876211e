"""From engine events to OpenAI replies: text as it streams, stop strings, logprobs in both formats.

`choice_pieces` follows one request's events and yields `Piece`s: the text (and, for chat, reasoning and
finished tool calls) each event adds once stop strings are checked, the token events it consumed (for
logprobs), and the finish reason.
Stop strings are matched on the text, so they are found across token boundaries; text that could still
be the start of one is held back until it cannot.

Token strings in logprobs are the token's UTF-8 text, or `bytes:\\xNN...` for a piece of a character
(vLLM's convention); a log-prob of -inf (a token outside the top-p nucleus) is written as -9999.0,
since JSON has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from k3.chat.parser import Delta, ReplyParser, ToolCall
from k3.engine.protocol import MAX_STOPS, invalid
from k3.engine.sequence import Event, TopLogprobs
from k3.tokenizer.kimi import StreamDecoder, Tokenizer

NEG_INF = -9999.0


class StopStrings:
    """Cuts generated text at the first stop string; holds back text that could still begin one."""

    def __init__(self, stop: str | list[str] | None) -> None:
        self.stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(self.stops) > MAX_STOPS or any(not s for s in self.stops):
            raise invalid(f"stop: at most {MAX_STOPS} non-empty strings", "stop")
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # everything received
        self.sent = 0  # characters of `text` already released
        self.stopped = False

    def push(self, delta: str, final: bool = False) -> str:
        self.text += delta
        hits = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        if hits:
            end, self.stopped = min(hits), True
        else:
            end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out


class PlainText:
    """Completions: every token is text (special ones included), no channels."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._decoder = StreamDecoder(tokenizer)
        self.channel = "content"

    def push(self, token: int) -> Delta:
        return Delta(content=self._decoder.push(token))

    def flush(self) -> Delta:
        return Delta(content=self._decoder.flush())


@dataclass
class Piece:
    content: str
    reasoning: str = ""
    tokens: list[Event] = field(default_factory=list)  # events with a token, consumed by this piece
    finish_reason: str | None = None
    count: int = 0  # tokens generated so far
    tool_calls: list[ToolCall] = field(default_factory=list)  # chat: the calls finished by this piece


async def choice_pieces(
    events: AsyncIterator[Event], text: PlainText | ReplyParser, stops: StopStrings
) -> AsyncIterator[Piece]:
    """One choice's pieces; the last one has a finish reason ("stop" for a stop id, a stop string or the
    end of the chat message; "length"), unless the events end without one (the request was cancelled).
    Stop strings are looked for in the content only."""
    count = 0
    async for event in events:
        tokens = [event] if event.token is not None else []
        count += len(tokens)
        d = text.push(event.token) if event.token is not None else Delta()
        if event.finish_reason is not None or text.channel == "done":
            tail = text.flush()
            out = stops.push(d.content + tail.content, final=True)
            finish = "stop" if stops.stopped or event.finish_reason is None else event.finish_reason
            calls = d.tool_calls + tail.tool_calls
            yield Piece(out, d.reasoning + tail.reasoning, tokens, finish, count, calls)
            return
        out = stops.push(d.content)
        yield Piece(out, d.reasoning, tokens, "stop" if stops.stopped else None, count, d.tool_calls)
        if stops.stopped:
            return


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else NEG_INF


def token_text(tokenizer: Tokenizer, token: int) -> str:
    piece = tokenizer.token_bytes(token)
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


class LegacyLogprobs:
    """The completions `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, tokenizer: Tokenizer, offset: int = 0) -> None:
        self.tokenizer = tokenizer
        self.offset = offset  # characters of text before the next token
        self._decoder = StreamDecoder(tokenizer)

    def entries(
        self, tokens: list[int], logprobs: list[float | None], tops: list[TopLogprobs | None]
    ) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, logprob, top in zip(tokens, logprobs, tops, strict=True):
            out["tokens"].append(token_text(self.tokenizer, token))
            out["token_logprobs"].append(None if logprob is None else finite(logprob))
            out["top_logprobs"].append(
                None if top is None else {token_text(self.tokenizer, t): finite(v) for t, v in top}
            )
            out["text_offset"].append(self.offset)
            self.offset += len(self._decoder.push(token))
        return out

    def of_events(self, events: list[Event]) -> dict:
        return self.entries(
            [e.token for e in events],  # type: ignore[misc]
            [e.logprob for e in events],
            [e.top if e.top is not None else [] for e in events],
        )


def merge_legacy(parts: list[dict]) -> dict:
    return {
        key: [v for part in parts for v in part[key]]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }


def chat_logprobs(tokenizer: Tokenizer, events: list[Event]) -> dict:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}."""

    def entry(token: int, logprob: float) -> dict:
        return {
            "token": token_text(tokenizer, token),
            "logprob": finite(logprob),
            "bytes": list(tokenizer.token_bytes(token)),
        }

    content = [
        {**entry(e.token, e.logprob), "top_logprobs": [entry(t, v) for t, v in e.top or []]}  # type: ignore[arg-type]
        for e in events
    ]
    return {"content": content, "refusal": None}
