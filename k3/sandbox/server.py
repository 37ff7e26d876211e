"""`k3 sandbox serve`: the sandbox API over HTTP (FastAPI) for rollout workers in other processes. Bound
to 127.0.0.1 by default; every request needs `Authorization: Bearer <token>`, and the token names the
client. A client sees only its own sandboxes (another client's id is 404, as if it did not exist), has a
quota of live sandboxes (429 beyond it), and its sandboxes end at their lifetime (capped by `max_ttl_s`)
or when the server stops."""

from __future__ import annotations

import hmac
import threading
from contextlib import asynccontextmanager
from dataclasses import asdict
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from k3.listen import BodyLimit
from k3.sandbox import snapshots
from k3.sandbox.sandbox import Sandbox, default_root
from k3.sandbox.types import Limits, SandboxError


class CreateBody(BaseModel):
    template: str = "python"
    timeout: float = 300
    limits: dict = Field(default_factory=dict)
    backend: str = "gvisor"
    allow_internet_access: bool = False
    snapshot_id: str | None = None


class RunBody(BaseModel):
    cmd: str
    timeout: float = 30
    cwd: str | None = None
    envs: dict[str, str] | None = None
    stdin: str | None = None


class ForkBody(BaseModel):
    count: int = 1
    reseed: bool = False


class Registry:
    """Which client owns which sandbox and snapshot; the one lock guards both tables."""

    def __init__(self, quota: int):
        self.quota = quota
        self.lock = threading.Lock()
        self.sandboxes: dict[str, tuple[str, Sandbox]] = {}
        self.snapshots: dict[str, str] = {}  # snapshot or paused-sandbox id -> client

    def live(self, client: str) -> int:
        return sum(1 for owner, s in self.sandboxes.values() if owner == client and s.live())

    def reap(self) -> None:
        """Forget sandboxes whose lifetime ended (their reaper has already removed them)."""
        with self.lock:
            entries = list(self.sandboxes.items())
        dead = {sid for sid, (_, s) in entries if not s.is_running()}  # asks the backends: not under the lock
        with self.lock:
            gone = [
                self.sandboxes.pop(sid)[1]
                for sid, entry in entries
                if sid in dead and self.sandboxes.get(sid) is entry
            ]
        for s in gone:
            s.kill()

    def close(self) -> None:
        with self.lock:
            all_ = [s for _, s in self.sandboxes.values()]
            self.sandboxes.clear()
        for s in all_:
            s.kill()


MAX_BODY_BYTES = 256 * 2**20  # the largest request body (a file upload), as a sandbox's default disk
# The most a client may ask for a sandbox (its `limits`); `k3 sandbox serve --max-limits` sets another.
CEILING = Limits(cpus=2, memory_mb=4096, pids=1024, disk_mb=4096, output_mb=64)


