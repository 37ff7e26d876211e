"""Character-level token ids for the RL tasks, compatible with k3's built-in byte-level BPE.

The built-in tokenizer (k3.tokenizer.build) gives ranks 0..255 to the single bytes, rank = byte value, and
puts its special tokens after the BPE ranks. Tasks here are ASCII, one id per character (id = byte), with the
tokenizer's `[EOS]` id ending every answer: a tiny model sees every digit on its own (BPE merges digits
unevenly, which makes arithmetic much harder to learn), and any k3 tokenizer still decodes the ids to the
same text, so an exported checkpoint works with `k3 generate`.

`tokenizer` is that built-in tokenizer itself (what `k3 init` writes beside a checkpoint of this vocabulary):
a task in K3's chat format (the calculator, k3.tasks.tool_task) encodes with it, as the release does.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from k3.errors import K3Error
from k3.tokenizer.build import builtin_tokenizer
from k3.tokenizer.kimi import NUM_SPECIAL_IDS, Tokenizer, special_tokens_for


class CodecError(K3Error):
    """Text the character codec cannot encode, or a vocabulary too small for it."""


@dataclass(frozen=True)
class CharCodec:
    """ASCII text <-> ids (one per character); `eos` ends an answer."""

    vocab_size: int

    def __post_init__(self) -> None:
        if self.vocab_size < 256 + NUM_SPECIAL_IDS:
            raise CodecError(
                f"a vocabulary of {self.vocab_size} ids is too small: the codec needs the 256 byte ids "
                f"and the tokenizer's {NUM_SPECIAL_IDS} special ids"
            )

    @property
    def eos(self) -> int:
        return special_tokens_for(self.vocab_size - NUM_SPECIAL_IDS)["[EOS]"]

    @property
    def tokenizer(self) -> Tokenizer:
        """The built-in BPE tokenizer of this vocabulary (built once per size: k3.tokenizer.build)."""
        return _tokenizer(self.vocab_size)

    def encode(self, text: str) -> list[int]:
        if not text.isascii():
            raise CodecError(f"the character codec takes ASCII text only, got {text[:40]!r}")
        return list(text.encode("ascii"))

    def decode(self, ids: list[int]) -> str:
        """Bytes of the byte ids; any other id (eos, BPE merges) is dropped."""
        return bytes(i for i in ids if 0 <= i < 128).decode("ascii")


@lru_cache(maxsize=4)
def _tokenizer(vocab_size: int) -> Tokenizer:
    return builtin_tokenizer(vocab_size)
