"""A small, deterministic byte-level BPE tokenizer for synthetic checkpoints (`k3 init`).

How it is built (same bytes on every machine, no randomness, no downloads):

1. Ranks 0..255 are the single bytes, rank = byte value.
2. The built-in corpus `k3/tokenizer/data/corpus.txt` (a few KB of Spanish, English and Chinese prose about
   the model, plus some Python/Rust/JSON; written for this project) is split with the Kimi pattern
   (`KIMI_PAT_STR`) and counted per piece.
3. Merges are learned greedily: repeatedly merge the most frequent adjacent pair (ties: the smallest
   `(left bytes, right bytes)`), weighted by piece counts; each new token gets the next rank. Pairs that
   occur once are merged too, so learning stops only when every corpus piece is a single token.
4. If the corpus runs out of pairs before `vocab_size - 256` ranks (it does for `mini`, 32,512 ranks),
   the remaining ranks are *filler*: `b"\\xff" + str(rank)`. 0xFF never occurs in UTF-8, so BPE on text
   can never produce a filler token; they only keep the vocabulary the size the config declares.
5. The 256 special ids follow (see `k3.tokenizer.kimi`).

`write_tokenizer(out_dir, vocab_size)` writes `tiktoken.model` + `tokenizer_config.json` into a checkpoint.
"""

from __future__ import annotations

import heapq
import json
from collections import Counter
from functools import lru_cache
from importlib import resources
from pathlib import Path

import regex

from k3.tokenizer.kimi import (
    CONFIG_FILE,
    KIMI_PAT_STR,
    NUM_SPECIAL_IDS,
    TIKTOKEN_FILE,
    Tokenizer,
    TokenizerError,
    special_tokens_for,
    tokenizer_config,
    write_tiktoken_ranks,
)

Pair = tuple[bytes, bytes]


def builtin_corpus() -> str:
    return resources.files("k3.tokenizer").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def learn_bpe(text: str, max_merges: int) -> dict[bytes, int]:
    """Byte ranks + up to `max_merges` new tokens learned from `text` (deterministic; see module doc)."""
    ranks = {bytes([b]): b for b in range(256)}
    piece_counts = Counter(regex.findall(KIMI_PAT_STR, text, flags=regex.V1))
    words = [[bytes([b]) for b in piece.encode("utf-8")] for piece in piece_counts]
    freqs = list(piece_counts.values())

    pair_counts: Counter[Pair] = Counter()
    pair_words: dict[Pair, set[int]] = {}  # pair -> indices of words that contain it
    for w, (word, freq) in enumerate(zip(words, freqs, strict=True)):
        for pair in zip(word, word[1:], strict=False):
            pair_counts[pair] += freq
            pair_words.setdefault(pair, set()).add(w)
    # Max-heap by count, ties by the smaller pair; stale entries are skipped when popped.
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)

    merges = 0
    while heap and merges < max_merges:
        neg_count, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg_count or neg_count == 0:
            continue
        merged = pair[0] + pair[1]
        if merged not in ranks:  # the same bytes can arise from two different pairs
            ranks[merged] = len(ranks)
            merges += 1
        changed: set[Pair] = set()
        for w in sorted(pair_words.pop(pair, ())):
            old, freq = words[w], freqs[w]
            new = _merge_word(old, pair, merged)
            for p in zip(old, old[1:], strict=False):
                pair_counts[p] -= freq
                changed.add(p)
            for p in zip(new, new[1:], strict=False):
                pair_counts[p] += freq
                pair_words.setdefault(p, set()).add(w)
                changed.add(p)
            words[w] = new
        for p in changed:
            if pair_counts[p] > 0:
                heapq.heappush(heap, (-pair_counts[p], p))
            else:
                pair_counts.pop(p)
    return ranks


def _merge_word(word: list[bytes], pair: Pair, merged: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == pair[0] and word[i + 1] == pair[1]:
            out.append(merged)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


@lru_cache(maxsize=4)
def builtin_ranks(vocab_size: int) -> tuple[tuple[bytes, int], ...]:
    """The BPE ranks of the built-in tokenizer for a vocabulary of `vocab_size` ids (incl. 256 specials)."""
    n_ranks = vocab_size - NUM_SPECIAL_IDS
    if n_ranks < 256:
        raise TokenizerError(
            f"vocab_size {vocab_size} is too small: a byte-level tokenizer needs 256 byte tokens "
            f"+ {NUM_SPECIAL_IDS} special ids = {256 + NUM_SPECIAL_IDS}"
        )
    ranks = learn_bpe(builtin_corpus(), max_merges=n_ranks - 256)
    while len(ranks) < n_ranks:
        rank = len(ranks)
        ranks[b"\xff" + str(rank).encode("ascii")] = rank
    return tuple(ranks.items())


def builtin_tokenizer(vocab_size: int) -> Tokenizer:
    """The tokenizer `write_tokenizer(_, vocab_size)` writes, built in memory."""
    n_ranks = vocab_size - NUM_SPECIAL_IDS
    return Tokenizer(
        dict(builtin_ranks(vocab_size)), special_tokens_for(n_ranks), name=f"k3-bpe-{vocab_size}"
    )


def write_tokenizer(out_dir: str | Path, vocab_size: int, model_max_length: int = 1048576) -> Path:
    """Write `tiktoken.model` + `tokenizer_config.json` for `vocab_size` ids into a checkpoint directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ranks = dict(builtin_ranks(vocab_size))
    write_tiktoken_ranks(out / TIKTOKEN_FILE, ranks)
    config = tokenizer_config(len(ranks), model_max_length=model_max_length)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out
