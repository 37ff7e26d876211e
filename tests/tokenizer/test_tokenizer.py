"""The tokenizer: file format, the Kimi split pattern, round trips, special tokens, the built-in BPE."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import regex
import tiktoken

from k3.tokenizer.build import builtin_tokenizer, learn_bpe, write_tokenizer
from k3.tokenizer.kimi import (
    KIMI_PAT_STR,
    StreamDecoder,
    Tokenizer,
    TokenizerError,
    special_tokens_for,
)

SEEDS = Path(__file__).resolve().parent / "seeds"  # Spanish texts of the atlas (copied from ../shared/seeds)

CHINESE = "线性注意力为每个头保存一个固定大小的状态。你好，世界！龘"
CODE = 'def f(x: int) -> int:\n\treturn x ** 2  # square\n\n\nprint(f"{f(3)=}")\r\n'
EMOJI = "🙂🎉 👩‍👩‍👧 🇪🇸 ❤️ e\u0301 a\u200bb"
MIXED = "Hola, ¿qué tal? I'm fine, THEY'LL see. 12345678 año 2026 ÑANDÚ 中文English混合 x&&y Ab&c"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d = write_tokenizer(tmp_path_factory.mktemp("tok"), 1024)
    return Tokenizer.from_dir(d)


@pytest.fixture(scope="module")
def mini() -> Tokenizer:
    return builtin_tokenizer(32768)


def seed_sentences() -> list[str]:
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted(SEEDS.glob("*.txt")))
    return [s for s in regex.split(r"(?<=[.?!])\s+", text) if s.strip()][:200]


def test_split_pattern_matches_python_regex_v1() -> None:
    """tiktoken's splitting equals the pattern as understood by `regex` (V1: `&&` is intersection).

    A vocabulary that holds every expected piece whole makes tiktoken emit exactly one token per piece it
    splits off; a different split would leave some piece to byte-level BPE and change the token list."""
    texts = [CHINESE, CODE, EMOJI, MIXED, *seed_sentences()[:40]]
    expected = [p.encode() for t in texts for p in regex.findall(KIMI_PAT_STR, t, flags=regex.V1)]
    ranks = {bytes([b]): b for b in range(256)}
    for piece in expected:
        ranks.setdefault(piece, len(ranks))
    enc = tiktoken.Encoding("probe", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens={})
    got = [enc.decode_single_token_bytes(i) for t in texts for i in enc.encode_ordinary(t)]
    assert got == expected


def test_pattern_semantics_planted() -> None:
    """Hand-checked splits: Han runs apart from Latin words, `&` not treated as a letter, digits by 3,
    contractions attached to their word."""
    split = regex.findall(KIMI_PAT_STR, "Ab&c Hola中文 12345 don't", flags=regex.V1)
    assert split == ["Ab", "&c", " Hola", "中文", " ", "123", "45", " don't"]  # contraction stays attached


@pytest.mark.parametrize("text", [CHINESE, CODE, EMOJI, MIXED, "", " ", "\n\n", "Extraordinario"])
def test_round_trip(tiny: Tokenizer, mini: Tokenizer, text: str) -> None:
    for tok in (tiny, mini):
        assert tok.decode(tok.encode(text)) == text


def test_round_trip_spanish_seeds(tiny: Tokenizer, mini: Tokenizer) -> None:
    sentences = seed_sentences()
    assert len(sentences) > 20
    for tok in (tiny, mini):
        for s in sentences:
            assert tok.decode(tok.encode(s)) == s
    text = "\n".join(sentences)
    # The larger vocabulary compresses the same text into fewer tokens.
    assert len(mini.encode(text)) < len(tiny.encode(text)) < len(text.encode())


def test_special_tokens(tiny: Tokenizer) -> None:
    s = tiny.special
    assert tiny.n_ranks == 768 and tiny.vocab_size == 1024
    assert (s.bos, s.eos, s.end_of_msg, s.open, s.close, s.sep, s.unk, s.pad) == (
        768,
        769,
        770,
        771,
        772,
        773,
        1022,
        1023,
    )
    text = "<|open|>hi<|sep|><|end_of_msg|>"
    assert tiny.encode(text, allowed_special="all")[:1] == [s.open]
    assert s.end_of_msg in tiny.encode(text, allowed_special={"<|end_of_msg|>"})
    # Not allowed: the same text is ordinary text, no special id appears, and it still round-trips.
    plain = tiny.encode(text)
    assert not any(tiny.is_special(i) for i in plain)
    assert tiny.decode(plain) == text
    assert tiny.decode([s.bos, s.eos, s.pad]) == "[BOS][EOS][PAD]"
    assert tiny.decode([s.bos, *tiny.encode("x"), s.eos], skip_special=True) == "x"
    assert tiny.decode([800]) == "<|reserved_token_800|>"


def test_full_size_special_ids() -> None:
    specials = special_tokens_for(163584)
    assert len(specials) == 256
    assert specials["[BOS]"] == 163584 and specials["[EOS]"] == 163585
    assert specials["<|end_of_msg|>"] == 163586 and specials["<|open|>"] == 163587
    assert specials["<|close|>"] == 163588 and specials["<|sep|>"] == 163589
    assert specials["[UNK]"] == 163838 and specials["[PAD]"] == 163839
    assert specials["<|reserved_token_163590|>"] == 163590
    assert sorted(specials.values()) == list(range(163584, 163840))


def test_files_written_in_release_format(tmp_path: Path) -> None:
    write_tokenizer(tmp_path, 1024)
    lines = (tmp_path / "tiktoken.model").read_text().splitlines()
    assert len(lines) == 768
    tok, rank = lines[65].split()
    assert base64.b64decode(tok) == b"A" and rank == "65"
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["added_tokens_decoder"]["770"]["content"] == "<|end_of_msg|>"
    assert config["added_tokens_decoder"]["770"]["special"] is True
    assert len(config["added_tokens_decoder"]) == 256
    assert config["bos_token"] == "[BOS]" and config["eos_token"] == "[EOS]"


def test_builder_is_deterministic_and_sized(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_tokenizer(a, 32768)
    write_tokenizer(b, 32768)
    assert (a / "tiktoken.model").read_bytes() == (b / "tiktoken.model").read_bytes()
    tok = Tokenizer.from_dir(a)
    assert tok.vocab_size == 32768 and tok.n_ranks == 32512
    with pytest.raises(TokenizerError, match="too small"):
        write_tokenizer(tmp_path / "c", 300)


def test_learn_bpe_planted() -> None:
    """Hand-checked: pieces 'aaab', ' aaab', ' ab'. Pair counts aa 4, ab 3, ' a' 2 -> merge 'aa'; then
    (aa, a) 2, (a, b) 3 -> 'ab'; then (aa, ab) 2 beats (' ', aa) 1 and (' ', ab) 1 -> 'aaab'."""
    ranks = learn_bpe("aaab aaab ab", max_merges=3)
    learned = sorted((r, t) for t, r in ranks.items() if r >= 256)
    assert [t for _, t in learned] == [b"aa", b"ab", b"aaab"]


def test_filler_ranks_are_unreachable(mini: Tokenizer) -> None:
    text = MIXED + CHINESE + CODE + EMOJI + "".join(chr(c) for c in range(0x20, 0x3000, 7))
    ids = mini.encode(text)
    assert mini.decode(ids) == text
    assert all(not mini.token_bytes(i).startswith(b"\xff") for i in ids)
    assert mini.token_bytes(32511).startswith(b"\xff")


def test_stream_decoder_never_splits_characters(tiny: Tokenizer) -> None:
    text = CHINESE + EMOJI
    ids = tiny.encode(text)
    assert any(len(tiny.token_bytes(i).decode("utf-8", "ignore")) == 0 for i in ids)  # partial bytes exist
    d = StreamDecoder(tiny)
    chunks = [d.push(i) for i in ids] + [d.flush()]
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no tiktoken.model"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tiktoken.model").write_text("QQ== 0\nQg== 2\n")
    with pytest.raises(TokenizerError, match="not exactly"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tiktoken.model").write_text("QQ==\n")
    with pytest.raises(TokenizerError, match="expected"):
        Tokenizer.from_dir(tmp_path)
    tok = builtin_tokenizer(1024)
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([5000])


def test_a_tokenizer_over_http_is_the_folder_s(tmp_path: Path) -> None:
    """`Tokenizer.from_source(URL)`: the same files through k3's Range server, the same tokenizer; a folder
    without the model file, or a malformed one, is an error naming the URL."""
    from k3.checkpoint.serve import RangeServer

    folder = write_tokenizer(tmp_path / "ckpt", 1024)
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tiktoken.model").write_text("QQ==\n")
    local = Tokenizer.from_source(folder)
    with RangeServer(tmp_path) as server:
        remote = Tokenizer.from_source(f"{server.url}/ckpt")
        with pytest.raises(TokenizerError, match=r"empty/: no tiktoken.model there \(HTTP 404\)"):
            Tokenizer.from_source(f"{server.url}/empty/")
        with pytest.raises(TokenizerError, match=r"bad/tiktoken.model:1: expected"):
            Tokenizer.from_source(f"{server.url}/bad")
    text = MIXED + CHINESE + EMOJI
    assert remote.encode(text) == local.encode(text) and remote.vocab_size == local.vocab_size
    assert remote.special_tokens == local.special_tokens and remote.special == local.special
