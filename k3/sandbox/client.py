"""`RemoteSandbox`: a thin client of `k3 sandbox serve` with the methods of `Sandbox` (create, connect,
commands.run, files.write/read/list/remove, create_snapshot, fork, pause, kill, context manager). Every
call has a hard deadline: the command's timeout plus `MARGIN_S`, or `CONTROL_TIMEOUT_S`."""

from __future__ import annotations

import httpx

from k3.sandbox.files import EntryInfo
from k3.sandbox.templates import WORKSPACE
from k3.sandbox.types import CommandResult, Limits, SandboxError, Snapshot, Usage

MARGIN_S = 30.0
CONTROL_TIMEOUT_S = 120.0


class Connection:
    """The server's address and this client's bearer token; one HTTP connection pool."""

    def __init__(self, base_url: str, token: str):
        self.http = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {token}"})

    def call(self, method: str, url: str, timeout: float = CONTROL_TIMEOUT_S, **kw) -> httpx.Response:
        try:
            r = self.http.request(method, url, timeout=timeout, **kw)
        except httpx.HTTPError as e:
            raise SandboxError(f"sandbox server: {method} {url}: {e}") from e
        if r.status_code >= 400:
            try:
                body = r.json()  # {"detail"} from k3's API; {"code", "message"} from E2B's, which serves it
            except ValueError:
                body = None
            detail = body.get("detail", body.get("message", r.text)) if isinstance(body, dict) else r.text
            raise SandboxError(
                f"sandbox server answered {r.status_code}: {detail}",
            ) from None
        return r


class _Commands:
    def __init__(self, sbx: RemoteSandbox):
        self._sbx = sbx

    def run(self, cmd: str, timeout: float = 30, cwd: str | None = None, envs: dict[str, str] | None = None,
            stdin: str | None = None) -> CommandResult:  # fmt: skip
        body = {"cmd": cmd, "timeout": timeout, "cwd": cwd, "envs": envs, "stdin": stdin}
        r = self._sbx._conn.call("POST", f"{self._sbx._url}/commands", timeout=timeout + MARGIN_S, json=body)
        return CommandResult(**r.json())


class _Files:
    def __init__(self, sbx: RemoteSandbox):
        self._sbx = sbx

    def write(self, path: str, data: str | bytes) -> None:
        raw = data.encode() if isinstance(data, str) else data
        self._sbx._conn.call("PUT", f"{self._sbx._url}/files", params={"path": path}, content=raw)

    def read(self, path: str, format: str = "text") -> str | bytes:
        r = self._sbx._conn.call("GET", f"{self._sbx._url}/files", params={"path": path})
        return r.content if format == "bytes" else r.content.decode(errors="replace")

    def list(self, path: str = WORKSPACE) -> list[EntryInfo]:
        r = self._sbx._conn.call("GET", f"{self._sbx._url}/list", params={"path": path})
        return [EntryInfo(**e) for e in r.json()]

    def remove(self, path: str) -> None:
        self._sbx._conn.call("DELETE", f"{self._sbx._url}/files", params={"path": path})


class RemoteSandbox:
    def __init__(self, conn: Connection, info: dict):
        self._conn = conn
        self.sandbox_id = info["sandbox_id"]
        self.backend = info.get("backend")
        self.template = info.get("template")
        self._url = f"/sandboxes/{self.sandbox_id}"
        self.commands = _Commands(self)
        self.files = _Files(self)

    @classmethod
    def create(cls, base_url: str, token: str, template: str = "python", timeout: float = 300,
               limits: Limits | None = None, backend: str = "gvisor", allow_internet_access: bool = False,
               snapshot: Snapshot | str | None = None) -> RemoteSandbox:  # fmt: skip
        conn = Connection(base_url, token)
        body = {
            "template": template,
            "timeout": timeout,
            "limits": limits.to_json() if limits else {},
            "backend": backend,
            "allow_internet_access": allow_internet_access,
            "snapshot_id": snapshot.id if isinstance(snapshot, Snapshot) else snapshot,
        }
        return cls(conn, conn.call("POST", "/sandboxes", json=body).json())

    @classmethod
    def connect(cls, sandbox_id: str, base_url: str, token: str) -> RemoteSandbox:
        conn = Connection(base_url, token)
        return cls(conn, conn.call("POST", f"/paused/{sandbox_id}/connect").json())

    @classmethod
    def delete_snapshot(cls, snapshot: Snapshot | str, base_url: str, token: str) -> None:
        snap_id = snapshot.id if isinstance(snapshot, Snapshot) else snapshot
        Connection(base_url, token).call("DELETE", f"/snapshots/{snap_id}")

    def create_snapshot(self) -> Snapshot:
        return Snapshot.from_json(self._conn.call("POST", f"{self._url}/snapshots").json())

    def fork(self, count: int, reseed: bool = False) -> list[RemoteSandbox | Exception]:
        r = self._conn.call("POST", f"{self._url}/fork", json={"count": count, "reseed": reseed})
        return [SandboxError(c["error"]) if "error" in c else RemoteSandbox(self._conn, c) for c in r.json()]

    def usage(self) -> Usage:
        return Usage(**self._conn.call("GET", f"{self._url}/usage").json())

    def pause(self) -> str:
        return self._conn.call("POST", f"{self._url}/pause").json()["sandbox_id"]

    def kill(self) -> None:
        self._conn.call("DELETE", self._url)

    def __enter__(self) -> RemoteSandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
