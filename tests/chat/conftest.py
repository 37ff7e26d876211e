"""The release's encoder and tokenizer (NeMo Automodel 0.7.0's K3, standard library + tiktoken) as the
oracle, over a 1,024-id built-in tokenizer written in the release format."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3.tokenizer.build import write_tokenizer
from k3.tokenizer.kimi import Tokenizer


@pytest.fixture(scope="package")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer(out, 1024)
    return out


@pytest.fixture(scope="package")
def tok(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


@pytest.fixture(scope="package")
def release(tokenizer_dir: Path):
    """(the release's `encoding` module, its tokenizer loaded from the same files)."""
    encoding = pytest.importorskip("nemo_automodel.components.models.kimi_k3.encoding")
    tokenization = pytest.importorskip("nemo_automodel.components.models.kimi_k3.tokenization")
    return encoding, tokenization.TikTokenTokenizer.from_pretrained(str(tokenizer_dir))
