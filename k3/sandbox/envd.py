"""The in-sandbox half of E2B's protocol ("envd"), served for every k3 sandbox by `k3 sandbox serve --e2b`:
the Connect services `process.Process` (start, connect, list, send / stream / close stdin, signal) and
`filesystem.Filesystem` (stat, make dir, move, list, remove, watch), through connect-python's own server
(`connectrpc`, the library the `e2b` SDK's generated clients are built on, with the SDK's message types),
and the HTTP routes `/files` (read, write) and `/health`. The SDK names the sandbox in the
`E2b-Sandbox-Id` header and proves it may use it with `X-Access-Token` (the envd access token the
control plane handed out when the sandbox was made): `lookup(sandbox_id, token)` checks both.

Every operation runs inside the sandbox as its user, through `Sandbox.commands` and `Sandbox.files`, so
the SDK sees what the sandbox's commands see. Not served: PTYs (`Process.Update`, `pty=`), users other than
the sandbox's one (`user="root"`), recursive watches of more than 8 levels, network mounts."""

from __future__ import annotations

import asyncio
import base64
import email.parser
import email.policy
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem import filesystem_pb as fs_pb
from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
from e2b.envd.process import process_pb as pr_pb
from e2b.envd.process.process_connect import ProcessASGIApplication
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from protobuf import Oneof
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp
from starlette.concurrency import run_in_threadpool

from k3.sandbox.files import EntryInfo, FileError
from k3.sandbox.process import Proc
from k3.sandbox.sandbox import Sandbox
from k3.sandbox.types import SandboxError

ENVD_VERSION = "0.6.4"  # the envd features the SDK may use: stdin, close_stdin, default user, octet uploads
FOLLOW_TICK_S = (0.005, 0.05)  # a stream polls its command's output this often (first, then at most)
WATCH_PERIOD_S = 0.2
FILE_TYPES = {"file": fs_pb.FileType.FILE, "dir": fs_pb.FileType.DIRECTORY, "symlink": fs_pb.FileType.SYMLINK}
FS_CODES = {  # errno name -> the Connect code envd answers with (the SDK maps them to its exceptions)
    "ENOENT": Code.NOT_FOUND,
    "EEXIST": Code.ALREADY_EXISTS,
    "EACCES": Code.PERMISSION_DENIED,
    "EROFS": Code.PERMISSION_DENIED,
    "ENOSPC": Code.RESOURCE_EXHAUSTED,
    "EISDIR": Code.INVALID_ARGUMENT,
    "ENOTDIR": Code.INVALID_ARGUMENT,
}
HTTP_CODES = {"ENOENT": 404, "EACCES": 403, "EROFS": 403, "ENOSPC": 507, "EISDIR": 400, "ENOTDIR": 400}
SANDBOX_USER = "user"
Lookup = Callable[[str, str], "EnvdSandbox"]


@dataclass
class EnvdSandbox:
    """What envd needs of one sandbox: the sandbox, the environment of its commands (E2B's `envs` at
    creation), its running watchers."""

    sandbox: Sandbox
    envs: dict[str, str] = field(default_factory=dict)
    watchers: dict[str, Watcher] = field(default_factory=dict)


def _sandbox_of(lookup: Lookup, headers) -> EnvdSandbox:
    return lookup(headers.get("e2b-sandbox-id", ""), headers.get("x-access-token", ""))


def _check_user(headers) -> None:
    """E2B names the user in `Authorization: Basic base64(user:)`; k3 sandboxes have one user."""
    auth = headers.get("authorization", "")
    if auth.lower().startswith("basic "):
        user = base64.b64decode(auth[6:] + "==").decode(errors="replace").partition(":")[0]
        if user and user != SANDBOX_USER:
            raise ConnectError(Code.PERMISSION_DENIED, f"k3 sandboxes run commands as {SANDBOX_USER!r} only")


def _fs_error(e: SandboxError) -> ConnectError:
    code = FS_CODES.get(e.code, Code.UNKNOWN) if isinstance(e, FileError) else Code.INVALID_ARGUMENT
    return ConnectError(code, str(e))


