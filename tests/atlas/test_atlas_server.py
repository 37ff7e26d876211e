"""Every endpoint of the atlas server (TestClient), bad parameters, path traversal; the static export."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image
from planted import P, planted_tensors

from k3.atlas.server import STATIC_DIR, create_app
from k3.atlas.site import build_site
from k3.atlas.tiles import BACKGROUND, NEGATIVE, POSITIVE
from k3.atlas.view import Atlas


@pytest.fixture(scope="module")
def atlas(planted_dir: Path, planted_db: Path) -> Atlas:
    return Atlas.open(str(planted_dir), planted_db.parent)


@pytest.fixture(scope="module")
def client(atlas: Atlas) -> TestClient:
    return TestClient(create_app(atlas))


@pytest.fixture(scope="module")
def preset_client() -> TestClient:
    return TestClient(create_app(Atlas.open("k3")))


def test_with_a_key_every_request_needs_it_as_basic_authentication(atlas: Atlas) -> None:
    import base64

    keyed = TestClient(create_app(atlas, key="s3cret"))

    def basic(user_and_password: str) -> dict[str, str]:
        return {"Authorization": "Basic " + base64.b64encode(user_and_password.encode()).decode()}

    for path in ("/", "/api/summary.json", "/static/app.js", "/i18n/en.json"):
        refused = keyed.get(path)
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Basic realm=")
        for wrong in (basic("anyone:s3cre"), basic("s3cret:"), {"Authorization": "Bearer s3cret"}):
            assert keyed.get(path, headers=wrong).status_code == 401
        assert keyed.get(path, headers={"Authorization": "Basic %%%"}).status_code == 401
        assert keyed.get(path, headers=basic("anyone:s3cret")).status_code == 200
        assert keyed.get(path, headers=basic(":s3cret")).status_code == 200
    assert keyed.post("/api/route.json", json={"text": "hola"}).status_code == 401


def test_a_body_over_a_mebibyte_is_413_unread(client: TestClient) -> None:
    big = client.post(
        "/api/route.json", content=b"x" * (2**20 + 1), headers={"Content-Type": "application/json"}
    )
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"


def tid(client: TestClient, name: str) -> int:
    r = client.get("/api/lookup.json", params={"name": name})
    assert r.status_code == 200
    return r.json()["id"]


def test_page_assets_and_languages(client: TestClient) -> None:
    assert "static/app.js" in client.get("/").text
    for asset in ("app.js", "panels.js", "style.css", "vendor/leaflet/leaflet.js", "vendor/leaflet/LICENSE"):
        assert client.get(f"/static/{asset}").status_code == 200, asset
    es, en = client.get("/i18n/es.json").json(), client.get("/i18n/en.json").json()
    assert es["guide"]["title"] == "¿Qué estoy viendo?" and en["guide"]["title"] == "What am I looking at?"

    def keys(d: dict, prefix: str = "") -> set[str]:
        return {f"{prefix}{k}" for k in d} | {
            x for k, v in d.items() if isinstance(v, dict) for x in keys(v, f"{prefix}{k}.")
        }

    assert keys(es) == keys(en)  # both languages say everything


def test_texts_hold_no_figures() -> None:
    """Numbers come from the API: the texts may hold placeholders, not figures of the model."""
    for lang in ("es", "en"):
        text = (STATIC_DIR.parent / "i18n" / f"{lang}.json").read_text()
        for figure in ("93", "896", "2,78", "2.78", "104", "82.432", "82,432", "1,56", "11.010.048"):
            assert figure not in text, (lang, figure)


@pytest.mark.parametrize(
    "path",
    [
        "/static/../server.py",
        "/static/%2e%2e/server.py",
        "/static/..%2fserver.py",
        "/static/%2e%2e%2f%2e%2e%2fpyproject.toml",
        "/static//etc/passwd",
        "/i18n/..%2fserver.json",
        "/i18n/de.json",
        "/api/tiles/0/mean/0/0/..%2f..%2f0.png",
        "/api/layer/..%2f..%2fserver.json",
    ],
)
def test_path_traversal_is_refused(client: TestClient, path: str) -> None:
    r = client.get(path)
    assert 400 <= r.status_code < 500
    assert b"create_app" not in r.content and b"[project]" not in r.content and b"root:" not in r.content


def test_summary_and_layers(client: TestClient, atlas: Atlas) -> None:
    s = client.get("/api/summary.json").json()
    assert s["kind"] == "checkpoint" and s["census"] is None  # the planted checkpoint has no config
    assert s["tensors"] == len(atlas.tensors()) == 8 and s["scanned"] == 8 and s["scan_complete"]
    assert s["has_experts"] and s["measured"]["expert_distinct_max"] == 21
    assert s["routing"] == {"available": False, "code": "no_config", "reason": s["routing"]["reason"]}
    layers = client.get("/api/layers.json").json()
    assert layers["from"] == "tensors" and [layer["index"] for layer in layers["layers"]] == [0, 1]


def test_preset_config_view(preset_client: TestClient) -> None:
    s = preset_client.get("/api/summary.json").json()
    assert s["kind"] == "config" and s["tensors"] == 0
    assert s["census"]["layers"] == 93 and s["census"]["routed_experts"] == 82432
    layers = preset_client.get("/api/layers.json").json()["layers"]
    assert len(layers) == 93
    assert sum(x["mixer"] == "kda" for x in layers) == 69 and sum(x["mixer"] == "mla" for x in layers) == 24
    assert [x["index"] for x in layers if x["ffn"] == "dense"] == [0]
    assert sum(x["params"] for x in layers) < s["census"]["total_params"]  # + embeddings, lm_head
    # no weights: tensor documents, tiles and routing are 4xx
    assert preset_client.get("/api/tensor/0.json").status_code == 404
    assert preset_client.get("/api/tiles/0/mean/0/0/0.png").status_code == 404
    assert preset_client.post("/api/route.json", json={"text": "hola"}).status_code == 409


def test_layer_tensor_grid_similarity(client: TestClient) -> None:
    layer = client.get("/api/layer/1.json").json()
    names = {t["name"] for t in layer["tensors"]}
    assert f"{P}layers.1.block_sparse_moe.experts.2.w1.weight" in names
    assert all(t["stats"] is not None for t in layer["tensors"])
    assert client.get("/api/layer/7.json").status_code == 404
    other = {t["name"] for t in client.get("/api/tensors/other.json").json()["tensors"]}
    assert other == {f"{P}embed_tokens.weight", f"{P}norm.weight"}
    i = tid(client, f"{P}layers.1.block_sparse_moe.experts.2.w1.weight")
    doc = client.get(f"/api/tensor/{i}.json").json()
    assert doc["stats"]["distinct_values"] == 21 and doc["tiles"]["rows"] == 32 and doc["tiles"]["cols"] == 64
    grid = client.get("/api/grid/distinct_values.json").json()
    assert grid["layers"] == [1] and grid["experts"] == 3 and grid["matrices"]["w1"][0][2] == 21
    assert grid["ids"]["w1"][0][2] == i
    sim = client.get("/api/similarity/1.json").json()["matrices"]["w1"]
    assert [0, 1, 0.5] in [[a, b, round(c, 12)] for a, b, c in sim["pairs"]]
    assert client.get("/api/similarity/0.json").json()["matrices"] == {}


def test_tiles_draw_the_diverging_scale(client: TestClient) -> None:
    i = tid(client, f"{P}layers.0.mlp.gate_proj.weight")  # [48, 16], values k/8
    r = client.get(f"/api/tiles/{i}/mean/0/0/0.png")
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    rgba = np.asarray(Image.open(io.BytesIO(r.content)))
    assert rgba.shape == (256, 256, 4)
    w = planted_tensors()[f"{P}layers.0.mlp.gate_proj.weight"].float()
    # one pixel per weight; outside the matrix transparent
    assert (rgba[:48, :16, 3] == 255).all() and (rgba[48:, :, 3] == 0).all() and (rgba[:, 16:, 3] == 0).all()
    px = rgba[:48, :16, :3].astype(int)
    assert (px[w == 0] == BACKGROUND).all()
    # positive pixels lie between the background and amber, negative ones between it and red
    for mask, hue in ((w > 0, POSITIVE), (w < 0, NEGATIVE)):
        t = (px[mask] - np.array(BACKGROUND)) / (np.array(hue) - np.array(BACKGROUND))
        assert np.allclose(t, t[:, :1], atol=0.03) and (t > 0).all()  # rounding: 0.5 / 19 levels
    # brighter for larger magnitudes
    bright = px.sum(-1)
    assert (
        bright[w == 1.25].min() > bright[w == 0.125].max()
        and bright[w == -1.25].min() > bright[w == -0.125].max()
    )
    assert client.get(f"/api/tiles/{i}/maxabs/0/0/0.png").status_code == 200


def test_tiles_of_a_bigger_matrix_at_two_levels(client: TestClient) -> None:
    i = tid(client, f"{P}layers.0.self_attn.A_log")  # [300, 7]: levels 0 (2x2 blocks) and 1 (single weights)
    geo = client.get(f"/api/tensor/{i}.json").json()["tiles"]
    assert geo["max_level"] == 1
    coarse = np.asarray(Image.open(io.BytesIO(client.get(f"/api/tiles/{i}/mean/0/0/0.png").content)))
    assert (coarse[:150, :4, 3] == 255).all() and (coarse[150:, :, 3] == 0).all()
    for y in (0, 1):
        assert client.get(f"/api/tiles/{i}/mean/1/0/{y}.png").status_code == 200
    assert client.get(f"/api/tiles/{i}/mean/1/0/2.png").status_code == 404
    assert client.get(f"/api/tiles/{i}/mean/1/1/0.png").status_code == 404


@pytest.mark.parametrize(
    "path",
    [
        "/api/tensor/abc.json",
        "/api/tensor/-1.json",
        "/api/tensor/99999.json",
        "/api/tiles/0/mean/-1/0/0.png",
        "/api/tiles/0/mean/9/0/0.png",
        "/api/tiles/0/mean/0/5/0.png",
        "/api/tiles/0/bogus/0/0/0.png",
        "/api/tiles/x/mean/0/0/0.png",
        "/api/tiles/99999/mean/0/0/0.png",
        "/api/grid/not_a_stat.json",
        "/api/grid/name.json",
        "/api/layer/x.json",
        "/api/similarity/x.json",
        "/api/values/0.json",
        "/api/values/0.json?r=0&c=0&h=0",
        "/api/values/0.json?r=0&c=0&h=65",
        "/api/values/0.json?r=-1&c=0",
        "/api/values/0.json?r=999999&c=0",
        "/api/values/99999.json?r=0&c=0",
        "/api/lookup.json",
        "/api/lookup.json?name=../../etc/passwd",
    ],
)
def test_malformed_parameters_are_4xx(client: TestClient, path: str) -> None:
    assert 400 <= client.get(path).status_code < 500


def test_values_are_the_stored_weights(client: TestClient) -> None:
    name = f"{P}embed_tokens.weight"
    i = tid(client, name)
    got = client.get(f"/api/values/{i}.json", params={"r": 10, "c": 3, "h": 5, "w": 4}).json()["values"]
    want = planted_tensors()[name][10:15, 3:7].float()
    assert torch.equal(torch.tensor(got), want)


def test_route_refusals(client: TestClient) -> None:
    r = client.post("/api/route.json", json={"text": "hola"})
    assert r.status_code == 409 and r.json()["available"] is False
    assert client.post("/api/route.json", json={"text": ""}).status_code == 422
    assert client.post("/api/route.json", json={"text": "x" * 2001}).status_code == 422
    assert client.post("/api/route.json", content=b"not json").status_code == 422


def test_static_export_mirrors_the_api(atlas: Atlas, client: TestClient, tmp_path: Path) -> None:
    n = build_site(atlas, tmp_path / "site", max_tile_level=1)
    site = tmp_path / "site"
    assert n > 20 and (site / "index.html").exists() and (site / "static/vendor/leaflet/leaflet.js").exists()
    for doc in ("layers.json", "layer/1.json", "tensors/other.json", "grid/rms.json", "similarity/1.json"):
        assert json.loads((site / "api" / doc).read_text()) == client.get(f"/api/{doc}").json(), doc
    summary = json.loads((site / "api/summary.json").read_text())
    assert summary["static"] is True and summary["routing"]["available"] is False
    i = tid(client, f"{P}layers.0.self_attn.A_log")
    for y in (0, 1):
        png = (site / f"api/tiles/{i}/mean/1/0/{y}.png").read_bytes()
        assert png == client.get(f"/api/tiles/{i}/mean/1/0/{y}.png").content


def test_routing_runs_the_model(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A tiny K3 checkpoint with a tokenizer: tokens, and per MoE layer top-k distinct experts per token."""
    from k3.config import K3Config
    from k3.model.init import init_checkpoint
    from k3.tokenizer.build import write_tokenizer
    from k3.tokenizer.kimi import Tokenizer

    cfg = K3Config.preset("tiny")
    ckpt = tmp_path_factory.mktemp("tiny-routing")
    init_checkpoint(cfg, ckpt, seed=0)
    write_tokenizer(ckpt, cfg.vocab_size)
    client = TestClient(create_app(Atlas.open(str(ckpt), tmp_path_factory.mktemp("tiny-routing-db"))))
    assert client.get("/api/summary.json").json()["routing"]["available"] is True
    text = "me senté en el banco de la plaza"
    doc = client.post("/api/route.json", json={"text": text}).json()
    ids = Tokenizer.from_dir(ckpt).encode(text)
    assert [t["id"] for t in doc["tokens"]] == ids
    assert "".join(t["piece"] for t in doc["tokens"]) == text
    moe_layers = [p.index for p in cfg.layer_plan if p.ffn.value == "moe"]
    assert sorted(int(k) for k in doc["layers"]) == moe_layers
    for layer in doc["layers"].values():
        assert len(layer["experts"]) == len(ids)
        for experts, weights in zip(layer["experts"], layer["weights"], strict=True):
            assert len(set(experts)) == cfg.num_experts_per_token
            assert all(0 <= e < cfg.num_experts for e in experts)
            assert sum(weights) == pytest.approx(1.0, abs=1e-4)  # renormalised
            assert weights == sorted(weights, reverse=True)


