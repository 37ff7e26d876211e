"""The K3 tokenizer: byte-level BPE ranks (`tiktoken.model`) + special tokens (`tokenizer_config.json`).

A checkpoint directory holds the tokenizer in the Kimi release format:

* `tiktoken.model`: one `base64(token bytes) rank` per line, ranks 0..n_ranks-1 (163,584 for K3);
* `tokenizer_config.json`: `added_tokens_decoder` maps each special id (as a string) to
  `{"content": ..., "special": true, ...}`, plus `bos_token`, `eos_token`, `pad_token`, `unk_token`.

The special ids sit right after the BPE ranks, at fixed offsets (K3: n_ranks = 163584):

    n_ranks + 0 [BOS]   + 1 [EOS]   + 2 <|end_of_msg|>   + 3 <|open|>   + 4 <|close|>   + 5 <|sep|>
    n_ranks + 254 [UNK] + 255 [PAD]; every other id up to n_ranks + 255 is `<|reserved_token_{id}|>`

so a vocabulary of `vocab_size` ids always has `vocab_size - 256` BPE ranks. Small synthetic checkpoints
(`k3.tokenizer.build`) use the same offsets, e.g. `tiny` (vocab 1024): [BOS] = 768.

Text is split by the Kimi K2 pattern before BPE; tiktoken's regex engine (fancy-regex over Rust `regex`)
understands the character-class intersection `&&` it uses, so the pattern is passed through unchanged.
Everything here works offline: nothing is downloaded.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path

import tiktoken

from k3.errors import K3Error

# The Kimi K2/K3 pre-tokenizer: Han runs, cased words (Han excluded via `&&`), numbers of at most 3
# digits, punctuation runs, newlines and other whitespace.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

NUM_SPECIAL_IDS = 256  # ids after the BPE ranks: named specials + reserved
# Named special tokens: offset after the last BPE rank -> content.
NAMED_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    18: "<|media_begin|>",  # the vision path's prompt tokens (K3: 163602-163605)
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    254: "[UNK]",
    255: "[PAD]",
}
TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"


class TokenizerError(K3Error):
    """A tokenizer directory or file k3 cannot use."""


def special_tokens_for(n_ranks: int) -> dict[str, int]:
    """The 256 special tokens (named + reserved) that follow `n_ranks` BPE ranks: content -> id."""
    out = {}
    for offset in range(NUM_SPECIAL_IDS):
        token_id = n_ranks + offset
        out[NAMED_SPECIALS.get(offset, f"<|reserved_token_{token_id}|>")] = token_id
    return out


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse a `tiktoken.model` file; ranks must be exactly 0..n-1 with no repeated token."""
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read ({e})") from e
    return parse_tiktoken_ranks(text, str(path))


def parse_tiktoken_ranks(text: str, where: str) -> dict[bytes, int]:
    """The ranks of a `tiktoken.model` text (`where` names it in errors)."""
    ranks: dict[bytes, int] = {}
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TokenizerError(f"{where}:{line_no}: expected 'base64token rank', got {line[:60]!r}")
        try:
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except ValueError as e:
            raise TokenizerError(f"{where}:{line_no}: {e}") from e
        if token in ranks:
            raise TokenizerError(f"{where}:{line_no}: token {token!r} listed twice")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{where}: ranks are not exactly 0..{len(ranks) - 1}")
    return ranks


def write_tiktoken_ranks(path: Path, ranks: dict[bytes, int]) -> None:
    lines = [
        f"{base64.b64encode(tok).decode('ascii')} {rank}" for tok, rank in sorted(ranks.items(), key=_rank)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="ascii")


def _rank(item: tuple[bytes, int]) -> int:
    return item[1]


def tokenizer_config(n_ranks: int, model_max_length: int = 1048576) -> dict:
    """`tokenizer_config.json` in the Kimi release format for `n_ranks` BPE ranks."""
    specials = special_tokens_for(n_ranks)
    decoder = {
        str(token_id): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for content, token_id in specials.items()
    }
    return {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [NAMED_SPECIALS[i] for i in (2, 3, 4, 5)],
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "TikTokenTokenizer",
    }