async def _call(fn, *args):
    try:
        return await run_in_threadpool(fn, *args)
    except FileError as e:
        raise _fs_error(e) from None
    except SandboxError as e:
        raise ConnectError(Code.FAILED_PRECONDITION, str(e)) from None


# -- processes --------------------------------------------------------------------------------------------
def _end_event(proc: Proc) -> pr_pb.ProcessEvent:
    out = proc.outcome
    status = f"exit status {out.exit_code}" if out.exit_code < 128 else f"signal: {out.exit_code - 128}"
    error = f"killed_by={out.stopped_by}" if out.stopped_by else None
    end = pr_pb.ProcessEvent.EndEvent(exit_code=out.exit_code, exited=True, status=status, error=error)
    return pr_pb.ProcessEvent(event=Oneof("end", end))


def _keepalive_s(ctx) -> float | None:
    """The interval of keepalive events the client asked for (envd's `Keepalive-Ping-Interval`)."""
    try:
        return float(ctx.request_headers.get("keepalive-ping-interval", "")) or None
    except ValueError:
        return None


async def _follow(proc: Proc, start: int, keepalive_s: float | None) -> AsyncIterator[pr_pb.ProcessEvent]:
    """The command's output events from index `start` on, then its end; a keepalive event whenever
    `keepalive_s` pass without one."""
    i, tick, last = start, FOLLOW_TICK_S[0], time.monotonic()
    while True:
        done = proc.done
        batch = proc.events[i:]
        for name, chunk in batch:
            data = pr_pb.ProcessEvent.DataEvent(output=Oneof(name, chunk))
            yield pr_pb.ProcessEvent(event=Oneof("data", data))
        i += len(batch)
        if done and i >= len(proc.events):
            yield _end_event(proc)
            return
        if batch:
            last = time.monotonic()
        elif keepalive_s and time.monotonic() - last >= keepalive_s:
            last = time.monotonic()
            yield pr_pb.ProcessEvent(event=Oneof("keepalive", pr_pb.ProcessEvent.KeepAlive()))
        tick = FOLLOW_TICK_S[0] if batch else min(FOLLOW_TICK_S[1], tick * 2)
        await asyncio.sleep(tick)


