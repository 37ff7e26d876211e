"""Checkpoints for tests: `init_checkpoint`, then every weight a test could overlook moved off its default.

(A module of tests/ itself, beside the root conftest.py, so every room's tests can import it by name.)
"""

from __future__ import annotations

import torch
from safetensors import safe_open

from k3.checkpoint import save_checkpoint
from k3.config import K3Config
from k3.model.init import init_checkpoint


def perturbed_checkpoint(cfg: K3Config, out_dir, tmp_dir, seed: int = 0) -> None:
    """init_checkpoint, then norms = 1 + noise, router bias = noise, KDA A_log / dt_bias + noise.

    Random init leaves norms at 1 and the router bias at 0; a parity test on such weights would not
    notice a norm weight or a bias being ignored.
    """
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
