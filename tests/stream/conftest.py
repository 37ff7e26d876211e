"""Checkpoints for the streaming tests: `tiny`, `mini` and a deeper K3-shaped one (`k3ish`: 8 layers, KDA
and MLA, AttnRes blocks of 3, 16 latent MXFP4 experts, top-4), written by `init_checkpoint` with norms and
biases moved off their defaults so that a weight read wrongly shows."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from k3.checkpoint import save_checkpoint
from k3.config import K3Config
from k3.model.init import init_checkpoint


def k3ish_config() -> K3Config:
    raw = json.loads(json.dumps(K3Config.preset("tiny").to_dict()))
    text = raw["text_config"]
    text.update(num_hidden_layers=8, num_experts=16, num_experts_per_token=4, attn_res_block_size=3)
    text["linear_attn_config"].update(kda_layers=[1, 2, 3, 5, 6, 7], full_attn_layers=[4, 8])
    return K3Config.from_dict(raw)


def perturbed_checkpoint(cfg: K3Config, out_dir, tmp_dir, seed: int = 0) -> None:
    """init_checkpoint, then norms = 1 + noise, router bias / A_log / dt_bias + noise."""
    init_checkpoint(cfg, tmp_dir, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)

    def tensors():
        for shard in sorted(tmp_dir.glob("*.safetensors")):
            with safe_open(shard, "pt") as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    noise = torch.randn(t.shape, generator=gen) if t.is_floating_point() else None
                    if name.endswith("norm.weight"):
                        t = (t.float() * (1 + 0.3 * noise)).to(t.dtype)
                    elif name.endswith(("e_score_correction_bias", "A_log", "dt_bias")):
                        t = (t.float() + 0.3 * noise).to(t.dtype)
                    yield name, t

    save_checkpoint(tensors(), cfg, out_dir, always_index=True)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """name -> checkpoint folder, written on first use."""
    made = {}

    def get(name: str):
        if name not in made:
            base = tmp_path_factory.mktemp(name)
            if name == "mini":  # 130 MB: plain init, no rewrite
                init_checkpoint(K3Config.preset("mini"), base / "ckpt", seed=0)
            else:
                cfg = k3ish_config() if name == "k3ish" else K3Config.preset(name)
                perturbed_checkpoint(cfg, base / "ckpt", base / "raw")
            made[name] = base / "ckpt"
        return made[name]

    return get


def prompts_for(vocab: int, lengths=(7, 3, 40, 1), seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls on a shared 2-core machine: one torch thread is several times faster than two."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
