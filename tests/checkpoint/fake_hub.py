"""A local fake of the Hugging Face Hub's file API, for tests: two HTTP servers on 127.0.0.1.

* the Hub: `GET /api/models/ORG/REPO/revision/REV` (the revision API: id, sha, siblings),
  `GET /api/models/ORG/REPO/tree/REV` (sizes and LFS sha256s, one page) and
  `GET|HEAD /ORG/REPO/resolve/REV/FILE`. Small files (JSON, Python) are answered directly (200, ETag = a
  sha1 of the bytes); safetensors and tiktoken files with a 302 to the CDN, a signed query string in the
  Location, and `X-Repo-Commit`, `X-Linked-Size`, `X-Linked-Etag` (the sha256). Errors carry
  `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo) as the Hub's do. A repository
  with a `token` answers 401 without `Authorization: Bearer <token>` and 403 with another token.
* the CDN: checks the signature, answers `Range` with 206 + Content-Range, and logs every request's headers
  and the bytes it served.

Faults for the error tests: `hub.fault = "ignore-range" | "wrong-range" | "short" | "corrupt" | "move"`
(the CDN answers 200, a shifted range, half the range, or a flipped first byte; the Hub answers an
unexpected X-Repo-Commit); `hub.pace` (bytes per second) makes the CDN a slow link.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

_SECRET = b"cdn-secret"
_DIRECT = (".json", ".py", ".md", ".txt")
PACE_PIECE = 32 * 1024  # a paced CDN writes this much, then waits


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str
    branches: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    token: str | None = None  # gated: this bearer token is needed


def repo_from_folder(folder: Path, commit: str, token: str | None = None) -> Repo:
    files = {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}
    return Repo(files, commit, {"main": commit}, token)


def _signature(path: str, expires: str) -> str:
    return hmac.new(_SECRET, f"{path}:{expires}".encode(), hashlib.sha256).hexdigest()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        """Quiet about clients that hang up (the fault tests make them); report anything else."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class FakeHub:
    def __init__(self, repos: dict[str, Repo]):
        self.repos = repos
        self.fault: str | None = None
        self.hub_log: list[tuple[str, str, dict[str, str]]] = []  # (method, path, headers)
        self.cdn_log: list[tuple[str, str, dict[str, str]]] = []
        self.cdn_bytes = 0  # body bytes the CDN served
        self.pace: float | None = None  # the CDN's bytes per second (a slow link), None: as fast as it can
        self._lock = threading.Lock()
        self._hub = _Server(("127.0.0.1", 0), self._handler(self._hub_answer, self.hub_log))
        self._cdn = _Server(("127.0.0.1", 0), self._handler(self._cdn_answer, self.cdn_log, paced=True))
        self.endpoint = f"http://127.0.0.1:{self._hub.server_address[1]}"
        self.cdn = f"http://127.0.0.1:{self._cdn.server_address[1]}"
        for server in (self._hub, self._cdn):
            threading.Thread(target=server.serve_forever, daemon=True).start()

    def close(self) -> None:
        for server in (self._hub, self._cdn):
            server.shutdown()
            server.server_close()

    def __enter__(self) -> FakeHub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- HTTP plumbing -------------------------------------------------------------------------------------
    def _handler(self, answer, log, paced: bool = False):  # noqa: ANN001, ANN202
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            wbufsize = -1  # headers and body in one write (no 40 ms delayed-ACK stall per request)

            def log_message(self, *args: object) -> None:
                pass

            def _go(self) -> None:
                with hub._lock:
                    log.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
                status, headers, body = answer(self.command, self.path, self.headers)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    try:
                        self._write(body, hub.pace if paced else None)
                    except (BrokenPipeError, ConnectionResetError):  # the client gave up on a bad answer
                        self.close_connection = True

            def _write(self, body: bytes, pace: float | None) -> None:
                if pace is None:
                    self.wfile.write(body)
                    return
                for start in range(0, len(body), PACE_PIECE):
                    self.wfile.write(body[start : start + PACE_PIECE])
                    self.wfile.flush()
                    time.sleep(PACE_PIECE / pace)

            do_GET = do_HEAD = _go  # noqa: N815

        return Handler

    @staticmethod
    def _error(status: int, code: str, message: str = "") -> tuple[int, dict[str, str], bytes]:
        return (
            status,
            {"X-Error-Code": code, "X-Error-Message": message or code},
            json.dumps({"error": code}).encode(),
        )

    def _repo_and_commit(
        self, repo_id: str, rev: str, headers
    ) -> tuple[Repo | None, str | None, tuple | None]:  # noqa: ANN001
        repo = self.repos.get(repo_id)
        if repo is None:
            return None, None, self._error(404, "RepoNotFound")
        if repo.token is not None:
            auth = headers.get("Authorization")
            if auth is None:
                return None, None, self._error(401, "GatedRepo")
            if auth != f"Bearer {repo.token}":
                return None, None, self._error(403, "GatedRepo")
        commit = repo.branches.get(rev, rev if rev == repo.commit else None)
        if commit is None:
            return None, None, self._error(404, "RevisionNotFound")
        return repo, commit, None

    def _hub_answer(self, method: str, raw_path: str, headers) -> tuple[int, dict[str, str], bytes]:  # noqa: ANN001
        path = unquote(urlsplit(raw_path).path)
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "revision":
            repo, commit, err = self._repo_and_commit(f"{parts[2]}/{parts[3]}", "/".join(parts[5:]), headers)
            if err:
                return err
            info = {
                "id": f"{parts[2]}/{parts[3]}",
                "modelId": f"{parts[2]}/{parts[3]}",
                "sha": commit,
                "private": False,
                "siblings": [{"rfilename": name} for name in repo.files],
            }
            return 200, {"Content-Type": "application/json"}, json.dumps(info).encode()
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
            repo, commit, err = self._repo_and_commit(f"{parts[2]}/{parts[3]}", parts[5], headers)
            if err:
                return err
            tree = []
            for name, data in repo.files.items():
                entry = {
                    "type": "file",
                    "oid": hashlib.sha1(data).hexdigest(),
                    "size": len(data),
                    "path": name,
                }
                if not name.endswith(_DIRECT):
                    entry["lfs"] = {
                        "oid": hashlib.sha256(data).hexdigest(),
                        "size": len(data),
                        "pointerSize": 134,
                    }
                tree.append(entry)
            return 200, {"Content-Type": "application/json"}, json.dumps(tree).encode()
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, commit, err = self._repo_and_commit(f"{parts[0]}/{parts[1]}", parts[3], headers)
            if err:
                return err
            name = "/".join(parts[4:])
            if name not in repo.files:
                return self._error(404, "EntryNotFound")
            data = repo.files[name]
            answered = "0" * 40 if self.fault == "move" else commit
            common = {"X-Repo-Commit": answered, "Accept-Ranges": "bytes"}
            if name.endswith(_DIRECT):
                etag = f'"{hashlib.sha1(data).hexdigest()}"'
                return 200, {**common, "ETag": etag, "Content-Type": "application/octet-stream"}, data
            sha = hashlib.sha256(data).hexdigest()
            cdn_path = f"/xet-bridge/{parts[0]}--{parts[1]}/{sha}/{quote(name)}"
            expires = "4102444800"
            location = f"{self.cdn}{cdn_path}?Expires={expires}&Signature={_signature(cdn_path, expires)}"
            return (
                302,
                {
                    **common,
                    "Location": location,
                    "ETag": f'"{sha}"',
                    "X-Linked-Etag": f'"{sha}"',
                    "X-Linked-Size": str(len(data)),
                },
                b"",
            )
        return self._error(404, "RepoNotFound")

    def _cdn_answer(self, method: str, raw_path: str, headers) -> tuple[int, dict[str, str], bytes]:  # noqa: ANN001
        split = urlsplit(raw_path)
        query = parse_qs(split.query)
        expires, sig = query.get("Expires", [""])[0], query.get("Signature", [""])[0]
        if not hmac.compare_digest(sig, _signature(split.path, expires)):
            return 403, {}, b"bad signature"
        _, _, repo_key, sha, name = split.path.split("/", 4)
        repo = self.repos[repo_key.replace("--", "/", 1)]
        data = repo.files[unquote(name)]
        if hashlib.sha256(data).hexdigest() != sha:
            return 404, {}, b"no such object"
        size = len(data)
        wanted = headers.get("Range")
        if wanted is None or self.fault == "ignore-range":
            body, status, extra = data, 200, {}
        else:
            first, _, last = wanted.removeprefix("bytes=").partition("-")
            a, b = int(first), min(int(last) if last else size - 1, size - 1)
            if a >= size:
                return 416, {"Content-Range": f"bytes */{size}"}, b""
            if self.fault == "wrong-range":
                a, b = a + 1, b + 1 if b + 1 < size else b
            body, status, extra = data[a : b + 1], 206, {"Content-Range": f"bytes {a}-{b}/{size}"}
            if self.fault == "short":  # the range promised, half of it sent
                body = body[: len(body) // 2]
        if self.fault == "corrupt" and body:
            body = bytes([body[0] ^ 0xFF]) + body[1:]
        with self._lock:
            self.cdn_bytes += len(body) if method != "HEAD" else 0
        return status, {"Accept-Ranges": "bytes", "ETag": f'"{sha}"', **extra}, body
