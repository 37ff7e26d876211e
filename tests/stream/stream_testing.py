"""Helpers for the streaming tests: a deeper K3-shaped config, perturbed checkpoints, prompts.

(A module name of its own: pytest imports test helpers by basename from the rootdir.)
"""

from __future__ import annotations

import json

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


def prompts_for(vocab: int, lengths=(7, 3, 40, 1), seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
