"""The official `e2b` SDK (unchanged, pointed at the server by the `export E2B_...` lines it prints) against
`k3 sandbox serve --e2b`, a real server process: the sandbox lifecycle on both backends, a wrong key,
another key's sandbox, quotas, and 16 concurrent clients without cross-talk."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from e2b import (  # the official SDK, unchanged
    AuthenticationException,
    CommandExitException,
    RateLimitException,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxQuery,
    SandboxState,
)
from sandbox_testing import require

from k3.sandbox import SandboxError
from k3.sandbox.client import RemoteSandbox

QUOTA = 17  # carol runs 16 clients at once, then one more fits, then the next gets 429
KEYS = {"alice-key-0123456789": "alice", "bob-key-0123456789": "bob", "carol-key-0123456789": "carol"}
ALICE, BOB, CAROL = KEYS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(root, tmp_path_factory):
    """`k3 sandbox serve --e2b` in its own process; its printed exports set in this process's environment."""
    for backend in ("bwrap", "gvisor"):
        require(backend)
    tokens = tmp_path_factory.mktemp("e2b") / "tokens.json"
    tokens.write_text(json.dumps(KEYS))
    port = _free_port()
    env = {**os.environ, "K3_SANDBOX_ROOT": str(root), "PYTHONPATH": str(Path(__file__).parents[2])}
    argv = [sys.executable, "-m", "k3", "sandbox", "serve", "--e2b", "--port", str(port)]
    argv += ["--tokens", str(tokens), "--quota", str(QUOTA), "--backend", "gvisor", "--max-upload-mb", "1"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    saved = dict(os.environ)
    try:
        exports = [proc.stdout.readline().strip() for _ in range(4)]
        assert all(line.startswith("export E2B_") for line in exports), exports  # nothing before them
        for line in exports:
            key, _, value = line.removeprefix("export ").partition("=")
            os.environ[key] = value
        assert os.environ["E2B_API_KEY"] == ALICE and os.environ["E2B_API_URL"].endswith(f":{port}")
        for _ in range(200):
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        yield os.environ["E2B_API_URL"]
    finally:
        os.environ.clear()
        os.environ.update(saved)
        proc.terminate()
        proc.wait(60)


@pytest.mark.parametrize("backend", ["bwrap", "gvisor"])
def test_sdk_drives_a_sandbox(server, backend):
    sbx = Sandbox.create(
        template=f"base@{backend}", timeout=120, metadata={"run": "t1"}, envs={"GREETING": "hi"}
    )
    try:
        # run, streaming: lines arrive one by one, before the command ends
        seen = []
        r = sbx.commands.run(
            "echo $GREETING; for i in 1 2 3; do echo $i; sleep 0.2; done; echo oops >&2",
            on_stdout=lambda line: seen.append((time.monotonic(), line)),
        )
        assert (r.stdout, r.stderr, r.exit_code) == ("hi\n1\n2\n3\n", "oops\n", 0)
        assert "".join(chunk for _, chunk in seen) == r.stdout and len(seen) >= 3
        assert seen[-1][0] - seen[0][0] > 0.3  # streamed as it came, not delivered at the end
        with pytest.raises(CommandExitException) as e:
            sbx.commands.run("exit 7")
        assert e.value.exit_code == 7
        # stdin
        h = sbx.commands.run("cat; echo done", background=True, stdin=True)
        sbx.commands.send_stdin(h.pid, "to stdin\n")
        sbx.commands.close_stdin(h.pid)
        assert h.wait().stdout == "to stdin\ndone\n"
        # background + kill
        bg = sbx.commands.run("sleep 60", background=True)
        assert bg.pid in [p.pid for p in sbx.commands.list()]
        assert sbx.commands.kill(bg.pid)
        with pytest.raises(CommandExitException):
            bg.wait()
        assert bg.pid not in [p.pid for p in sbx.commands.list()]
        # files both ways, in the workspace and /tmp; a read-only path fails
        sbx.files.write("/tmp/a.txt", "via the API")
        sbx.files.write("notes/b.txt", b"\x00\x01binary")
        assert sbx.commands.run("cat /tmp/a.txt; wc -c < notes/b.txt").stdout == "via the API8\n"
        sbx.commands.run("echo from-cmd > /tmp/c.txt")
        assert sbx.files.read("/tmp/c.txt") == "from-cmd\n"
        assert sbx.files.read("notes/b.txt", format="bytes") == b"\x00\x01binary"
        assert {"a.txt", "c.txt"} <= {e.name for e in sbx.files.list("/tmp")}
        sbx.files.remove("/tmp/a.txt")
        assert not sbx.files.exists("/tmp/a.txt")
        with pytest.raises(SandboxException):
            sbx.files.write("/usr/k3-nope", "x")
        # watch a directory
        handle = sbx.files.watch_dir("/home/user")
        sbx.files.write("/home/user/watched.txt", "w")
        events = []
        for _ in range(50):
            events += handle.get_new_events()
            if any(ev.name == "watched.txt" for ev in events):
                break
            time.sleep(0.1)
        handle.stop()
        assert ("watched.txt", "create") in {(ev.name, ev.type.value) for ev in events}, events
        # timeout, info, listing
        sbx.set_timeout(90)
        info = sbx.get_info()
        assert info.metadata == {"run": "t1"} and 80 < (info.end_at.timestamp() - time.time()) <= 91
        assert sbx.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()]
        # pause and resume: the files survive (gVisor: running processes too)
        sbx.files.write("/home/user/kept.txt", "kept")
        if backend == "gvisor":
            sbx.commands.run("nohup sleep 300 > /dev/null 2>&1 &")
        sbx.pause()
        assert Sandbox.get_info(sbx.sandbox_id).state.value == "paused"
        resumed = Sandbox.connect(sbx.sandbox_id, timeout=60)
        assert resumed.files.read("kept.txt") == "kept"
        if backend == "gvisor":
            assert "sleep 300" in resumed.commands.run("ps -e -o args=").stdout
        sbx = resumed
    finally:
        sbx.kill()
    assert not sbx.is_running()
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(sbx.sandbox_id)


