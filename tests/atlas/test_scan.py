"""The scan on checkpoints with planted facts; interrupted scans; remote scans; `k3 atlas stats --json`."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from planted import P, planted_tensors
from typer.testing import CliRunner

from k3.atlas.commands import atlas_app
from k3.atlas.db import AtlasDB
from k3.atlas.scan import scan
from k3.checkpoint import save_checkpoint
from k3.checkpoint.serve import RangeServer
from k3.ops.mxfp4 import dequantize_mxfp4

EXPERTS = f"{P}layers.1.block_sparse_moe.experts."


def record(db_path: Path, name: str) -> dict:
    db = AtlasDB(db_path)
    t = db.tensor_by_name(name)
    assert t is not None, name
    return db.stats(t.id)


def test_planted_facts(planted_db: Path) -> None:
    bf16 = record(planted_db, f"{P}layers.0.mlp.gate_proj.weight")
    assert bf16["distinct_values"] == 21 and bf16["distinct_exact"]
    assert [v for v, _ in bf16["values"]] == [k / 8 for k in range(-10, 11)]
    mx = record(planted_db, f"{EXPERTS}2.w1.weight")
    assert mx["dtype"] == "MXFP4" and mx["shape"] == [32, 64] and mx["params"] == 32 * 64
    assert mx["distinct_values"] == 21 and mx["distinct_exact"]
    assert sorted(abs(v) for v, _ in mx["values"]) == sorted([0.0] + 2 * [0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 24])
    zeros = record(planted_db, f"{P}norm.weight")
    assert zeros["zero_fraction"] == 1.0 and zeros["distinct_values"] == 1
    assert zeros["min"] == zeros["max"] == zeros["mean"] == zeros["rms"] == 0.0
    # a part's name finds its logical tensor
    assert AtlasDB(planted_db).tensor_by_name(f"{EXPERTS}2.w1.weight_scale").name == f"{EXPERTS}2.w1.weight"


def test_planted_cosine(planted_db: Path) -> None:
    sim = AtlasDB(planted_db).similarity(1)
    pairs = {(a, b): c for a, b, c in sim["w1"]["pairs"]}
    assert pairs[(0, 1)] == pytest.approx(0.5, abs=1e-12)  # a quarter of the signs flipped
    # the others against a direct computation on the dequantized matrices
    t = planted_tensors()
    dense = {
        e: dequantize_mxfp4(
            t[f"{EXPERTS}{e}.w1.weight_packed"], t[f"{EXPERTS}{e}.w1.weight_scale"], torch.float64
        )
        for e in range(3)
    }
    for a, b in ((0, 2), (1, 2)):
        want = torch.nn.functional.cosine_similarity(dense[a].flatten(), dense[b].flatten(), 0)
        assert pairs[(a, b)] == pytest.approx(float(want), abs=1e-6)


def test_expert_stats_match_dequantized(planted_db: Path) -> None:
    t = planted_tensors()
    for e in range(3):
        w = dequantize_mxfp4(
            t[f"{EXPERTS}{e}.w1.weight_packed"], t[f"{EXPERTS}{e}.w1.weight_scale"], torch.float64
        )
        r = record(planted_db, f"{EXPERTS}{e}.w1.weight")
        assert r["mean"] == pytest.approx(float(w.mean()), abs=1e-12)
        assert r["rms"] == pytest.approx(float(w.pow(2).mean().sqrt()), rel=1e-12)
        assert r["distinct_values"] == torch.unique(w + 0.0).numel()


def _dump(db_path: Path) -> dict:
    """Everything a scan stores, minus timings."""
    conn = sqlite3.connect(db_path)
    stats = {r[0]: json.loads(r[1]) for r in conn.execute("SELECT id, record FROM stats")}
    sim = sorted(conn.execute("SELECT * FROM similarity").fetchall())
    conn.close()
    return {"stats": stats, "similarity": sim}


@pytest.fixture(scope="module")
def many_tensors_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 small tensors in 3 shards, and two expert layers: a scan long enough to interrupt."""
    gen = torch.Generator().manual_seed(5)
    tensors = {
        f"{P}layers.{i % 3}.extra.t{i}.weight": torch.randn(48, 40, generator=gen).bfloat16()
        for i in range(300)
    }
    for layer in (1, 2):
        for e in range(4):
            tensors[f"{P}layers.{layer}.block_sparse_moe.experts.{e}.w2.weight"] = torch.randn(
                24, 16, generator=gen
            ).bfloat16()
    out = tmp_path_factory.mktemp("many")
    save_checkpoint(tensors.items(), None, out, max_shard_size=700_000)
    return out


