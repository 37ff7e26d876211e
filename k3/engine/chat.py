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

from k3.engine.tokenizer import Tokenizer, TokenizerError

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


def parse_reply(text: str) -> AssistantReply:
    """Split generated text (decoded with special tokens) into reasoning and answer.

    The text starts inside the think channel; `<|close|>think<|sep|>` ends the reasoning, and a closing
    `<|close|>message<|sep|>`, `<|end_of_msg|>` or `[EOS]` ends the answer. If the think channel was never
    closed (e.g. an untrained model) the whole text counts as the answer.
    """
    think_end = "<|close|>think<|sep|>"
    ends = ("<|close|>message<|sep|>", "<|end_of_msg|>", "[EOS]")
    if think_end in text:
        reasoning, answer = text.split(think_end, 1)
    else:
        reasoning, answer = "", text
    for end in ends:
        answer = answer.split(end, 1)[0]
    return AssistantReply(reasoning=reasoning.strip(), content=answer.strip())