OVER = "413: the request body is over this server's limit of 1,048,576 bytes"  # --max-upload-mb 1


def test_an_upload_over_the_servers_limit_is_refused_and_the_sandbox_serves_on(server):
    """`--max-upload-mb 1`: a 2 MiB file, or a 2 MiB request to the REST API, is a 413 before the server
    holds it, which the SDK reads as E2B's error (it had shown a body in OpenAI's shape); 0.9 MiB is
    written."""
    sbx = Sandbox.create(template="base@bwrap", timeout=60)
    try:
        with pytest.raises(SandboxException) as refused:
            sbx.files.write("big.bin", b"x" * 2**21)
        assert str(refused.value) == OVER
        with pytest.raises(SandboxException) as refused:
            Sandbox.create(template="base@bwrap", envs={"BIG": "x" * 2**21})
        assert str(refused.value) == OVER
        sbx.files.write("fits.bin", b"y" * 900_000)
        assert sbx.commands.run("wc -c < fits.bin; ls big.bin 2>&1 | wc -l").stdout == "900000\n1\n"
    finally:
        sbx.kill()


def test_k3s_own_api_beside_e2bs(server):
    """Under --e2b, k3's own API (`RemoteSandbox`) is served at /k3 with the same keys and sandboxes: a
    sandbox it makes is the SDK's to drive and end (it had been unknown to E2B's API), other keys find
    neither, and its uploads have the same limit."""
    own = RemoteSandbox.create(server + "/k3", ALICE, template="coreutils", backend="bwrap", timeout=60)
    try:
        own.files.write("made.txt", "by k3's API")
        assert Sandbox.connect(own.sandbox_id).files.read("made.txt") == "by k3's API"
        assert own.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()]
        assert own.sandbox_id not in [s.sandbox_id for s in Sandbox.list(api_key=BOB).next_items()]
        with pytest.raises(SandboxError) as refused:
            own.files.write("big.bin", b"x" * 2**21)
        assert str(refused.value) == "sandbox server answered " + OVER
        assert own.commands.run("ls").stdout == "made.txt\n"
        assert Sandbox.kill(own.sandbox_id)  # the SDK's to end too
        with pytest.raises(SandboxError, match="404"):
            own.commands.run("true")
    finally:
        Sandbox.kill(own.sandbox_id)