def test_interrupted_scan_resumes_to_the_same_result(many_tensors_dir: Path, tmp_path: Path) -> None:
    full = scan(many_tensors_dir, tmp_path / "full" / "atlas.sqlite", workers=2)
    seen = []

    def stop_after_50(p) -> None:
        seen.append(p.tensors_done)
        if p.tensors_done >= 50:
            raise KeyboardInterrupt  # as a user's Ctrl-C

    partial = tmp_path / "partial" / "atlas.sqlite"
    with pytest.raises(KeyboardInterrupt):
        scan(many_tensors_dir, partial, workers=2, on_progress=stop_after_50)
    assert 50 <= len(AtlasDB(partial).done_ids()) < 308
    resumed_from = []
    scan(many_tensors_dir, partial, workers=2, on_progress=lambda p: resumed_from.append(p.tensors_done))
    assert resumed_from[0] >= 50  # finished tensors were not redone
    assert _dump(partial) == _dump(full)


def test_scan_killed_with_sigkill_resumes(many_tensors_dir: Path, tmp_path: Path) -> None:
    db_path = tmp_path / "killed" / "atlas.sqlite"
    code = (
        "import sys, time\n"
        "from k3.atlas.scan import scan\n"
        "scan(sys.argv[1], sys.argv[2], workers=1, on_progress=lambda p: time.sleep(0.01))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(many_tensors_dir), str(db_path)])
    deadline = time.time() + 120
    done = 0
    while time.time() < deadline:
        if db_path.exists():
            try:
                done = len(AtlasDB(db_path).done_ids())
            except sqlite3.OperationalError:  # schema not written yet
                done = 0
            if done >= 30:
                break
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(AtlasDB(db_path).done_ids())
    assert 30 <= done < 308, "the kill must land mid-scan"
    scan(many_tensors_dir, db_path, workers=2)
    assert _dump(db_path) == _dump(scan(many_tensors_dir, tmp_path / "clean" / "atlas.sqlite", workers=2))


def test_remote_scan_equals_local(planted_dir: Path, planted_db: Path, tmp_path: Path) -> None:
    with RangeServer(planted_dir) as server:
        remote = scan(server.url, tmp_path / "remote" / "atlas.sqlite", workers=2)
    assert _dump(remote) == _dump(planted_db)


def test_stats_command_json(planted_dir: Path, tmp_path: Path) -> None:
    name = f"{P}layers.0.mlp.gate_proj.weight"
    result = CliRunner().invoke(
        atlas_app, ["stats", str(planted_dir), name, "--out", str(tmp_path), "--json"]
    )
    assert result.exit_code == 0, result.output
    (r,) = json.loads(result.stdout)
    for key in ("name", "dtype", "shape", "params", "min", "max", "mean", "mean_abs", "rms", "zero_fraction"):
        assert key in r
    assert (r["name"], r["dtype"], r["shape"], r["params"]) == (name, "BF16", [48, 16], 768)
    assert (r["distinct_values"], r["distinct_exact"], r["min"], r["max"]) == (21, True, -1.25, 1.25)
    bad = CliRunner().invoke(atlas_app, ["stats", str(planted_dir), "no.such.tensor", "--out", str(tmp_path)])
    assert bad.exit_code == 1 and "no.such.tensor" in bad.output