class ProcessService:
    def __init__(self, lookup: Lookup):
        self.lookup = lookup

    def _proc(self, ctx, selector: pr_pb.ProcessSelector | None) -> Proc:
        sbx = _sandbox_of(self.lookup, ctx.request_headers).sandbox
        sel = selector.selector if selector is not None else None
        procs = [p for p in sbx.commands.list() if p.tag != WATCH_TAG]
        if sel is not None and sel.field == "pid":
            found = [p for p in procs if p.pid == sel.value]
        elif sel is not None and sel.field == "tag":
            found = [p for p in procs if p.tag == sel.value]
        else:
            found = []
        if not found:
            raise ConnectError(Code.NOT_FOUND, "process not found")
        return found[0]

    async def list(self, request, ctx) -> pr_pb.ListResponse:
        sbx = _sandbox_of(self.lookup, ctx.request_headers).sandbox
        infos = []
        for p in sbx.commands.list():
            if p.tag == WATCH_TAG:
                continue
            cmd, *args = p.argv
            cfg = pr_pb.ProcessConfig(cmd=cmd, args=args, envs=p.envs, cwd=p.cwd)
            infos.append(pr_pb.ProcessInfo(config=cfg, pid=p.pid, tag=p.tag or None))
        return pr_pb.ListResponse(processes=infos)

    async def start(self, request: pr_pb.StartRequest, ctx) -> AsyncIterator[pr_pb.StartResponse]:
        headers = ctx.request_headers
        entry = _sandbox_of(self.lookup, headers)
        _check_user(headers)
        if request.pty is not None:
            raise ConnectError(Code.UNIMPLEMENTED, "k3 sandboxes have no PTYs")
        cfg = request.process
        timeout_ms = ctx.timeout_ms
        timeout = timeout_ms / 1000 if timeout_ms else entry.sandbox._remaining()
        keep_stdin = request.stdin if request.stdin is not None else True
        envs = {**entry.envs, **dict(cfg.envs)}
        proc = await _call(
            lambda: entry.sandbox.commands.start(
                [cfg.cmd, *cfg.args], timeout, cfg.cwd or None, envs, None, keep_stdin, tag=request.tag or ""
            )
        )
        yield pr_pb.StartResponse(
            event=pr_pb.ProcessEvent(event=Oneof("start", pr_pb.ProcessEvent.StartEvent(pid=proc.pid)))
        )
        async for ev in _follow(proc, 0, _keepalive_s(ctx)):
            yield pr_pb.StartResponse(event=ev)

    async def connect(self, request: pr_pb.ConnectRequest, ctx) -> AsyncIterator[pr_pb.ConnectResponse]:
        proc = self._proc(ctx, request.process)
        start = len(proc.events)  # like envd: what the command writes from now on
        yield pr_pb.ConnectResponse(
            event=pr_pb.ProcessEvent(event=Oneof("start", pr_pb.ProcessEvent.StartEvent(pid=proc.pid)))
        )
        async for ev in _follow(proc, start, _keepalive_s(ctx)):
            yield pr_pb.ConnectResponse(event=ev)

    async def update(self, request, ctx):
        raise ConnectError(Code.UNIMPLEMENTED, "k3 sandboxes have no PTYs to resize")

    async def send_input(self, request: pr_pb.SendInputRequest, ctx) -> pr_pb.SendInputResponse:
        proc = self._proc(ctx, request.process)
        inp = request.input.input if request.input is not None else None
        if inp is not None and inp.field == "pty":
            raise ConnectError(Code.UNIMPLEMENTED, "k3 sandboxes have no PTYs")
        if inp is not None:
            await run_in_threadpool(proc.write_stdin, inp.value)
        return pr_pb.SendInputResponse()

    async def stream_input(self, requests, ctx) -> pr_pb.StreamInputResponse:
        proc = None
        async for req in requests:
            ev = req.event
            if ev is None:
                continue
            if ev.field == "start":
                proc = self._proc(ctx, ev.value.process)
            elif ev.field == "data" and proc is not None and ev.value.input is not None:
                await run_in_threadpool(proc.write_stdin, ev.value.input.input.value)
        return pr_pb.StreamInputResponse()

    async def send_signal(self, request: pr_pb.SendSignalRequest, ctx) -> pr_pb.SendSignalResponse:
        proc = self._proc(ctx, request.process)
        sig = signal.SIGKILL if request.signal == pr_pb.Signal.SIGKILL else signal.SIGTERM
        sbx = _sandbox_of(self.lookup, ctx.request_headers).sandbox
        await _call(sbx.commands.signal, proc.pid, sig)
        return pr_pb.SendSignalResponse()

    async def close_stdin(self, request: pr_pb.CloseStdinRequest, ctx) -> pr_pb.CloseStdinResponse:
        proc = self._proc(ctx, request.process)
        await run_in_threadpool(proc.close_stdin)
        return pr_pb.CloseStdinResponse()


# -- the filesystem ---------------------------------------------------------------------------------------
def entry_pb(e: EntryInfo) -> fs_pb.EntryInfo:
    ts = Timestamp(seconds=int(e.mtime), nanos=int((e.mtime % 1) * 1e9))
    return fs_pb.EntryInfo(
        name=e.name,
        type=FILE_TYPES.get(e.type, fs_pb.FileType.UNSPECIFIED),
        path=e.path,
        size=e.size,
        mode=e.mode,
        permissions=_permissions(e),
        owner=e.owner,
        group=e.group,
        modified_time=ts,
        symlink_target=e.symlink_target,
        is_symlink=e.type == "symlink",
    )


def _permissions(e: EntryInfo) -> str:
    bits = "".join(c if e.mode & (1 << (8 - i)) else "-" for i, c in enumerate("rwxrwxrwx"))
    return {"dir": "d", "symlink": "l"}.get(e.type, "-") + bits


WATCH_TAG = "k3-envd-watch"
# One long-running command per watcher: it lists the directory every WATCH_PERIOD_S and prints the listing
# (type, size, mtime, path per line, then a line "\x01") first and whenever it changed.
WATCH_SCRIPT = r"""old=none
while :; do
  new=$(find "$1" -mindepth 1 -maxdepth "$2" -printf '%y\t%s\t%T@\t%p\n' 2>/dev/null)
  [ "$new" != "$old" ] && printf '%s\n\001\n' "$new"
  old=$new
  sleep "$3"
done"""


