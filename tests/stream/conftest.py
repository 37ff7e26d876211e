"""Checkpoints for the streaming tests: `tiny`, `mini` and a deeper K3-shaped one (`k3ish`: 8 layers, KDA
and MLA, AttnRes blocks of 3, 16 latent MXFP4 experts, top-4), written by `init_checkpoint` with norms and
biases moved off their defaults so that a weight read wrongly shows."""

from __future__ import annotations

import pytest
import torch
from perturbed import perturbed_checkpoint
from stream_testing import k3ish_config

from k3.config import K3Config
from k3.model.init import init_checkpoint


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


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls on a shared 2-core machine: one torch thread is several times faster than two."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
