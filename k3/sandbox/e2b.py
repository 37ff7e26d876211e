"""`k3 sandbox serve --e2b`: k3's sandboxes behind E2B's own protocol, so the unchanged `e2b` SDK drives them.
One server on 127.0.0.1 answers three things:

- E2B's control-plane REST API (as in E2B's spec/openapi.yml): create (`POST /sandboxes`, `/v2/sandboxes`),
  get, list (`/sandboxes`, `/v2/sandboxes`: filters and pages, `e2b_listing.py`), kill, set timeout,
  metrics, pause, resume / connect, snapshots (`POST /sandboxes/{id}/snapshots`, a snapshot id is then a
  template; `GET /snapshots`; `DELETE /templates/{id}`), fork.
  `X-API-KEY` is a k3 client token: each key sees only its own sandboxes (another key's id is 404), its
  live sandboxes are capped by the quota (429, the SDK's RateLimitException), a wrong key is 401.
- E2B's in-sandbox API ("envd", `envd.py`): processes and the filesystem over Connect, `/files`, `/health`;
  the SDK names the sandbox in a header, so one address serves every sandbox (`E2B_SANDBOX_URL`).
- k3's own API (`server.py`) under `/k3`, with the same tokens, quotas and sandboxes (a sandbox made there
  is the SDK's to drive too; its template reads `NAME@BACKEND`).

A template is a k3 template name ("base" is k3's "python"), optionally `NAME@BACKEND` to pick the backend
("base@bwrap"), or the id of a snapshot this key made."""

from __future__ import annotations

import hmac
import secrets
import threading
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3.listen import BodyLimit
from k3.sandbox import e2b_listing, snapshots
from k3.sandbox.envd import ENVD_VERSION, EnvdSandbox, connect_apps, envd_router
from k3.sandbox.sandbox import BACKENDS, Sandbox, default_root
from k3.sandbox.server import CEILING, MAX_BODY_BYTES, Registry, create_app
from k3.sandbox.types import Limits, SandboxError

TEMPLATE_ALIASES = {"base": "python"}


