"""The k3 tokenizer as llama.cpp's `gpt2` vocabulary: tokens, token types and BPE merges.

llama.cpp runs tiktoken-style byte-level BPE as "gpt2": every token is written as its bytes mapped through
GPT-2's byte-to-printable-character table, and the merges (`"left right"`) are replayed by rank. A tiktoken
vocabulary lists ranks only, so each token's merge is recovered by running BPE on its bytes with the ranks
below its own: the two parts left at the end are the pair that makes it. The pre-tokenizer is named
`kimi-k2` (the split pattern k3's tokenizer uses, `k3.tokenizer.kimi.KIMI_PAT_STR`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

from k3.tokenizer.kimi import TIKTOKEN_FILE, Tokenizer, read_tiktoken_ranks

# K3's chat format (k3.chat.encoder.render_chat) for text conversations of system, user and assistant
# messages (with `reasoning_content`), thinking at effort max, as the Jinja template llama.cpp's chat front
# ends render. Tools, tool results, names and images are left to k3's own encoder.
CHAT_TEMPLATE = (
    '<|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides on how much to '
    "think in your thinking channel (not including the response channel), supported values include `low`, "
    "`medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort=max`."
    "<|close|>message<|sep|><|end_of_msg|>"
    "{%- for m in messages -%}"
    '<|open|>message role="{{ m["role"] }}"<|sep|>'
    '{%- if m["role"] == "assistant" -%}'
    "<|open|>think<|sep|>"
    '{%- if m["reasoning_content"] and m["reasoning_content"].strip() -%}'
    '{{ m["reasoning_content"] }}{%- endif -%}'
    "<|close|>think<|sep|><|open|>response<|sep|>"
    '{%- if m["content"] -%}{{ m["content"] }}{%- endif -%}'
    "<|close|>response<|sep|>"
    '{%- elif m["content"] -%}{{ m["content"] }}'
    "{%- endif -%}"
    "<|close|>message<|sep|><|end_of_msg|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    "{%- endif -%}"
)

# gguf.TokenType values
NORMAL, CONTROL, UNUSED = 1, 3, 5
PRE_TOKENIZER = "kimi-k2"


@cache
def byte_to_char() -> dict[int, str]:
    """GPT-2's table: printable bytes stay, the other 68 go to U+0100 onwards, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    moved = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + i) for i, b in enumerate(moved)})
    return table


def token_string(token: bytes) -> str:
    table = byte_to_char()
    return "".join(table[b] for b in token)


def merge_parts(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes] | None:
    """The pair BPE joins last to make `token`: BPE on its bytes with merges of lower rank only."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best, best_rank = None, limit
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best, best_rank = i, r
        if best is None:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


@dataclass(frozen=True)
class GGUFVocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int


def gguf_vocab(directory: str | Path, vocab_size: int) -> GGUFVocab:
    """The tokenizer of a checkpoint directory, as `vocab_size` entries (the model's vocabulary, which may
    exceed the tokenizer's: ids it lacks become `[PAD<id>]`, unused). Raises TokenizerError without one."""
    tok = Tokenizer.from_dir(directory)
    ranks = read_tiktoken_ranks(Path(directory) / TIKTOKEN_FILE)
    by_id = {rank: token_string(token) for token, rank in ranks.items()}
    specials = {i: content for content, i in tok.special_tokens.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in specials:
            tokens.append(specials[i])
            types.append(CONTROL)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1 and (pair := merge_parts(ranks, token)) is not None:
            merges.append(f"{token_string(pair[0])} {token_string(pair[1])}")
    return GGUFVocab(tokens, types, merges, tok.special.bos, tok.special.eos)
