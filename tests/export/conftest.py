"""Checkpoints for the export tests: K3 `tiny` and a Kimi Linear of the same size, with tokenizers and every
norm, router bias and KDA decay moved off its default (so that a dropped or misplaced tensor shows)."""

from __future__ import annotations

import pytest
from perturbed import perturbed_checkpoint
from tiny_configs import kimi_linear_tiny

from k3.config import K3Config
from k3.tokenizer.build import write_tokenizer


def perturbed(cfg: K3Config, out, tmp, seed: int = 0):
    perturbed_checkpoint(cfg, out, tmp, seed)
    write_tokenizer(out, cfg.vocab_size)
    return out


@pytest.fixture(scope="session")
def k3_tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("k3_tiny")
    return perturbed(K3Config.preset("tiny"), base / "ckpt", base / "raw")


@pytest.fixture(scope="session")
def kimi_linear_tiny_ckpt(tmp_path_factory):
    base = tmp_path_factory.mktemp("kimi_linear_tiny")
    return perturbed(kimi_linear_tiny(), base / "ckpt", base / "raw")