@dataclass(frozen=True)
class SpecialIds:
    bos: int
    eos: int
    end_of_msg: int
    open: int
    close: int
    sep: int
    unk: int
    pad: int


class Tokenizer:
    """Text <-> token ids. `encode` treats special-token text as ordinary text unless allowed."""

    def __init__(self, ranks: dict[bytes, int], specials: dict[str, int], name: str = "k3") -> None:
        n_ranks = len(ranks)
        for content, token_id in specials.items():
            if token_id < n_ranks:
                raise TokenizerError(f"special token {content!r} has id {token_id}, inside the BPE ranks")
        missing = [c for c in NAMED_SPECIALS.values() if c not in specials]
        if missing:
            raise TokenizerError(f"special tokens {missing} are missing from the tokenizer config")
        self.n_ranks = n_ranks
        self.special_tokens = dict(specials)
        self.vocab_size = max(n_ranks - 1, *specials.values()) + 1
        self._enc = tiktoken.Encoding(
            name, pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=specials
        )
        s = specials
        self.special = SpecialIds(
            bos=s["[BOS]"],
            eos=s["[EOS]"],
            end_of_msg=s["<|end_of_msg|>"],
            open=s["<|open|>"],
            close=s["<|close|>"],
            sep=s["<|sep|>"],
            unk=s["[UNK]"],
            pad=s["[PAD]"],
        )
        self._special_ids = set(specials.values())

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer:
        """Load `tiktoken.model` + `tokenizer_config.json` from a checkpoint directory."""
        d = Path(directory)
        if not d.exists():
            raise TokenizerError(f"{d}: no such directory")
        if not d.is_dir():
            raise TokenizerError(f"{d}: not a directory (a checkpoint is a directory)")
        if not (d / TIKTOKEN_FILE).is_file():
            raise TokenizerError(
                f"{d}: no {TIKTOKEN_FILE} (is this a checkpoint directory with a tokenizer?)"
            )
        ranks = read_tiktoken_ranks(d / TIKTOKEN_FILE)
        config = d / CONFIG_FILE
        return cls.from_files(ranks, config.read_bytes() if config.is_file() else None, str(config), d.name)

    @classmethod
    def from_url(cls, url: str) -> Tokenizer:
        """The same two files of a checkpoint served over HTTP (`url` names its folder)."""
        from k3.checkpoint.hub import HubClient, parse_hub_source
        from k3.checkpoint.remote import HttpClient, RemoteOptions

        base = url.rstrip("/") + "/"
        try:
            hub = parse_hub_source(url)  # a Hub repository: its files at the resolved commit
            http = HttpClient(RemoteOptions()) if hub is None else HubClient(hub, RemoteOptions())
        except K3Error as e:
            raise TokenizerError(f"{url}: cannot fetch the tokenizer ({e})") from e
        file_url = (lambda name: base + name) if hub is None else http.url  # type: ignore[attr-defined]
        if hub is not None:
            base = http.location + "/"  # type: ignore[attr-defined]
        try:
            model, config = http.get(file_url(TIKTOKEN_FILE)), http.get(file_url(CONFIG_FILE))
        except K3Error as e:
            raise TokenizerError(f"{base}: cannot fetch the tokenizer ({e})") from e
        finally:
            http.close()
        if model is None:
            raise TokenizerError(f"{base}: no {TIKTOKEN_FILE} there (HTTP 404)")
        try:
            text = bytes(model).decode("ascii")
        except UnicodeDecodeError as e:
            raise TokenizerError(f"{base + TIKTOKEN_FILE}: not ASCII ({e})") from e
        ranks = parse_tiktoken_ranks(text, base + TIKTOKEN_FILE)
        return cls.from_files(ranks, config, base + CONFIG_FILE, base.rstrip("/").rsplit("/", 1)[-1])

    @classmethod
    def from_source(cls, source: str | Path) -> Tokenizer:
        """`from_url` for an http(s) URL, else `from_dir`: a checkpoint's tokenizer wherever it lives."""
        from k3.checkpoint.reader import is_url

        return cls.from_url(str(source)) if is_url(source) else cls.from_dir(source)

    @classmethod
    def from_files(
        cls, ranks: dict[bytes, int], config: bytes | bytearray | None, where: str, name: str
    ) -> Tokenizer:
        """The tokenizer of these ranks and `tokenizer_config.json` bytes (None: the default specials)."""
        specials = special_tokens_for(len(ranks))
        if config is not None:
            try:
                decoder = json.loads(bytes(config).decode("utf-8")).get("added_tokens_decoder", {})
                specials = {entry["content"]: int(token_id) for token_id, entry in decoder.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise TokenizerError(f"{where}: malformed added_tokens_decoder ({e})") from e
        return cls(ranks, specials, name=name or "k3")

    def encode(self, text: str, allowed_special: set[str] | str = frozenset()) -> list[int]:
        """BPE ids of `text`. Special-token text (e.g. "<|open|>") is encoded as plain text unless named
        in `allowed_special` (or `allowed_special="all"`), never rejected: user input cannot forge them.
        Long text is encoded in pieces as the release's tokenizer does (see `release_pieces`)."""
        ids: list[int] = []
        for piece in release_pieces(text):
            ids += self._enc.encode(piece, allowed_special=allowed_special, disallowed_special=())
        return ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (a partial character) becomes U+FFFD."""
        ids = [i for i in ids if not (skip_special and i in self._special_ids)]
        self._check_ids(ids)
        return self._enc.decode(ids, errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        self._check_ids([token_id])
        return self._enc.decode_single_token_bytes(token_id)

    def pieces(self, text: str, allowed_special: set[str] | str = frozenset()) -> list[tuple[int, bytes]]:
        """(id, bytes) of every token of `text`: how the text splits."""
        ids = self.encode(text, allowed_special=allowed_special)
        return [(i, self._enc.decode_single_token_bytes(i)) for i in ids]

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def _check_ids(self, ids: list[int]) -> None:
        bad = [i for i in ids if not (0 <= i < self.n_ranks or i in self._special_ids)]
        if bad:
            raise TokenizerError(f"token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})")


MAX_ENCODE_CHARS = 400_000  # the release encodes text in slices of this many characters...
MAX_RUN_CHARS = 25_000  # ...each cut where a run of whitespace or of non-whitespace grows past this


def release_pieces(text: str) -> list[str]:
    """`text` cut as the release's tokenizer cuts it before BPE (tiktoken fails on longer runs): slices of
    400,000 characters, each cut again before the 25,001st character of a run of only whitespace or only
    non-whitespace. Pieces are encoded separately, so the ids of such long texts depend on the cuts."""
    if len(text) <= MAX_RUN_CHARS:
        return [text]
    pieces = []
    for start in range(0, len(text), MAX_ENCODE_CHARS):
        part = text[start : start + MAX_ENCODE_CHARS]
        cut, run, space = 0, 0, part[0].isspace()
        for i, ch in enumerate(part):
            if ch.isspace() != space:
                run, space = 1, ch.isspace()
            elif run == MAX_RUN_CHARS:
                pieces.append(part[cut:i])
                cut, run = i, 1
            else:
                run += 1
        pieces.append(part[cut:])
    return pieces


class StreamDecoder:
    """Turns a stream of token ids into text chunks without splitting UTF-8 characters.

    A character can span several byte-level tokens; bytes that do not yet form a complete character are
    held back until the next token completes them (or `flush` gives them up as U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._pending = b""

    def push(self, token_id: int) -> str:
        if self.skip_special and self.tokenizer.is_special(token_id):
            return ""
        self._pending += self.tokenizer.token_bytes(token_id)
        # Emit the longest prefix that decodes; keep at most 3 trailing bytes of an unfinished character.
        for cut in range(len(self._pending), max(len(self._pending) - 4, -1), -1):
            try:
                text = self._pending[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self._pending = self._pending[cut:]
            return text
        text, self._pending = self._pending.decode("utf-8", errors="replace"), b""
        return text

    def flush(self) -> str:
        text, self._pending = self._pending.decode("utf-8", errors="replace"), b""
        return text