def test_snapshot_is_a_template(server):
    sbx = Sandbox.create(template="base@bwrap", timeout=60)
    try:
        sbx.files.write("state.txt", "snapshotted")
        snap = sbx.create_snapshot()
        child = Sandbox.create(template=snap.snapshot_id, timeout=60)
        assert child.files.read("state.txt") == "snapshotted"
        child.kill()
        assert Sandbox.delete_snapshot(snap.snapshot_id)
    finally:
        sbx.kill()


def test_metrics_and_errors_in_e2bs_shape(server):
    """`get_metrics`: one sample of now, seeing a file a command wrote (tests/sandbox/test_usage.py holds
    the sample to planted memory and CPU); another key's sandbox is not found; a path no route serves and a
    malformed body come back as E2B's {"code", "message"}, which the SDK reads (it had raised KeyError)."""
    sbx = Sandbox.create(template="base@bwrap", timeout=60)
    try:
        sbx.commands.run("head -c 4194304 /dev/zero > four.bin")
        [sample] = sbx.get_metrics()
        assert 4 << 20 <= sample.disk_used <= sample.disk_total
        assert 0 < sample.mem_used < sample.mem_total and sample.cpu_count >= 1
        assert abs(sample.timestamp.timestamp() - time.time()) < 30
        assert sbx.get_metrics(end=sample.timestamp.replace(year=2000)) == []
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_metrics(sbx.sandbox_id, api_key=BOB)
        for method, path, body, status in (
            ("GET", f"/sandboxes/{sbx.sandbox_id}/no-such-thing", None, 404),
            ("POST", "/sandboxes", {"templateID": "base@bwrap", "timeout": "long"}, 400),
        ):
            r = httpx.request(method, server + path, json=body, headers={"X-API-KEY": ALICE})
            assert r.status_code == status and set(r.json()) == {"code", "message"}, r.text
            assert r.json()["code"] == status
    finally:
        sbx.kill()


def test_list_filters_and_pages_as_the_sdk_asks(server):
    """`Sandbox.list` with a query (metadata, start time, template, state), an order and pages of `limit`,
    and `Sandbox.list_snapshots` by source sandbox and name: each answers exactly what it asks (the metadata
    filter had been ignored: every sandbox of the key came back; list_snapshots was a 404)."""
    tag = uuid.uuid4().hex  # this run's sandboxes only, whatever else the key has
    made = []
    try:
        for i in range(3):
            meta = {"run": tag, "i": str(i), "who": "a&b=c d"}  # characters the query must quote
            made.append(Sandbox.create(template="base@bwrap", timeout=60, metadata=meta))
        ids = [s.sandbox_id for s in made]

        def listed(query=None, **kw) -> list[str]:
            return [s.sandbox_id for s in Sandbox.list(query=query, **kw).next_items()]

        mine = SandboxQuery(metadata={"run": tag, "who": "a&b=c d"})
        pages = Sandbox.list(query=mine, limit=2)
        first = [s.sandbox_id for s in pages.next_items()]
        assert pages.has_next and len(first) == 2
        assert first + [s.sandbox_id for s in pages.next_items()] == ids and not pages.has_next  # by start
        assert listed(mine, order="desc") == ids[::-1]
        assert listed(SandboxQuery(metadata={"run": tag, "i": "1"})) == [ids[1]]
        started = Sandbox.get_info(ids[1]).started_at
        assert listed(SandboxQuery(metadata={"run": tag}, started_after=started)) == ids[1:]
        assert listed(SandboxQuery(metadata={"run": tag}, template="base")) == ids
        assert listed(SandboxQuery(metadata={"run": tag}, template="python")) == []
        assert listed(SandboxQuery(metadata={"run": tag}, state=[SandboxState.PAUSED])) == []
        assert listed(mine, api_key=BOB) == []
        for bad in ({"limit": 0}, {"nextToken": "not-a-token"}, {"state": "sleeping"}, {"order": "up"}):
            r = httpx.get(server + "/v2/sandboxes", params=bad, headers={"X-API-KEY": ALICE})
            assert r.status_code == 400 and r.json()["code"] == 400, r.text

        snap = made[0].create_snapshot(name="before")
        assert [s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=ids[0]).next_items()] == [
            snap.snapshot_id
        ]
        assert Sandbox.list_snapshots(sandbox_id=ids[1]).next_items() == []
        assert [s.names for s in Sandbox.list_snapshots(name="before").next_items()] == [["before"]]
        assert snap.snapshot_id not in [
            s.snapshot_id for s in Sandbox.list_snapshots(api_key=BOB).next_items()
        ]
        assert Sandbox.delete_snapshot(snap.snapshot_id)
        assert Sandbox.list_snapshots(sandbox_id=ids[0]).next_items() == []
    finally:
        for s in made:
            s.kill()


