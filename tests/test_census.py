"""The parameter census against the published K3 figures and an independent hand count."""

import json
import time

import pytest
from typer.testing import CliRunner

from k3.census import census_from_config, census_from_headers
from k3.cli import app
from k3.config import K3Config
from k3.layout import checkpoint_tensors


@pytest.fixture(scope="module")
def k3():
    return census_from_config(K3Config.preset("k3")).to_json()


def test_k3_headline_figures(k3):
    # The published figures (docs/spec/K3.md section 1 and the seeds).
    assert round(k3["total_params"] / 1e9, 2) == 2779.48
    assert round(k3["active_params"] / 1e9, 1) == 104.2
    assert round(k3["active_fraction"] * 100, 1) == 3.7
    assert (k3["layers"], k3["kda_layers"], k3["mla_layers"], k3["moe_layers"]) == (93, 69, 24, 92)
    assert k3["routed_experts"] == 82_432
    assert k3["params_per_expert"] == 33_030_144
    assert k3["params_per_expert_matrix"] == 11_010_048 == 3584 * 3072
    assert round(k3["dense_mlp_params"] / 1e6, 1) == 726.7
    assert round(k3["expert_params"] / 1e12, 2) == 2.73
    assert round(k3["expert_params"] / k3["total_params"], 2) == 0.98
    assert round(k3["disk_bytes"] / 1e12, 2) == 1.56


def test_k3_hand_count(k3):
    """An independent count written from the spec's shapes, not from k3.layout."""
    H, V, P, E, m, L = 7168, 163840, 96 * 128, 896, 3072, 3584
    kda = 4 * P * H + 3 * P * 4 + 128 * H + P * 128 + 128 + P + 96 * H + 128 + H * P
    mla = 1536 * H + 1536 + 96 * 192 * 1536 + 576 * H + 512 + 96 * 256 * 512 + 2 * 96 * 128 * H
    per_layer = 2 * H + 4 * H  # two norms + AttnRes (two sites, norm + proj)
    moe = E * H + E + 2 * L * H + L + E * 3 * m * L + 3 * 2 * m * H
    dense = 3 * 33792 * H
    total = 2 * V * H + 69 * kda + 24 * mla + 93 * per_layer + dense + 92 * moe + 3 * H
    assert k3["total_params"] == total
    assert k3["active_params"] == total - V * H - 92 * (E - 16) * 3 * m * L
    routed_bytes = 92 * E * 3 * (m * L // 2 + m * L // 32)
    assert k3["disk_bytes_by_format"]["MXFP4"] == routed_bytes


def test_census_is_fast_and_allocates_no_weights():
    start = time.perf_counter()
    census_from_config(K3Config.preset("k3"))
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize("preset", ["tiny", "mini", "kimi-linear-48b"])
def test_headers_census_equals_config_census(preset):
    cfg = K3Config.preset(preset)
    headers = [(t.name, t.dtype, t.shape) for t in checkpoint_tensors(cfg)]
    from_headers = census_from_headers(cfg, headers, source="test")
    from_config = census_from_config(cfg)
    assert from_headers.components == from_config.components
    assert from_headers.disk_bytes == from_config.disk_bytes
    assert from_headers.findings == []


def test_headers_census_reports_disagreements():
    cfg = K3Config.preset("tiny")
    headers = [(t.name, t.dtype, t.shape) for t in checkpoint_tensors(cfg)]
    name, dtype, shape = headers.pop(3)  # one missing
    headers.append(("language_model.model.layers.0.surprise.weight", "BF16", (2, 2)))
    headers[5] = (headers[5][0], headers[5][1], (7,))
    findings = census_from_headers(cfg, headers, source="test").findings
    assert any("1 missing" in f and name in f for f in findings)
    assert any("1 unexpected" in f and "surprise" in f for f in findings)
    assert any("1 mis-shaped" in f for f in findings)


def test_mini_is_laptop_sized():
    mini = census_from_config(K3Config.preset("mini")).to_json()
    assert 50e6 <= mini["total_params"] <= 150e6
    tiny = census_from_config(K3Config.preset("tiny")).to_json()
    assert 1e5 <= tiny["total_params"] <= 1e6


def test_cli_json_keys(tmp_path):
    out = CliRunner().invoke(app, ["census", "k3", "--json"])
    assert out.exit_code == 0, out.output
    j = json.loads(out.output)
    for key in (
        "total_params",
        "active_params",
        "layers",
        "kda_layers",
        "mla_layers",
        "moe_layers",
        "routed_experts",
        "params_per_expert",
        "params_per_expert_matrix",
        "dense_mlp_params",
        "expert_params",
        "disk_bytes",
        "components",
    ):
        assert key in j
    cfg_path = tmp_path / "config.json"
    K3Config.preset("mini").save(cfg_path)
    out = CliRunner().invoke(app, ["census", str(cfg_path), "--json"])
    assert json.loads(out.output)["total_params"] == census_from_config(K3Config.preset("mini")).total_params


def test_cli_bad_target_is_one_line(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{}")
    out = CliRunner().invoke(app, ["census", str(bad)])
    assert out.exit_code == 1
    assert "Traceback" not in out.output


def test_census_of_checkpoint_directory_and_non_k3_checkpoint(tmp_path):
    import torch

    from k3.checkpoint import save_checkpoint

    cfg = K3Config.preset("tiny")
    tensors = (
        (t.name, torch.zeros(t.shape, dtype=torch.uint8 if t.dtype == "U8" else torch.float32))
        for t in checkpoint_tensors(cfg)
    )
    save_checkpoint(tensors, cfg, tmp_path / "tiny", max_shard_size=200_000)
    out = CliRunner().invoke(app, ["census", str(tmp_path / "tiny"), "--json"])
    assert out.exit_code == 0, out.output
    counted = json.loads(out.output)
    assert counted["total_params"] == census_from_config(cfg).total_params
    assert counted["findings"] == []

    save_checkpoint([("w", torch.ones(4, 4))], None, tmp_path / "plain")
    out = CliRunner().invoke(app, ["census", str(tmp_path / "plain")])
    assert out.exit_code == 1 and "no K3-family config" in out.output


@pytest.mark.parametrize("preset", ["k3", "kimi-linear-48b", "mini", "tiny", "k3-slice"])
def test_cli_figures_unchanged(preset):
    """`k3 census PRESET --json` prints what it printed at commit bdc7ed8 (tests/census/, written then),
    before the config's field list was derived from the dataclass; the text figures unchanged since, the
    vision keys (and the vision tower's BF16 bytes on disk) added with issue 34."""
    from pathlib import Path

    result = CliRunner().invoke(app, ["census", preset, "--json"])
    assert result.exit_code == 0, result.output
    expected = (Path(__file__).parent / "census" / f"{preset}.json").read_text()
    assert result.stdout == expected


def test_k3_vision_hand_count(k3):
    """The published tower and projector, counted from K3-vision.md section 3's shapes."""
    D, Q, I, P, T = 1024, 1536, 4096, 14, 7168
    block = 2 * D + 3 * Q * D + D * Q + 2 * I * D
    assert block == 14_682_112
    tower = D * 3 * P * P + 64 * 64 * D + 27 * block + D
    projector = 4096 * 4096 + T * 4096 + T
    assert (tower, projector) == (401_214_464, 46_144_512)
    assert k3["vision_components"] == {"vision_tower": tower, "mm_projector": projector}
    assert k3["vision_params"] == 447_358_976
    # BF16 on disk: the text model's BF16 bytes plus the vision path's
    assert k3["disk_bytes_by_format"]["BF16"] == 113_465_051_136 + 2 * 447_358_976
