"""Checkpoints for the export tests: K3 `tiny` and a Kimi Linear of the same size, with tokenizers and every
norm, router bias and KDA decay moved off its default (so that a dropped or misplaced tensor shows)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from tiny_configs import kimi_linear_tiny

from k3.checkpoint import save_checkpoint
from k3.config import K3Config
from k3.model.init import init_checkpoint
from k3.tokenizer.build import write_tokenizer


def perturbed(cfg: K3Config, out, tmp, seed: int = 0):
    init_checkpoint(cfg, tmp, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)

    def tensors():
        for shard in sorted(tmp.glob("*.safetensors")):
            with safe_open(shard, "pt") as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    noise = torch.randn(t.shape, generator=gen) if t.is_floating_point() else None
                    if name.endswith("norm.weight"):
                        t = (t.float() * (1 + 0.3 * noise)).to(t.dtype)
                    elif name.endswith(("e_score_correction_bias", "A_log", "dt_bias")):
                        t = (t.float() + 0.3 * noise).to(t.dtype)
                    yield name, t

    save_checkpoint(tensors(), cfg, out, always_index=True)
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
