"""End to end in headless Chromium (Playwright driving Debian's `chromium`; CI installs it with
`apt-get install -y chromium`). Screenshots go to artifacts/atlas/ (git-ignored)."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import playwright.sync_api
import pytest

CHROMIUM = "/usr/bin/chromium"  # Debian's
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "atlas"
I18N = Path(__file__).resolve().parents[2] / "k3" / "atlas" / "i18n"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(app) -> Iterator[str]:
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        if time.time() > deadline:
            raise RuntimeError("the atlas server did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser(require_tool):
    chromium = require_tool("chromium", path=CHROMIUM, install="make browser: apt-get install -y chromium")
    with playwright.sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def k3_preset_url() -> Iterator[str]:
    from k3.atlas.server import create_app
    from k3.atlas.view import Atlas

    yield from _serve(create_app(Atlas.open("k3")))


@pytest.fixture(scope="module")
def tiny_atlas(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A `tiny` checkpoint and the folder of its scan."""
    from k3.atlas.scan import scan
    from k3.config import K3Config
    from k3.model.init import init_checkpoint

    ckpt = tmp_path_factory.mktemp("tiny")
    init_checkpoint(K3Config.preset("tiny"), ckpt, seed=0)
    db_dir = tmp_path_factory.mktemp("tiny-db")
    scan(ckpt, db_dir / "atlas.sqlite", workers=2)
    return ckpt, db_dir


@pytest.fixture(scope="module")
def tiny_url(tiny_atlas: tuple[Path, Path]) -> Iterator[str]:
    from k3.atlas.server import create_app
    from k3.atlas.view import Atlas

    yield from _serve(create_app(Atlas.open(str(tiny_atlas[0]), tiny_atlas[1])))


def _open(browser, url: str):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(60_000)  # generous: CI machines may be busy
    page.emulate_media(reduced_motion="reduce")  # no smooth scrolling: element boxes are where they stay
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.add_init_script("localStorage.setItem('k3-atlas-lang', 'es')")
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']", timeout=30_000)
    return page, errors


def test_k3_preset_layer_map(browser, k3_preset_url: str) -> None:
    page, errors = _open(browser, k3_preset_url)
    assert page.locator(".layer-row").count() == 93
    assert page.locator(".layer-row[data-mixer='kda']").count() == 69
    assert page.locator(".layer-row[data-mixer='mla']").count() == 24
    assert page.locator(".layer-row[data-ffn='moe']").count() == 92
    assert page.locator("#rhythm span").count() == 93
    # the guide quotes the census, e.g. 93 layers
    assert "93" in page.locator("#guide-cards").inner_text()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "k3-preset.png"), full_page=True)
    assert errors == []
    page.close()


def test_language_switch(browser, k3_preset_url: str) -> None:
    es = json.loads((I18N / "es.json").read_text())
    en = json.loads((I18N / "en.json").read_text())
    page, errors = _open(browser, k3_preset_url)
    title = page.locator("#guide h2")
    assert title.inner_text() == es["guide"]["title"]
    page.click("#lang-en")
    page.wait_for_function("document.documentElement.lang === 'en'")
    assert title.inner_text() == en["guide"]["title"]
    assert page.locator(".layer-row").count() == 93  # redrawn, not lost
    page.click("#lang-es")
    page.wait_for_function("document.documentElement.lang === 'es'")
    assert title.inner_text() == es["guide"]["title"]
    assert errors == []
    page.close()


def _tiles_loaded(page, level: int) -> int:
    return page.evaluate(
        """(level) => [...document.querySelectorAll('#weight-map img.leaflet-tile-loaded')]
             .filter(img => img.src.includes(`/mean/${level}/`) && img.naturalWidth === 256).length""",
        level,
    )


