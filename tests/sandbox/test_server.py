"""The sandbox server over real HTTP (uvicorn on 127.0.0.1): tokens, ownership, quotas, 16 concurrent
clients with no cross-talk, and nothing left after shutdown. Sandboxes are bubblewrap (fast to start)."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import uvicorn
from sandbox_testing import leftovers, require

from k3.sandbox.client import RemoteSandbox
from k3.sandbox.server import create_app
from k3.sandbox.types import Limits, SandboxError

CLIENTS = 16
TOKENS = {f"token-{i:02d}-{'x' * 24}": f"client-{i:02d}" for i in range(CLIENTS)}
TOKEN = list(TOKENS)


@pytest.fixture(scope="module")
def server(root):
    require("bwrap")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(TOKENS, root=root, quota=2, reap_every_s=0.5)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", app
    srv.should_exit = True
    thread.join(timeout=30)


def make(url: str, i: int, **kw) -> RemoteSandbox:
    return RemoteSandbox.create(url, TOKEN[i], backend="bwrap", **kw)


def test_no_or_wrong_token_is_401(server):
    url, _ = server
    assert httpx.post(f"{url}/sandboxes", json={}).status_code == 401
    assert httpx.get(f"{url}/sandboxes", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(f"{url}/sandboxes", headers={"Authorization": TOKEN[0]}).status_code == 401
    assert httpx.get(f"{url}/openapi.json").status_code == 404  # nothing is served without a token


def test_limits_over_the_servers_ceiling_or_unknown_are_400_and_cost_no_quota(server):
    url, _ = server
    auth = {"Authorization": f"Bearer {TOKEN[4]}"}
    for limits, says in (
        ({"memory_mb": 8192}, "memory_mb 8192 > 4096"),
        ({"cpus": 3, "disk_mb": 5000}, "cpus 3 > 2, disk_mb 5000 > 4096"),
        ({"memroy_mb": 64}, "no such limit memroy_mb"),
        ({"pids": 2}, "pids must be an integer >= 4"),
    ):
        r = httpx.post(f"{url}/sandboxes", headers=auth, json={"backend": "bwrap", "limits": limits})
        assert r.status_code == 400 and says in r.json()["detail"], (limits, r.text)
    with make(url, 4, limits=Limits(memory_mb=4096, disk_mb=64)) as a, make(url, 4) as b:  # the quota: 2
        assert (
            a.commands.run("true", timeout=20).exit_code == b.commands.run("true", timeout=20).exit_code == 0
        )


def test_another_clients_sandbox_is_404(server):
    url, _ = server
    with make(url, 0) as mine:
        other = {"Authorization": f"Bearer {TOKEN[1]}"}
        for method, path in (
            ("POST", "/commands"),
            ("GET", "/files?path=a"),
            ("GET", "/usage"),
            ("DELETE", ""),
        ):
            r = httpx.request(
                method, f"{url}/sandboxes/{mine.sandbox_id}{path}", headers=other, json={"cmd": "id"}
            )
            assert r.status_code == 404, (method, path, r.text)
        assert mine.commands.run("echo still-mine", timeout=20).stdout == "still-mine\n"
        mine.commands.run("head -c 3145728 /dev/zero > three.bin", timeout=20)  # its usage, over HTTP
        usage = mine.usage()
        assert 3 << 20 <= usage.disk_used < 4 << 20 and usage.disk_total == Limits().disk_mb << 20
        assert usage.mem_total == Limits().memory_mb << 20 and usage.cpu_count == Limits().cpus


def test_quota_is_429(server):
    url, _ = server
    a, b = make(url, 2), make(url, 2)
    try:
        with pytest.raises(SandboxError, match="429"):
            make(url, 2)
        with make(url, 3) as other_client:  # quotas are per client
            assert other_client.commands.run("true", timeout=20).exit_code == 0
    finally:
        a.kill()
        b.kill()
    with make(url, 2) as again:  # killed sandboxes free the quota
        assert again.sandbox_id


def test_sixteen_concurrent_clients_without_cross_talk(server):
    url, _ = server

    def one(i: int) -> tuple[str, str, str, list[str]]:
        with make(url, i) as sbx:
            sbx.files.write("me.txt", f"client {i}")
            r = sbx.commands.run(f"cat me.txt; echo ' +' {i}; ls", timeout=30, stdin=None)
            return sbx.sandbox_id, r.stdout, sbx.files.read("me.txt"), [e.name for e in sbx.files.list()]

    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(one, range(CLIENTS)))
    assert len({sid for sid, *_ in results}) == CLIENTS
    for i, (_, out, content, names) in enumerate(results):
        assert out == f"client {i} + {i}\nme.txt\n" and content == f"client {i}" and names == ["me.txt"]


def test_ttl_reaps_and_shutdown_removes_everything(root):
    require("bwrap")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(TOKENS, root=root, quota=4, reap_every_s=0.2)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    short = make(url, 5, timeout=1)
    kept = [make(url, 5), make(url, 6)]
    time.sleep(2.5)  # past the short one's lifetime and its reaper's grace
    with pytest.raises(SandboxError, match="404"):
        short.commands.run("true", timeout=5)
    assert leftovers(root, short.sandbox_id) == []
    assert kept[0].commands.run("echo up", timeout=20).stdout == "up\n"
    srv.should_exit = True
    thread.join(timeout=30)
    assert [leftovers(root, k.sandbox_id) for k in kept] == [[], []]


def test_snapshot_fork_pause_connect_over_http(server):
    url, _ = server
    with make(url, 7) as sbx:
        sbx.files.write("state.txt", "parent")
        snap = sbx.create_snapshot()
        assert snap.kind == "fs"
        with pytest.raises(SandboxError, match="404"):  # a snapshot id is private to its client too
            make(url, 8, snapshot=snap.id)
        kids = sbx.fork(1)
        assert [k.files.read("state.txt") for k in kids] == ["parent"]
        kids[0].files.write("state.txt", "child")
        assert sbx.files.read("state.txt") == "parent"
        kids[0].kill()
        with make(url, 7, snapshot=snap.id) as restored:
            assert restored.files.read("state.txt") == "parent"
        with pytest.raises(SandboxError, match="404"):
            RemoteSandbox.delete_snapshot(snap, url, TOKEN[8])
        RemoteSandbox.delete_snapshot(snap, url, TOKEN[7])
        with pytest.raises(SandboxError, match="404"):
            make(url, 7, snapshot=snap.id)
        assert not Path(snap.path).exists()
    paused = make(url, 9)
    paused.files.write("kept.txt", "across pause")
    sid = paused.pause()
    with pytest.raises(SandboxError, match="404"):
        RemoteSandbox.connect(sid, url, TOKEN[10])  # not that client's
    with RemoteSandbox.connect(sid, url, TOKEN[9]) as again:
        assert again.sandbox_id == sid and again.files.read("kept.txt") == "across pause"


def test_a_body_over_the_limit_is_413_in_the_apis_error_shape(root):
    """An upload over `max_body_bytes` is refused unread with k3's API's error shape, {"detail"}, which
    RemoteSandbox reads (BodyLimit's default is OpenAI's)."""
    from fastapi.testclient import TestClient

    app = create_app(TOKENS, root=root, max_body_bytes=1000)
    auth = {"Authorization": f"Bearer {TOKEN[0]}"}
    r = TestClient(app).put("/sandboxes/sbx-0/files", params={"path": "a"}, content=b"x" * 1001, headers=auth)
    assert r.status_code == 413
    assert r.json() == {"detail": "the request body is over this server's limit of 1,000 bytes"}
