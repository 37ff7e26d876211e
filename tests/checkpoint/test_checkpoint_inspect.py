"""`k3 inspect` through typer's CliRunner, on good, filtered and broken checkpoints."""

import json

import pytest
import torch
import typer
from ckpt_testing import tiny_tensors
from typer.testing import CliRunner

from k3.census import census_from_config
from k3.checkpoint import save_checkpoint
from k3.checkpoint.commands import inspect_command
from k3.cli import app
from k3.config import K3Config

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    cfg = K3Config.preset("tiny")
    save_checkpoint(tiny_tensors(cfg), cfg, path, max_shard_size=300_000)
    return path


def test_json_listing(tiny):
    result = runner.invoke(app, ["inspect", str(tiny), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    census = census_from_config(K3Config.preset("tiny"))
    # MXFP4 bytes count 2, scales 0; the vision tower's parameters are counted apart in the census
    assert report["total_params"] == census.total_params + census.vision_params
    assert report["total_bytes"] == census.disk_bytes
    assert report["findings"] == []
    assert report["total_tensors"] == report["shown_tensors"] == len(report["tensors"])
    packed = next(t for t in report["tensors"] if t["name"].endswith(".weight_packed"))
    scale = next(t for t in report["tensors"] if t["name"].endswith(".weight_scale"))
    assert packed["params"] == 2 * packed["bytes"] and scale["params"] == 0


def test_filter(tiny):
    result = runner.invoke(app, ["inspect", str(tiny), "--json", "--filter", r"layers\.2\..*experts\.3\."])
    report = json.loads(result.stdout)
    assert report["shown_tensors"] == 6 and all(".experts.3." in t["name"] for t in report["tensors"])
    assert report["total_tensors"] > 6


def test_table(tiny):
    result = runner.invoke(app, ["inspect", str(tiny), "--filter", "embed_tokens"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "language_model.model.embed_tokens.weight" in result.stdout
    assert "[1024, 64]" in result.stdout and "65,536" in result.stdout and "131,072" in result.stdout
    assert "1 of 338 tensors shown" in result.stdout  # 320 of the text model + 18 of the vision path


def test_findings_for_non_k3_checkpoint(tmp_path):
    save_checkpoint([("w", torch.zeros(3))], None, tmp_path)
    result = runner.invoke(app, ["inspect", str(tmp_path), "--json"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["findings"] == ["no K3 config: no config.json"]


def test_broken_checkpoint_is_one_line_and_exit_1(tiny, tmp_path):
    for f in tiny.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    shard = tmp_path / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    result = runner.invoke(app, ["inspect", str(tmp_path)])
    assert result.exit_code == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "truncated shard" in lines[0]
    assert "Traceback" not in result.stderr and str(shard) in lines[0]


def test_bad_regex(tiny):
    result = runner.invoke(app, ["inspect", str(tiny), "--filter", "("])
    assert result.exit_code == 1 and result.stderr.startswith(
        "error: --filter '(' is not a regular expression"
    )


def test_census_cross_check_through_the_k3_app(tmp_path):
    """A K3 checkpoint short of one tensor: the k3 app's inspect adds the census's finding; the checkpoint
    room's command without a cross-check reports only what the checkpoint itself shows."""
    cfg = K3Config.preset("tiny")
    tensors = [(name, t) for name, t in tiny_tensors(cfg) if not name.endswith("embed_tokens.weight")]
    save_checkpoint(tensors, cfg, tmp_path)
    report = json.loads(runner.invoke(app, ["inspect", str(tmp_path), "--json"]).stdout)
    assert report["findings"] == ["1 missing tensor(s) vs config: language_model.model.embed_tokens.weight"]
    bare = typer.Typer()
    bare.command("inspect")(inspect_command())
    bare.callback()(lambda: None)
    assert json.loads(runner.invoke(bare, ["inspect", str(tmp_path), "--json"]).stdout)["findings"] == []