def test_weight_tiles_at_two_zoom_levels(browser, tiny_url: str) -> None:
    page, errors = _open(browser, tiny_url)
    # open the embedding [1024, 64]: three tile levels (0..2)
    page.evaluate("K3.openTensor(0, true)")
    page.wait_for_function("K3.tensor && K3.tensor.id === 0")
    page.wait_for_function(
        "[...document.querySelectorAll('#weight-map img.leaflet-tile-loaded')].length > 0", timeout=60_000
    )
    assert page.evaluate("K3.tensor.tiles.max_level") == 2
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for level in (0, 2):  # the whole matrix in one tile, then one weight per pixel
        page.evaluate(f"K3.viewerMap().setZoom({level}, {{animate: false}})")
        page.wait_for_function(
            f"""[...document.querySelectorAll('#weight-map img.leaflet-tile-loaded')]
                .some(img => img.src.includes('/mean/{level}/'))""",
            timeout=60_000,
        )
        assert _tiles_loaded(page, level) >= 1
        page.locator("#viewer").screenshot(path=str(ARTIFACTS / f"viewer-level-{level}.png"))
    page.screenshot(path=str(ARTIFACTS / "tiny-checkpoint.png"), full_page=True)
    assert errors == []
    page.close()


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of no K3 family: GPT-2-like names, no config, no experts."""
    import torch

    from k3.checkpoint import save_checkpoint

    gen = torch.Generator().manual_seed(7)
    tensors = {"wte.weight": torch.randn(300, 32, generator=gen).bfloat16()}
    for i in range(2):
        tensors[f"h.{i}.attn.c_attn.weight"] = torch.randn(32, 96, generator=gen)
        tensors[f"h.{i}.ln_1.bias"] = torch.zeros(32, dtype=torch.float16)
    out = tmp_path_factory.mktemp("plain")
    save_checkpoint(tensors.items(), None, out)
    return out


def test_plain_checkpoint_without_moe_panels(browser, plain_dir: Path, tmp_path_factory) -> None:
    from k3.atlas.scan import scan
    from k3.atlas.server import create_app
    from k3.atlas.view import Atlas

    db_dir = tmp_path_factory.mktemp("plain-db")
    scan(plain_dir, db_dir / "atlas.sqlite", workers=1)
    for url in _serve(create_app(Atlas.open(str(plain_dir), db_dir))):
        page, errors = _open(browser, url)
        # layers found in GPT-2 names (h.N.); the embedding outside them
        assert page.locator(".layer-row").count() == 2
        assert page.locator("#other-tensors tr[data-tensor]").count() == 1
        assert "wte.weight" in page.locator("#other-tensors").inner_text()
        page.click(".layer-row[data-layer='1'] .bar")
        page.wait_for_selector("#layer-detail tr[data-tensor]")
        assert page.locator("#layer-detail tr[data-tensor]").count() == 2  # c_attn, ln_1, with statistics
        assert "attn.c_attn.weight" in page.locator("#layer-detail").inner_text()
        for moe_panel in ("#experts", "#similarity", "#routing"):
            assert not page.locator(moe_panel).is_visible()
        page.click("#other-tensors tr[data-tensor] >> text=wte.weight")
        page.wait_for_function("K3.tensor && K3.tensor.name === 'wte.weight'")
        page.wait_for_selector("#weight-map img.leaflet-tile-loaded", timeout=60_000)
        page.screenshot(path=str(ARTIFACTS / "plain-checkpoint.png"), full_page=True)
        assert errors == []
        page.close()


def test_static_export_in_the_browser(browser, plain_dir: Path, tmp_path_factory) -> None:
    """`k3 atlas build` output served by a plain file server: the page works without the atlas server."""
    import functools
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    from typer.testing import CliRunner

    from k3.atlas.commands import atlas_app

    site = tmp_path_factory.mktemp("site")
    db_dir = tmp_path_factory.mktemp("site-db")
    result = CliRunner().invoke(atlas_app, ["build", str(plain_dir), "--out", str(site), "--db", str(db_dir)])
    assert result.exit_code == 0, result.output

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    class QuietServer(ThreadingHTTPServer):
        def handle_error(self, request, client_address) -> None:  # Chromium resets its idle connections
            if not isinstance(sys.exc_info()[1], ConnectionError):
                super().handle_error(request, client_address)

    server = QuietServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        page, errors = _open(browser, f"http://127.0.0.1:{server.server_address[1]}/")
        assert page.locator("#other-tensors tr[data-tensor]").count() == 1
        page.wait_for_selector("#weight-map img.leaflet-tile-loaded", timeout=60_000)
        page.screenshot(path=str(ARTIFACTS / "static-export.png"), full_page=True)
        assert errors == []
        page.close()
    finally:
        server.shutdown()


def test_config_view_opens_a_layer_and_hover_values(browser, k3_preset_url: str, tiny_url: str) -> None:
    page, errors = _open(browser, k3_preset_url)
    page.click(".layer-row[data-layer='3'] .bar")  # an MLA + MoE layer of K3
    detail = page.locator("#layer-detail")
    detail.locator("table").wait_for()
    assert "MLA" in detail.inner_text() and detail.locator("tr").count() >= 5
    assert errors == []
    page.close()
    page, errors = _open(browser, tiny_url)
    page.evaluate("K3.openTensor(0, true)")
    page.wait_for_selector("#weight-map img.leaflet-tile-loaded")
    page.evaluate("K3.viewerMap().setZoom(4, {animate: false})")  # past the finest level: weights as squares
    page.locator("#weight-map").scroll_into_view_if_needed()
    box = page.locator("#weight-map").bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.wait_for_function("document.querySelector('#viewer-hover').textContent.includes('valor')")
    assert errors == []
    page.close()


def test_a_keyed_atlas_asks_the_browser_once_and_the_page_s_requests_carry_the_key(
    browser, tiny_atlas
) -> None:
    """`k3 atlas serve --key`: HTTP Basic authentication, which the browser sends with every request of the
    page, its fetches and the routing probe's POST included; without the key, 401 and its challenge."""
    from k3.atlas.server import create_app
    from k3.atlas.view import Atlas

    for url in _serve(create_app(Atlas.open(str(tiny_atlas[0]), tiny_atlas[1]), key="s3cret")):
        anonymous = browser.new_context()  # a headless browser cannot ask: it stops at the 401
        response = anonymous.request.get(url)
        assert response.status == 401 and response.headers["www-authenticate"].startswith("Basic")
        anonymous.close()
        context = browser.new_context(http_credentials={"username": "anyone", "password": "s3cret"})
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.goto(url)
        page.wait_for_selector("body[data-ready='1']", timeout=30_000)
        assert page.locator(".layer-row").count() == 5  # tiny's layers: the page's own fetches got through
        status, answer = page.evaluate(
            """async () => { const r = await fetch("api/route.json", {method: "POST",
                headers: {"Content-Type": "application/json"}, body: JSON.stringify({text: "Hola"})});
                return [r.status, await r.json()]; }"""
        )
        assert status == 409 and answer["available"] is False  # the probe's answer (no tokenizer), not a 401
        context.close()
