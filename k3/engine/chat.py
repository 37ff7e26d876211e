"""The K3 chat format, encoded segment by segment.

A turn is written (spec section 3)

    <|open|>message role="user"<|sep|>{content}<|close|>message<|sep|><|end_of_msg|>

and the assistant's answer is prompted with

    <|open|>message role="assistant"<|sep|><|open|>think<|sep|>

so the model first writes its reasoning, closes it with `<|close|>think<|sep|>`, writes the answer and
ends with `<|close|>message<|sep|><|end_of_msg|>` (the closing of the think channel is inferred from the
opening's symmetry: unconfirmed). Past assistant turns are replayed without their reasoning.

As in the release, the prompt is not one string run through the tokenizer: every special token is
appended as its single id and every text segment (the header `message role="user"`, the content) is
BPE-encoded on its own, with special-token text inside content treated as plain text, so a user who
types "<|close|>" cannot forge a turn boundary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from k3.tokenizer.kimi import StreamDecoder, Tokenizer, TokenizerError

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Message:
    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise TokenizerError(f"message role {self.role!r} is not one of {', '.join(ROLES)}")
        if not isinstance(self.content, str):
            raise TokenizerError(f"message content must be a string, got {type(self.content).__name__}")


def as_messages(messages: Iterable[Message | Mapping[str, str]]) -> list[Message]:
    return [m if isinstance(m, Message) else Message(m["role"], m["content"]) for m in messages]


def _header(role: str) -> str:
    return f'message role="{role}"'


def encode_chat(
    tokenizer: Tokenizer, messages: Iterable[Message | Mapping[str, str]], add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of a conversation; with `add_generation_prompt` it ends opening the assistant's think
    channel, ready for generation."""
    s = tokenizer.special
    ids: list[int] = []
    for m in as_messages(messages):
        ids += [s.open, *tokenizer.encode(_header(m.role)), s.sep]
        ids += tokenizer.encode(m.content)
        ids += [s.close, *tokenizer.encode("message"), s.sep, s.end_of_msg]
    if add_generation_prompt:
        ids += [s.open, *tokenizer.encode(_header("assistant")), s.sep]
        ids += [s.open, *tokenizer.encode("think"), s.sep]
    return ids


def render_chat(messages: Iterable[Message | Mapping[str, str]], add_generation_prompt: bool = True) -> str:
    """The same conversation as text (for display; `encode_chat` is what the model reads)."""
    out = []
    for m in as_messages(messages):
        out.append(f"<|open|>{_header(m.role)}<|sep|>{m.content}<|close|>message<|sep|><|end_of_msg|>")
    if add_generation_prompt:
        out.append(f"<|open|>{_header('assistant')}<|sep|><|open|>think<|sep|>")
    return "".join(out)


@dataclass(frozen=True)
class AssistantReply:
    reasoning: str
    content: str


class ReplyStream:
    """Routes generated token ids into the reasoning and the answer, as they come.

    Generation starts inside the think channel. `<|close|>NAME<|sep|>` closes a channel: `think` switches
    to the answer, `message` ends it (later tokens are dropped). Special tokens are never shown as text.
    An untrained model that never closes its think channel therefore produces reasoning only.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.channel = "reasoning"  # -> "content" -> "done"
        self._closing: list[int] | None = None  # ids between <|close|> and <|sep|>
        self._decoders = {"reasoning": StreamDecoder(tokenizer), "content": StreamDecoder(tokenizer)}
        self.reasoning = ""
        self.content = ""

    def push(self, token: int) -> tuple[str, str]:
        """Feed one id; returns the (reasoning, content) text it adds."""
        s = self.tokenizer.special
        if self._closing is not None:
            if token != s.sep:
                self._closing.append(token)
                return "", ""
            name, self._closing = self.tokenizer.decode(self._closing).strip(), None
            if name == "think" and self.channel == "reasoning":
                return self._switch("content")
            if name == "message":
                return self._switch("done")
            return "", ""
        if token == s.close:
            self._closing = []
            return "", ""
        if self.channel == "done" or self.tokenizer.is_special(token):
            return "", ""
        return self._emit(self._decoders[self.channel].push(token))

    def flush(self) -> tuple[str, str]:
        return self._switch(self.channel)

    def _switch(self, channel: str) -> tuple[str, str]:
        tail = self._emit(self._decoders[self.channel].flush()) if self.channel != "done" else ("", "")
        self.channel = channel
        return tail

    def _emit(self, text: str) -> tuple[str, str]:
        if self.channel == "reasoning":
            self.reasoning += text
            return text, ""
        if self.channel == "content":
            self.content += text
            return "", text
        return "", ""


def parse_reply(tokenizer: Tokenizer, ids: Iterable[int]) -> AssistantReply:
    """Reasoning and answer of a finished generation (the same routing as `ReplyStream`)."""
    stream = ReplyStream(tokenizer)
    for token in ids:
        stream.push(token)
    stream.flush()
    return AssistantReply(reasoning=stream.reasoning.strip(), content=stream.content.strip())