class Watcher:
    """A watched directory: a listing command in the sandbox and the events its listings differ by."""

    def __init__(self, sbx: Sandbox, path: str, recursive: bool):
        depth = "8" if recursive else "1"
        argv = ["/bin/sh", "-c", WATCH_SCRIPT, "k3-watch", path, depth, str(WATCH_PERIOD_S)]
        self.proc = sbx.commands.start(argv, timeout=max(1.0, sbx._remaining()), tag=WATCH_TAG)
        self.root = path.rstrip("/") or "/"
        self.events: list[fs_pb.FilesystemEvent] = []
        self._seen = 0
        self._buf = b""
        self._listing: dict[str, tuple[str, str]] | None = None

    def poll(self) -> list[fs_pb.FilesystemEvent]:
        """The events since the last poll."""
        new = self.proc.events[self._seen :]
        self._seen += len(new)
        self._buf += b"".join(chunk for name, chunk in new if name == "stdout")
        *listings, self._buf = self._buf.split(b"\x01\n")
        for raw in listings:
            listing = {}
            for line in raw.decode(errors="replace").splitlines():
                if line.count("\t") >= 3:
                    kind, size, mtime, path = line.split("\t", 3)
                    listing[path] = (size, mtime)
            if self._listing is not None:
                self._diff(self._listing, listing)
            self._listing = listing
        out, self.events = self.events, []
        return out

    def _diff(self, old: dict, new: dict) -> None:
        def event(path: str, kind) -> None:
            name = path[len(self.root) :].lstrip("/")
            self.events.append(fs_pb.FilesystemEvent(name=name, type=kind))

        for path in new.keys() - old.keys():
            event(path, fs_pb.EventType.CREATE)
        for path in new.keys() & old.keys():
            if new[path] != old[path]:
                event(path, fs_pb.EventType.WRITE)
        for path in old.keys() - new.keys():
            event(path, fs_pb.EventType.REMOVE)

    def ready(self) -> bool:
        return self._listing is not None or self.proc.done

    def stop(self) -> None:
        self.proc.stop()


class FilesystemService:
    def __init__(self, lookup: Lookup):
        self.lookup = lookup

    def _entry(self, ctx) -> EnvdSandbox:
        headers = ctx.request_headers
        _check_user(headers)
        return _sandbox_of(self.lookup, headers)

    async def stat(self, request, ctx) -> fs_pb.StatResponse:
        files = self._entry(ctx).sandbox.files
        return fs_pb.StatResponse(entry=entry_pb(await _call(files.stat, request.path)))

    async def make_dir(self, request, ctx) -> fs_pb.MakeDirResponse:
        files = self._entry(ctx).sandbox.files
        if not await _call(files.make_dir, request.path):
            raise ConnectError(Code.ALREADY_EXISTS, f"{request.path} already exists")
        return fs_pb.MakeDirResponse(entry=entry_pb(await _call(files.stat, request.path)))

    async def move(self, request, ctx) -> fs_pb.MoveResponse:
        files = self._entry(ctx).sandbox.files
        return fs_pb.MoveResponse(
            entry=entry_pb(await _call(files.rename, request.source, request.destination))
        )

    async def list_dir(self, request, ctx) -> fs_pb.ListDirResponse:
        files = self._entry(ctx).sandbox.files
        entries = await _call(files.list, request.path, max(1, request.depth))
        return fs_pb.ListDirResponse(entries=[entry_pb(e) for e in entries])

    async def remove(self, request, ctx) -> fs_pb.RemoveResponse:
        await _call(self._entry(ctx).sandbox.files.remove, request.path)
        return fs_pb.RemoveResponse()

    async def _watcher(self, entry: EnvdSandbox, path: str, recursive: bool) -> Watcher:
        info = await _call(entry.sandbox.files.stat, path)
        if info.type != "dir":
            raise ConnectError(Code.INVALID_ARGUMENT, f"{path} is not a directory")
        w = await _call(Watcher, entry.sandbox, info.path, recursive)
        deadline = time.monotonic() + 30
        while not w.ready() and time.monotonic() < deadline:  # its first listing is the baseline
            await asyncio.sleep(0.02)
            w.poll()
        return w

    async def watch_dir(self, request, ctx) -> AsyncIterator[fs_pb.WatchDirResponse]:
        entry = self._entry(ctx)
        w = await self._watcher(entry, request.path, request.recursive)
        try:
            yield fs_pb.WatchDirResponse(event=Oneof("start", fs_pb.WatchDirResponse.StartEvent()))
            while not w.proc.done:
                for ev in w.poll():
                    yield fs_pb.WatchDirResponse(event=Oneof("filesystem", ev))
                await asyncio.sleep(WATCH_PERIOD_S / 2)
        finally:
            w.stop()

    async def create_watcher(self, request, ctx) -> fs_pb.CreateWatcherResponse:
        entry = self._entry(ctx)
        w = await self._watcher(entry, request.path, request.recursive)
        wid = f"w{w.proc.pid}"
        entry.watchers[wid] = w
        return fs_pb.CreateWatcherResponse(watcher_id=wid)

    async def get_watcher_events(self, request, ctx) -> fs_pb.GetWatcherEventsResponse:
        w = self._entry(ctx).watchers.get(request.watcher_id)
        if w is None:
            raise ConnectError(Code.NOT_FOUND, f"watcher {request.watcher_id} not found")
        return fs_pb.GetWatcherEventsResponse(events=w.poll())

    async def remove_watcher(self, request, ctx) -> fs_pb.RemoveWatcherResponse:
        w = self._entry(ctx).watchers.pop(request.watcher_id, None)
        if w is not None:
            w.stop()
        return fs_pb.RemoveWatcherResponse()


