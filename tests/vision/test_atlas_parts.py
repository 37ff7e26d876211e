"""The atlas shows the vision tower and the projector as parts of their own, with the same per-tensor
statistics as every other tensor (planted: the projector's post_norm is all ones in a `k3 init`)."""

from __future__ import annotations

from k3.atlas.scan import scan
from k3.atlas.view import Atlas
from k3.config import K3Config
from k3.layout import vision_tensors
from k3.model.init import init_checkpoint


def test_vision_parts_with_statistics(tmp_path):
    cfg = K3Config.preset("tiny")
    init_checkpoint(cfg, tmp_path / "tiny", seed=1)
    scan(tmp_path / "tiny", tmp_path / "atlas.sqlite", workers=1)
    atlas = Atlas.open(str(tmp_path / "tiny"), db_dir=tmp_path)
    parts = atlas.other_tensors()["parts"]
    expected = {}
    for t in vision_tensors(cfg):
        expected.setdefault(t.component, []).append(t.name)
    assert {p: [r["name"] for r in rows] for p, rows in parts.items()} == expected
    post_norm = next(r for r in parts["mm_projector"] if r["name"].endswith("post_norm.weight"))
    assert (
        post_norm["stats"]["min"] == post_norm["stats"]["max"] == 1.0
        and post_norm["stats"]["distinct_values"] == 1
    )
    assert all(r["layer"] is None and r["stats"] is not None for rows in parts.values() for r in rows)
    assert atlas.census()["vision_params"] == sum(t.numel for t in vision_tensors(cfg))
