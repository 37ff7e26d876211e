"""Shared fixtures: a `tiny` checkpoint from `init_checkpoint`, with every weight moved off its default."""

from __future__ import annotations

import pytest
from perturbed import perturbed_checkpoint

from k3.config import K3Config


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    base = tmp_path_factory.mktemp("tiny")
    perturbed_checkpoint(K3Config.preset("tiny"), base / "ckpt", base / "raw")
    return base / "ckpt"