def test_tile_pixels_are_block_means_and_sampled_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pixel values against loops written from the definition, with and without row sampling."""
    from k3.atlas import tiles
    from k3.atlas.reading import TensorReader
    from k3.checkpoint import open_checkpoint, save_checkpoint

    gen = torch.Generator().manual_seed(8)
    w = torch.randn(4096, 40, generator=gen)  # F32, 160 bytes a row; levels 0..4, level 0: 16x16 blocks
    save_checkpoint([("m.weight", w)], None, tmp_path / "ckpt")
    atlas = Atlas.open(str(tmp_path / "ckpt"), tmp_path / "db")
    t = atlas.tensor(0)
    with open_checkpoint(tmp_path / "ckpt") as ckpt:
        renderer = tiles.TileRenderer(TensorReader(ckpt, tmp_path / "ckpt"))

        def expected(z: int, take: int, mode: str) -> np.ndarray:
            f = 2 ** (4 - z)
            out = np.zeros((min(256, -(-4096 // f)), -(-40 // f)))  # the first tile: at most 256 pixel rows
            for p in range(out.shape[0]):
                for q in range(out.shape[1]):
                    block = w[p * f : p * f + take, q * f : (q + 1) * f].double()
                    out[p, q] = block.mean() if mode == "mean" else block.flatten()[block.abs().argmax()]
            return out

        for z, mode in ((0, "mean"), (0, "maxabs"), (2, "mean")):
            got, f = renderer.pixel_values(t, None, mode, z, 0, 0)
            np.testing.assert_allclose(got, expected(z, f, mode), rtol=1e-6, atol=1e-7)
        # a budget of 4 rows per block of 16 at level 0: the first 4 rows of each block
        monkeypatch.setattr(tiles, "READ_BUDGET", 256 * 4 * 160)
        assert tiles.tile_geometry(t, None)["row_sampled_up_to_level"] == 1  # level 1: 8 rows > 4
        got, f = renderer.pixel_values(t, None, "mean", 0, 0, 0)
        np.testing.assert_allclose(got, expected(0, 4, "mean"), rtol=1e-6, atol=1e-7)
