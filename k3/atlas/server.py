"""The atlas web server: the page, its assets, and a JSON API over one `Atlas`.

    app = create_app(Atlas.open("checkpoints/mini"))      # then: uvicorn.run(app, host="127.0.0.1")

Safety: tensors are addressed by their integer id in the checkpoint's index (names are looked up in the
index, never used as paths); static files come only from the package's `static/` directory (Starlette's
StaticFiles refuses paths that leave it); every parameter is validated and a bad one is a 4xx. The
command binds 127.0.0.1 unless told otherwise, and on an address other machines reach it needs a key, which
every request then carries as HTTP Basic authentication (the browser asks once: any user name, the key as
password; `BasicAuth`). The routing probe runs one text at a time, of at most 2,000 characters.

Every GET document has the same URL in the static export (`k3.atlas.site`), so the page works on both.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import threading
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Receive, Scope, Send

from k3.atlas.stats import STAT_KEYS
from k3.atlas.tiles import MODES
from k3.atlas.view import Atlas, AtlasError
from k3.listen import BodyLimit

STATIC_DIR = Path(str(resources.files("k3.atlas") / "static"))
I18N_DIR = Path(str(resources.files("k3.atlas") / "i18n"))
LANGUAGES = ("es", "en")
MAX_VALUE_WINDOW = 64
MAX_REQUEST_BYTES = 2**20  # the one body the API takes: a routing text of at most 2,000 characters


class RouteRequest(BaseModel):
    text: str = Field(min_length=1, max_length=2000)


class BasicAuth:
    """ASGI middleware: every HTTP request needs `Authorization: Basic base64(USER:KEY)`, any USER (else 401
    with the challenge that makes a browser ask for it and send it with every later request, the page's
    fetches included)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.key = app, key.encode()

    def _password(self, header: bytes) -> bytes:
        scheme, _, encoded = header.partition(b" ")
        if scheme.lower() != b"basic":
            return b""
        try:
            return base64.b64decode(encoded.strip(), validate=True).partition(b":")[2]
        except (binascii.Error, ValueError):
            return b""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = self._password(dict(scope["headers"]).get(b"authorization", b""))
            if not hmac.compare_digest(given, self.key):
                challenge = {"WWW-Authenticate": 'Basic realm="k3 atlas", charset="UTF-8"'}
                response = JSONResponse({"detail": "the atlas key is needed"}, 401, headers=challenge)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(atlas: Atlas, key: str | None = None) -> FastAPI:
    """The atlas's app; with `key`, every request must carry it (`BasicAuth`)."""
    app = FastAPI(title="k3 atlas", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=MAX_REQUEST_BYTES)
    if key is not None:  # outermost: a request without the key is refused unread
        app.add_middleware(BasicAuth, key=key)
    state = _ServerState(atlas)

    def not_found(e: Exception) -> HTTPException:
        return HTTPException(status_code=404, detail=str(e))

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/i18n/{lang}.json")
    def i18n(lang: str) -> FileResponse:
        if lang not in LANGUAGES:
            raise HTTPException(status_code=404, detail=f"no language {lang!r}; one of {LANGUAGES}")
        return FileResponse(I18N_DIR / f"{lang}.json", media_type="application/json")

    @app.get("/api/summary.json")
    def summary() -> dict[str, Any]:
        doc = atlas.summary()
        doc["static"] = False
        doc["routing"] = state.routing_status()
        return doc

    @app.get("/api/layers.json")
    def layers() -> dict[str, Any]:
        return atlas.layers()

    @app.get("/api/layer/{index}.json")
    def layer(index: int) -> dict[str, Any]:
        try:
            return atlas.layer(index)
        except AtlasError as e:
            raise not_found(e) from e

    @app.get("/api/tensors/other.json")
    def other_tensors() -> dict[str, Any]:
        return atlas.other_tensors()

    @app.get("/api/tensor/{tid}.json")
    def tensor(tid: int) -> dict[str, Any]:
        try:
            return atlas.tensor_doc(tid)
        except AtlasError as e:
            raise not_found(e) from e

    @app.get("/api/lookup.json")
    def lookup(name: str = Query(..., min_length=1, max_length=1000)) -> dict[str, Any]:
        try:
            return {"id": atlas.tensor_named(name).id}
        except AtlasError as e:
            raise not_found(e) from e

    @app.get("/api/grid/{stat}.json")
    def grid(stat: str) -> dict[str, Any]:
        if stat not in STAT_KEYS:
            raise HTTPException(status_code=404, detail=f"unknown statistic {stat!r}")
        return atlas.grid(stat)

    @app.get("/api/similarity/{layer}.json")
    def similarity(layer: int) -> dict[str, Any]:
        return atlas.similarity(layer)

    @app.get("/api/tiles/{tid}/{mode}/{z}/{x}/{y}.png")
    def tile(tid: int, mode: str, z: int, x: int, y: int) -> Response:
        if mode not in MODES:
            raise HTTPException(status_code=404, detail=f"mode must be one of {MODES}")
        try:
            t = atlas.tensor(tid)
            png = state.renderer().tile(t, atlas.stats(tid), mode, z, x, y)
        except (AtlasError, ValueError) as e:
            raise not_found(e) from e
        return Response(png, media_type="image/png", headers={"Cache-Control": "max-age=3600"})

    @app.get("/api/values/{tid}.json")
    def values(
        tid: int,
        r: int = Query(..., ge=0),
        c: int = Query(..., ge=0),
        h: int = Query(1, ge=1, le=MAX_VALUE_WINDOW),
        w: int = Query(1, ge=1, le=MAX_VALUE_WINDOW),
    ) -> dict[str, Any]:
        try:
            t = atlas.tensor(tid)
            block = state.renderer().values(t, r, c, h, w)
        except AtlasError as e:
            raise not_found(e) from e
        except ValueError as e:
            raise HTTPException(status_code=400, detail=str(e)) from e
        return {"id": tid, "r": r, "c": c, "values": block}

    @app.post("/api/route.json")
    def route(req: RouteRequest) -> JSONResponse:
        from k3.atlas.routing import RoutingUnavailable

        with state.routing_one_at_a_time:  # a text runs the routers of every layer: one at a time
            probe = state.routing()
            if probe is None:
                return JSONResponse(
                    {"available": False, "reason": state.routing_status()["reason"]}, status_code=409
                )
            try:
                return JSONResponse({"available": True, **probe.route(req.text)})
            except RoutingUnavailable as e:
                return JSONResponse({"available": False, "reason": str(e)}, status_code=409)
            except ValueError as e:
                raise HTTPException(status_code=400, detail=str(e)) from e

    return app


class _ServerState:
    """Things built on first use: the tile renderer (opens the checkpoint) and the routing probe."""

    def __init__(self, atlas: Atlas):
        self.atlas = atlas
        self._renderer = None
        self._probe = None
        self.routing_one_at_a_time = threading.Lock()

    def renderer(self):
        if self._renderer is None:
            from k3.atlas.reading import TensorReader
            from k3.atlas.tiles import TileRenderer

            self._renderer = TileRenderer(TensorReader(self.atlas.checkpoint(), self.atlas.source))
        return self._renderer

    def routing(self):
        if not self.atlas.is_checkpoint:
            return None
        if self._probe is None:
            from k3.atlas.routing import RoutingProbe

            self._probe = RoutingProbe(self.atlas.source, self.atlas.config, self.atlas.total_bytes)
        return self._probe

    def routing_status(self) -> dict[str, Any]:
        probe = self.routing()
        if probe is None:
            return {
                "available": False,
                "code": "config_only",
                "reason": "config-only view: no weights to run",
            }
        return probe.status()
