"""The patchmergerv2 projector (`mm_projector`, spec section 4.7): merged tower tokens to text-model rows."""

from __future__ import annotations

import torch
from torch import nn

from k3.vision.config import VisionConfig
from k3.vision.tower import RMSNorm


class Projector(nn.Module):
    """`mm_projector`: z [M, 4*D] (sub-token-major) -> proj.0 -> exact GELU -> proj.2 -> post_norm
    (RMSNorm, eps projector_ln_eps) -> [M, text hidden]."""

    def __init__(self, cfg: VisionConfig, out_size: int | None = None) -> None:
        """`out_size`: the text model's hidden size (default `text_hidden_size`; NeMo and vLLM use the text
        config's hidden_size where the two differ)."""
        super().__init__()
        n, out = cfg.projector_in, out_size or cfg.text_hidden_size
        self.proj = nn.Sequential(nn.Linear(n, n, bias=False), nn.GELU(), nn.Linear(n, out, bias=False))
        self.post_norm = RMSNorm(out, cfg.projector_ln_eps)

    def forward(self, merged: list[torch.Tensor]) -> list[torch.Tensor]:
        """merged: per item [M_i, 4, D] -> per item [M_i, text hidden]."""
        lengths = [m.shape[0] for m in merged]
        z = torch.cat([m.flatten(1) for m in merged])  # [sum M_i, 4*D]
        return list(self.post_norm(self.proj(z)).split(lengths))