class NewSandbox(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")
    template_id: str = Field("base", alias="templateID")
    timeout: int = 300
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = Field(None, alias="envVars")
    allow_internet_access: bool | None = None


class TimeoutBody(BaseModel):
    timeout: int


class ConnectBody(BaseModel):
    timeout: int | None = None


class SnapshotBody(BaseModel):
    name: str | None = None


class ForkBody(BaseModel):
    timeout: int | None = None
    count: int | None = None


@dataclass
class Info:
    """E2B's view of one sandbox (running, or paused: then `entry.sandbox` is the stopped one)."""

    owner: str
    template: str
    entry: EnvdSandbox
    token: str
    metadata: dict[str, str] = field(default_factory=dict)
    started: datetime = field(default_factory=lambda: datetime.now(UTC))
    ends: float = 0.0
    paused: bool = False
    pausing: bool = False  # being paused: the TTL reaper leaves its entry alone


def _whole_cpus(cores: float) -> int:
    """E2B's `cpuCount` (whole CPUs) for a CPU quota in cores."""
    return max(1, round(cores))


def _iso(t: datetime) -> str:
    """An ISO 8601 UTC time, always to the microsecond (so that the strings sort as the times do)."""
    return t.isoformat(timespec="microseconds").replace("+00:00", "Z")


def _error_body(status: int, message: str) -> dict:
    """An error in E2B's shape, which the SDK reads."""
    return {"code": status, "message": message}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(_error_body(status, message), status_code=status)


def create_e2b_app(
    tokens: dict[str, str],
    root: Path | None = None,
    quota: int = 8,
    max_ttl_s: float = 3600,
    backend: str = "gvisor",
    limits: Limits | None = None,
    reap_every_s: float = 5.0,
    max_body_bytes: int = MAX_BODY_BYTES,
    ceiling: Limits = CEILING,
):
    """The ASGI application. `tokens`: API key -> client name; `backend`: the backend of sandboxes whose
    template names none; `limits`: every sandbox's limits; a request body (an upload) over `max_body_bytes`
    gets 413 unread; `ceiling`: the most a client of k3's own API (under /k3) may ask for a sandbox."""
    if not tokens:
        raise SandboxError("the sandbox server needs at least one API key")
    if backend not in BACKENDS:
        raise SandboxError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    state_root = Path(root) if root is not None else default_root()
    reg = Registry(quota)
    infos: dict[str, Info] = {}  # guarded by reg.lock, like the registry's tables
    stop = threading.Event()

    def reaper() -> None:
        while not stop.wait(reap_every_s):
            reg.reap()
            with reg.lock:
                for sid in [
                    s for s, i in infos.items() if not (i.paused or i.pausing) and s not in reg.sandboxes
                ]:
                    infos.pop(sid)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        thread = threading.Thread(target=reaper, name="e2b-ttl", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            reg.close()

    app = FastAPI(
        title="k3 sandbox (E2B)", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, error=_error_body)  # /k3's bodies too

    @app.exception_handler(SandboxError)
    async def bad_input(request: Request, exc: SandboxError):
        return _error(400, str(exc))

    # Every error in E2B's shape, {"code", "message"}, which the SDK reads: also a path no route serves
    # (starlette's HTTPException, the base of FastAPI's) and a body that fails validation.
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or "body"
        return _error(400, f"{where}: {first.get('msg', 'invalid request')}")

    def client(request: Request) -> str:
        key = request.headers.get("x-api-key", "")
        for known, name in tokens.items():
            if hmac.compare_digest(key.encode(), known.encode()):
                return name
        raise HTTPException(401, "Invalid API key")

    def adopt_own_api_sandboxes() -> None:
        """Give E2B's view to the running sandboxes made through k3's own API at /k3 (caller holds reg.lock):
        the SDK then finds, connects to and drives them as its own."""
        for sid, (owner, sbx) in reg.sandboxes.items():
            if sid not in infos:
                template = f"{sbx.template}@{sbx.backend}"
                infos[sid] = Info(owner, template, EnvdSandbox(sbx, {}), secrets.token_urlsafe(24))

    def owned(sid: str, who: str) -> Info:
        with reg.lock:
            adopt_own_api_sandboxes()
            info = infos.get(sid)
        if info is None or info.owner != who:
            raise HTTPException(404, f"sandbox {sid} not found")
        return info

    def running(sid: str, who: str = Depends(client)) -> Info:
        info = owned(sid, who)
        if info.paused:
            raise HTTPException(409, f"sandbox {sid} is paused")
        return info

    def sandbox_json(sid: str, info: Info) -> dict:
        return {
            "templateID": info.template,
            "sandboxID": sid,
            "clientID": "k3",
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": info.token,
            "domain": None,
        }

    def detail_json(sid: str, info: Info) -> dict:
        lim = info.entry.sandbox.limits
        ends = datetime.fromtimestamp(info.ends or info.entry.sandbox._deadline, UTC)
        return {
            **sandbox_json(sid, info),
            "startedAt": _iso(info.started),
            "endAt": _iso(ends),
            "cpuCount": _whole_cpus(lim.cpus),
            "memoryMB": lim.memory_mb,
            "diskSizeMB": lim.disk_mb,
            "state": "paused" if info.paused else "running",
            "metadata": info.metadata,
        }

    pending: dict[str, int] = {}  # sandboxes being started, per client (guarded by reg.lock)

    @contextmanager
    def admit(who: str, count: int = 1):
        """Hold `count` places of the client's quota while its sandboxes start (429 if there are none)."""
        with reg.lock:
            taken = reg.live(who) + pending.get(who, 0)
            if taken + count > reg.quota:
                raise HTTPException(
                    429, f"client {who!r} already has {taken} of its {reg.quota} live sandboxes"
                )
            pending[who] = pending.get(who, 0) + count
        try:
            yield
        finally:
            with reg.lock:
                pending[who] -= count

    def register(who: str, sbx: Sandbox, template: str, metadata: dict, envs: dict) -> tuple[str, Info]:
        info = Info(who, template, EnvdSandbox(sbx, dict(envs)), secrets.token_urlsafe(24), dict(metadata))
        with reg.lock:
            reg.sandboxes[sbx.sandbox_id] = (who, sbx)
            infos[sbx.sandbox_id] = info
        return sbx.sandbox_id, info

    def resolve(template: str, who: str) -> tuple[str, str, str | None]:
        """(k3 template, backend, snapshot id) of an E2B template id."""
        with reg.lock:
            if reg.snapshots.get(template) == who:
                return template, backend, template
        name, _, chosen = template.partition("@")
        return TEMPLATE_ALIASES.get(name, name), chosen or backend, None

    def create(body: NewSandbox, who: str) -> JSONResponse:
        name, chosen, snap = resolve(body.template_id, who)
        with admit(who):
            sbx = Sandbox.create(
                template=name,
                timeout=min(body.timeout, max_ttl_s),
                limits=limits,
                backend=chosen,
                allow_internet_access=bool(body.allow_internet_access),
                snapshot=snap,
                root=state_root,
            )
            sid, info = register(who, sbx, body.template_id, body.metadata or {}, body.env_vars or {})
        return JSONResponse(sandbox_json(sid, info), status_code=201)

    @app.post("/sandboxes")
    def create_v1(body: NewSandbox, who: str = Depends(client)) -> JSONResponse:
        return create(body, who)

    @app.post("/v2/sandboxes")
    def create_v2(body: NewSandbox, who: str = Depends(client)) -> JSONResponse:
        return create(body, who)

    def listing(who: str, state: str | None, metadata: str | None, after: str | None, template: str | None):
        """The client's sandboxes in the states asked (both by default), with every metadata pair asked,
        started at or after `after`, of the template asked (its id as created, or its name)."""
        wanted = set(state.split(",")) if state else {"running", "paused"}
        if unknown := sorted(wanted - {"running", "paused"}):
            raise SandboxError(f"state: {', '.join(unknown)} is not running or paused")
        pairs, since = e2b_listing.metadata_filter(metadata), e2b_listing.started_after(after)
        with reg.lock:
            adopt_own_api_sandboxes()
            mine = [(sid, i) for sid, i in infos.items() if i.owner == who]
        return [
            detail_json(sid, i)
            for sid, i in mine
            if ("paused" if i.paused else "running") in wanted
            and all(i.metadata.get(k) == v for k, v in pairs.items())
            and (since is None or i.started >= since)
            and (template is None or template in (i.template, i.template.partition("@")[0]))
        ]

    @app.get("/sandboxes")
    def list_v1(metadata: str | None = None, who: str = Depends(client)) -> list[dict]:
        return sorted(listing(who, None, metadata, None, None), key=lambda d: d["startedAt"])

    @app.get("/v2/sandboxes")
    def list_v2(
        response: Response,
        state: str | None = None,
        metadata: str | None = None,
        started_after: str | None = Query(None, alias="startedAfter"),
        template: str | None = None,
        order: str | None = None,
        limit: int = e2b_listing.MAX_LIMIT,
        next_token: str | None = Query(None, alias="nextToken"),
        who: str = Depends(client),
    ) -> list[dict]:
        if order not in (None, "asc", "desc"):
            raise SandboxError(f"order: {order!r} is not asc or desc")
        found = listing(who, state, metadata, started_after, template)
        return e2b_listing.page(
            found,
            lambda d: [d["startedAt"], d["sandboxID"]],
            limit,
            next_token,
            response.headers,
            order == "desc",
        )

    @app.get("/sandboxes/{sid}")
    def get(sid: str, who: str = Depends(client)) -> dict:
        return detail_json(sid, owned(sid, who))

    @app.delete("/sandboxes/{sid}", status_code=204)
    def kill(sid: str, who: str = Depends(client)) -> Response:
        info = owned(sid, who)
        with reg.lock:
            infos.pop(sid, None)
            reg.sandboxes.pop(sid, None)
            was_paused = reg.snapshots.pop(sid, None) is not None
        for w in info.entry.watchers.values():
            w.stop()
        if was_paused:
            snapshots.delete(snapshots.load(state_root, sid))
        else:
            info.entry.sandbox.kill()
        return Response(status_code=204)

    @app.post("/sandboxes/{sid}/timeout", status_code=204)
    def set_timeout(sid: str, body: TimeoutBody, info: Info = Depends(running)) -> Response:
        info.entry.sandbox.set_timeout(min(body.timeout, max_ttl_s))
        return Response(status_code=204)

    @app.get("/sandboxes/{sid}/metrics")
    def metrics(
        sid: str, start: int | None = None, end: int | None = None, info: Info = Depends(running)
    ) -> list[dict]:
        """One sample, taken now (k3 keeps no history): [] when [start, end] (Unix seconds) excludes now."""
        usage = info.entry.sandbox.usage()
        if (start is not None and usage.timestamp < start) or (end is not None and usage.timestamp > end):
            return []
        cpus = _whole_cpus(usage.cpu_count)
        return [
            {
                "timestamp": _iso(datetime.fromtimestamp(usage.timestamp, UTC)),
                "timestampUnix": int(usage.timestamp),
                "cpuCount": cpus,
                "cpuUsedPct": usage.cpu_used_pct * usage.cpu_count / cpus,  # of the whole CPUs, as E2B's
                "memUsed": usage.mem_used,
                "memCache": usage.mem_cache,
                "memTotal": usage.mem_total,
                "diskUsed": usage.disk_used,
                "diskTotal": usage.disk_total,
            }
        ]

    @app.post("/sandboxes/{sid}/refreshes", status_code=204)
    def refresh(sid: str, info: Info = Depends(running)) -> Response:
        return Response(status_code=204)

    @app.post("/sandboxes/{sid}/pause", status_code=204)
    def pause(sid: str, who: str = Depends(client)) -> Response:
        info = owned(sid, who)
        if info.paused:
            raise HTTPException(409, f"sandbox {sid} is already paused")
        for w in info.entry.watchers.values():
            w.stop()
        info.entry.watchers.clear()
        ends, info.pausing = info.entry.sandbox._deadline, True
        try:
            info.entry.sandbox.pause()  # on failure the sandbox stays as it was, and so does its entry
        finally:
            info.pausing = False
        with reg.lock:
            reg.sandboxes.pop(sid, None)
            reg.snapshots[sid] = who
            info.paused, info.ends = True, ends
        return Response(status_code=204)

    def resume(sid: str, timeout: int | None, who: str) -> JSONResponse:
        info = owned(sid, who)
        if not info.paused:
            if timeout:
                info.entry.sandbox.set_timeout(min(timeout, max_ttl_s))
            return JSONResponse(sandbox_json(sid, info), status_code=200)
        with admit(who):
            sbx = Sandbox.connect(sid, timeout=min(timeout or 300, max_ttl_s), root=state_root)
            with reg.lock:
                reg.snapshots.pop(sid, None)
                reg.sandboxes[sid] = (who, sbx)
                info.entry.sandbox, info.paused, info.ends = sbx, False, 0.0
        return JSONResponse(sandbox_json(sid, info), status_code=201)

    @app.post("/sandboxes/{sid}/resume")
    def resume_v1(sid: str, body: ConnectBody, who: str = Depends(client)) -> JSONResponse:
        return resume(sid, body.timeout, who)

    @app.post("/sandboxes/{sid}/connect")
    def connect_v1(sid: str, body: ConnectBody, who: str = Depends(client)) -> JSONResponse:
        return resume(sid, body.timeout, who)

    @app.post("/v2/sandboxes/{sid}/connect")
    def connect_v2(sid: str, body: ConnectBody, who: str = Depends(client)) -> JSONResponse:
        return resume(sid, body.timeout, who)

    made: dict[str, tuple[str, list[str]]] = {}  # snapshot id -> (its sandbox, its names), made through E2B

    @app.post("/sandboxes/{sid}/snapshots", status_code=201)
    def snapshot(sid: str, body: SnapshotBody, info: Info = Depends(running)) -> dict:
        snap = info.entry.sandbox.create_snapshot()
        with reg.lock:
            reg.snapshots[snap.id] = info.owner
            made[snap.id] = (sid, [body.name] if body.name else [])
        return {"snapshotID": snap.id, "names": made[snap.id][1]}

    @app.get("/snapshots")
    def list_snapshots(
        response: Response,
        sandbox_id: str | None = Query(None, alias="sandboxID"),
        name: str | None = None,
        limit: int = e2b_listing.MAX_LIMIT,
        next_token: str | None = Query(None, alias="nextToken"),
        who: str = Depends(client),
    ) -> list[dict]:
        """The client's snapshots (not its paused sandboxes), of one sandbox or by name or id if asked."""
        with reg.lock:  # (a paused sandbox is kept as a snapshot too, under its own id)
            mine = [
                (s, *made.get(s, ("", [])))
                for s, owner in reg.snapshots.items()
                if owner == who and s not in infos
            ]
        found = [
            {"snapshotID": s, "names": names}
            for s, source, names in mine
            if (sandbox_id is None or source == sandbox_id) and (name is None or name == s or name in names)
        ]
        return e2b_listing.page(found, lambda d: [d["snapshotID"]], limit, next_token, response.headers)

    @app.delete("/templates/{template_id}", status_code=204)
    def delete_snapshot(template_id: str, who: str = Depends(client)) -> Response:
        with reg.lock:
            if reg.snapshots.get(template_id) != who or template_id in infos:
                raise HTTPException(404, f"snapshot {template_id} not found")
            reg.snapshots.pop(template_id)
            made.pop(template_id, None)
        snapshots.delete(snapshots.load(state_root, template_id))
        return Response(status_code=204)

    @app.post("/sandboxes/{sid}/fork", status_code=201)
    def fork(sid: str, body: ForkBody, info: Info = Depends(running)) -> list[dict]:
        count = body.count or 1
        out = []
        with admit(info.owner, count):
            for child in info.entry.sandbox.fork(count):
                if isinstance(child, Exception):
                    out.append({"error": {"code": 500, "message": str(child)}})
                    continue
                if body.timeout:
                    child.set_timeout(min(body.timeout, max_ttl_s))
                cid, cinfo = register(info.owner, child, info.template, info.metadata, info.entry.envs)
                out.append({"sandbox": sandbox_json(cid, cinfo)})
        return out

    def lookup(sid: str, token: str) -> EnvdSandbox:
        with reg.lock:
            info = infos.get(sid)
        if info is None or info.paused or not hmac.compare_digest(token.encode(), info.token.encode()):
            raise ConnectError(Code.NOT_FOUND, f"sandbox {sid} not found")
        return info.entry

    app.include_router(envd_router(lookup))
    app.mount(
        "/k3",
        create_app(
            tokens,
            root=root,
            quota=quota,
            max_ttl_s=max_ttl_s,
            registry=reg,
            max_body_bytes=None,  # limited above
            ceiling=ceiling,
        ),
    )
    app.state.registry = reg
    connect = connect_apps(lookup)

    async def asgi(scope, receive, send) -> None:
        path = scope.get("path", "")
        for prefix, target in connect.items():
            if scope["type"] == "http" and path.startswith(prefix):
                return await target(scope, receive, send)
        return await app(scope, receive, send)

    asgi.fastapi = app  # for tests: the FastAPI part
    return asgi
