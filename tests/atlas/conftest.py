"""Fixtures: the planted checkpoint of `planted.py`, written once, and its scan."""

from __future__ import annotations

from pathlib import Path

import pytest
from planted import planted_tensors

from k3.checkpoint import save_checkpoint


@pytest.fixture(scope="session")
def planted_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("planted")
    # a small shard limit: several shards, so the scan's parallel, per-shard path is exercised
    save_checkpoint(planted_tensors().items(), None, out, max_shard_size=4096)
    return out


@pytest.fixture(scope="session")
def planted_db(planted_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from k3.atlas.scan import scan

    return scan(planted_dir, tmp_path_factory.mktemp("planted-db") / "atlas.sqlite", workers=2)