def test_wrong_key_and_other_keys_sandboxes(server):
    with pytest.raises(AuthenticationException):
        Sandbox.create(template="base@bwrap", api_key="not-a-key")
    mine = Sandbox.create(template="base@bwrap", timeout=60)
    try:
        with pytest.raises(SandboxNotFoundException):
            Sandbox.connect(mine.sandbox_id, api_key=BOB)
        assert not Sandbox.kill(mine.sandbox_id, api_key=BOB)
        assert mine.sandbox_id not in [s.sandbox_id for s in Sandbox.list(api_key=BOB).next_items()]
        assert mine.commands.run("echo still mine").stdout == "still mine\n"
    finally:
        mine.kill()


@pytest.mark.parametrize("backend", ["bwrap", pytest.param("gvisor", marks=pytest.mark.slow)])
def test_sixteen_concurrent_clients_then_the_quota(server, backend):
    barrier = threading.Barrier(16)

    def client(i: int) -> tuple[str, str, str]:
        barrier.wait(60)
        sbx = Sandbox.create(template=f"base@{backend}", timeout=120, api_key=CAROL, envs={"ME": str(i)})
        sbx.files.write("/tmp/me.txt", f"client {i}")
        out = sbx.commands.run("echo $ME; cat /tmp/me.txt; ls /tmp").stdout
        return sbx.sandbox_id, out, sbx.files.read("/tmp/me.txt")

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(client, range(16)))
    try:
        assert len({sid for sid, _, _ in results}) == 16
        for i, (_, out, read) in enumerate(results):
            assert out == f"{i}\nclient {i}me.txt\n" and read == f"client {i}", (i, out)
        extra = Sandbox.create(template="base@bwrap", timeout=60, api_key=CAROL)  # the 17th fits
        with pytest.raises(RateLimitException):
            Sandbox.create(template="base@bwrap", timeout=60, api_key=CAROL)
        extra.kill()
    finally:
        for sid, _, _ in results:
            Sandbox.kill(sid, api_key=CAROL)


def test_process_streams_keep_alive_while_silent():
    """envd sends keepalive events at the interval the SDK asks for (`Keepalive-Ping-Interval`) while a
    command is silent, so proxies and idle timeouts do not cut a long quiet command."""
    import asyncio

    from k3.sandbox.envd import _follow
    from k3.sandbox.process import Outcome

    class Quiet:  # a command that prints once after 0.35 s, then ends
        events: list = []
        done, outcome = False, None

    async def drive() -> list[str]:
        async def later() -> None:
            await asyncio.sleep(0.35)
            Quiet.events.append(("stdout", b"x"))
            await asyncio.sleep(0.05)
            Quiet.outcome, Quiet.done = Outcome(b"x", b"", 0, 0.4, None), True

        task = asyncio.create_task(later())
        kinds = [ev.event.field async for ev in _follow(Quiet, 0, 0.1)]
        await task
        return kinds

    kinds = asyncio.run(drive())
    assert kinds[-2:] == ["data", "end"] and 2 <= kinds.count("keepalive") <= 4, kinds