def create_app(tokens: dict[str, str], root: Path | None = None, quota: int = 8, max_ttl_s: float = 3600,
               reap_every_s: float = 5.0, registry: Registry | None = None,
               max_body_bytes: int | None = MAX_BODY_BYTES,
               ceiling: Limits = CEILING) -> FastAPI:  # fmt: skip
    """`tokens`: bearer token -> client name. `quota`: live sandboxes per client. `registry`: share the
    sandboxes and quotas of another server (the E2B one mounts this app; its lifespan then runs there). A
    request body (an upload) over `max_body_bytes` gets 413 unread (None: the app is mounted under one
    that limits them); limits asked over `ceiling`, 400."""
    if not tokens:
        raise SandboxError("the sandbox server needs at least one bearer token")
    reg = registry or Registry(quota)
    stop = threading.Event()

    def reaper() -> None:
        while not stop.wait(reap_every_s):
            reg.reap()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        thread = threading.Thread(target=reaper, name="sandbox-ttl", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            reg.close()  # no sandbox outlives the server

    app = FastAPI(title="k3 sandbox", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    if max_body_bytes is not None:  # errors as FastAPI's, {"detail": message}
        app.add_middleware(
            BodyLimit, max_bytes=max_body_bytes, error=lambda status, message: {"detail": message}
        )
    app.state.registry = reg

    @app.exception_handler(SandboxError)
    async def bad_input(request: Request, exc: SandboxError):
        return JSONResponse({"detail": str(exc)}, status_code=400)

    def client(request: Request) -> str:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        for known, name in tokens.items():
            if scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), known.encode()):
                return name
        raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    def owned(sid: str, who: str = Depends(client)) -> Sandbox:
        with reg.lock:
            entry = reg.sandboxes.get(sid)
        if entry is None or entry[0] != who:
            raise HTTPException(404, f"no sandbox {sid}")
        return entry[1]

    def register(who: str, sbx: Sandbox) -> dict:
        with reg.lock:
            reg.sandboxes[sbx.sandbox_id] = (who, sbx)
        return {"sandbox_id": sbx.sandbox_id, "backend": sbx.backend, "template": sbx.template}

    def admit(who: str) -> None:
        with reg.lock:
            if reg.live(who) >= reg.quota:
                raise HTTPException(429, f"client {who!r} already has {reg.quota} live sandboxes (its quota)")

    def own_snapshot(sid: str | None, who: str) -> None:
        if sid is not None and reg.snapshots.get(sid) != who:
            raise HTTPException(404, f"no snapshot {sid}")

    @app.post("/sandboxes")
    def create(body: CreateBody, who: str = Depends(client)) -> dict:
        limits = Limits.from_fields(body.limits) if body.limits else None
        over = (limits or Limits()).over(ceiling)
        if over:
            raise SandboxError(f"limits over this server's ceiling: {', '.join(over)}")
        admit(who)
        own_snapshot(body.snapshot_id, who)
        sbx = Sandbox.create(
            template=body.template,
            timeout=min(body.timeout, max_ttl_s),
            limits=limits,
            backend=body.backend,
            allow_internet_access=body.allow_internet_access,
            snapshot=body.snapshot_id,
            root=root,
        )
        return register(who, sbx)

    @app.get("/sandboxes")
    def listing(who: str = Depends(client)) -> list[str]:
        with reg.lock:
            return sorted(sid for sid, (owner, s) in reg.sandboxes.items() if owner == who)

    @app.post("/sandboxes/{sid}/commands")
    def run(body: RunBody, sbx: Sandbox = Depends(owned)) -> dict:
        return sbx.commands.run(body.cmd, body.timeout, body.cwd, body.envs, body.stdin).to_json()

    @app.put("/sandboxes/{sid}/files", status_code=204)
    async def write(path: str, request: Request, sbx: Sandbox = Depends(owned)) -> Response:
        await run_in_threadpool(sbx.files.write, path, await request.body())
        return Response(status_code=204)

    @app.get("/sandboxes/{sid}/files")
    def read(path: str, sbx: Sandbox = Depends(owned)) -> Response:
        return Response(sbx.files.read(path, format="bytes"), media_type="application/octet-stream")

    @app.get("/sandboxes/{sid}/list")
    def list_dir(path: str = "/home/user", sbx: Sandbox = Depends(owned)) -> list[dict]:
        return [asdict(e) for e in sbx.files.list(path)]

    @app.get("/sandboxes/{sid}/usage")
    def usage(sbx: Sandbox = Depends(owned)) -> dict:
        return asdict(sbx.usage())

    @app.delete("/sandboxes/{sid}/files", status_code=204)
    def remove(path: str, sbx: Sandbox = Depends(owned)) -> Response:
        sbx.files.remove(path)
        return Response(status_code=204)

    @app.post("/sandboxes/{sid}/snapshots")
    def snapshot(sbx: Sandbox = Depends(owned), who: str = Depends(client)) -> dict:
        snap = sbx.create_snapshot()
        with reg.lock:
            reg.snapshots[snap.id] = who
        return snap.to_json()

    @app.post("/sandboxes/{sid}/fork")
    def fork(body: ForkBody, sbx: Sandbox = Depends(owned), who: str = Depends(client)) -> list[dict]:
        with reg.lock:
            room = reg.quota - reg.live(who)
        if body.count > room:
            raise HTTPException(429, f"forking {body.count} would pass client {who!r}'s quota of {reg.quota}")
        out = []
        for child in sbx.fork(body.count, body.reseed):
            out.append({"error": str(child)} if isinstance(child, Exception) else register(who, child))
        return out

    @app.post("/sandboxes/{sid}/pause")
    def pause(sid: str, sbx: Sandbox = Depends(owned), who: str = Depends(client)) -> dict:
        with reg.lock:
            reg.sandboxes.pop(sid, None)
            reg.snapshots[sid] = who
        return {"sandbox_id": sbx.pause()}

    @app.post("/paused/{sid}/connect")
    def connect(sid: str, who: str = Depends(client)) -> dict:
        own_snapshot(sid, who)
        admit(who)
        sbx = Sandbox.connect(sid, timeout=max_ttl_s, root=root)
        with reg.lock:
            reg.snapshots.pop(sid, None)
        return register(who, sbx)

    @app.delete("/sandboxes/{sid}", status_code=204)
    def kill(sid: str, sbx: Sandbox = Depends(owned)) -> Response:
        with reg.lock:
            reg.sandboxes.pop(sid, None)
        sbx.kill()
        return Response(status_code=204)

    @app.delete("/snapshots/{snap_id}", status_code=204)
    def delete_snapshot(snap_id: str, who: str = Depends(client)) -> Response:
        own_snapshot(snap_id, who)
        snapshots.delete(snapshots.load(root or default_root(), snap_id))
        with reg.lock:
            reg.snapshots.pop(snap_id, None)
        return Response(status_code=204)

    return app