# -- /files and /health -----------------------------------------------------------------------------------
def _http_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def _uploads(content_type: str, body: bytes, path: str | None) -> list[tuple[str, bytes]]:
    """(path, data) of each file in a multipart/form-data body (the SDK's default), or the raw body."""
    if not content_type.startswith("multipart/"):
        return [(path or "", body)]
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body
    )
    return [
        (part.get_filename() or path or "", part.get_payload(decode=True) or b"") for part in msg.iter_parts()
    ]


def envd_router(lookup: Lookup) -> APIRouter:
    router = APIRouter()

    def entry_of(request: Request) -> EnvdSandbox | JSONResponse:
        try:
            return _sandbox_of(lookup, request.headers)
        except ConnectError as e:  # as E2B's proxy answers for a sandbox it does not know
            return _http_error(502, f"The sandbox was not found: {e.message}")

    @router.get("/health")
    async def health(request: Request) -> Response:
        entry = entry_of(request)
        if isinstance(entry, JSONResponse):
            return entry
        return Response(status_code=204 if entry.sandbox.is_running() else 502)

    @router.get("/files")
    async def download(request: Request, path: str) -> Response:
        entry = entry_of(request)
        if isinstance(entry, JSONResponse):
            return entry
        try:
            data = await run_in_threadpool(entry.sandbox.files.read, path, "bytes")
        except FileError as e:
            return _http_error(HTTP_CODES.get(e.code, 500), str(e))
        except SandboxError as e:
            return _http_error(400, str(e))
        return Response(data, media_type="application/octet-stream")

    @router.post("/files")
    async def upload(request: Request, path: str | None = None) -> Response:
        entry = entry_of(request)
        if isinstance(entry, JSONResponse):
            return entry
        body = await request.body()
        written = []
        for dest, data in _uploads(request.headers.get("content-type", ""), body, path):
            try:
                await run_in_threadpool(entry.sandbox.files.write, dest, data)
                info = await run_in_threadpool(entry.sandbox.files.stat, dest)
            except FileError as e:
                return _http_error(HTTP_CODES.get(e.code, 500), str(e))
            except SandboxError as e:
                return _http_error(400, str(e))
            written.append({"name": info.name, "type": info.type, "path": info.path})
        return JSONResponse(written)

    return router


def connect_apps(lookup: Lookup) -> dict[str, object]:
    """The two Connect ASGI applications, by the path prefix they answer."""
    return {
        "/process.Process/": ProcessASGIApplication(ProcessService(lookup)),
        "/filesystem.Filesystem/": FilesystemASGIApplication(FilesystemService(lookup)),
    }
