"""Helpers for the streaming tests: a deeper K3-shaped config and prompts.

(A module name of its own: pytest imports test helpers by basename from the rootdir.)
"""

from __future__ import annotations

import json

import torch

from k3.config import K3Config


def k3ish_config() -> K3Config:
    raw = json.loads(json.dumps(K3Config.preset("tiny").to_dict()))
    text = raw["text_config"]
    text.update(num_hidden_layers=8, num_experts=16, num_experts_per_token=4, attn_res_block_size=3)
    text["linear_attn_config"].update(kda_layers=[1, 2, 3, 5, 6, 7], full_attn_layers=[4, 8])
    return K3Config.from_dict(raw)


def prompts_for(vocab: int, lengths=(7, 3, 40, 1), seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
