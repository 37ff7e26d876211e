"""Where k3's servers listen (k3.listen): a port that is not one or is taken is a one-line error before
anything slow happens; `k3 atlas demo` moves to the next free port; the URL printed is the one bound."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from k3.cli import app
from k3.listen import BodyLimit, ListenError, listening_socket, only_this_machine, run_app, url_of

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def taken():
    """A port some other program listens on."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


def test_a_port_out_of_range_is_one_line():
    r = CliRunner().invoke(app, ["serve", "no-such-checkpoint", "--port", "99999"])
    assert r.exit_code == 1 and r.output.strip().splitlines() == [
        "error: --port 99999: a port is a number in 0..65535 (0: any free one)"
    ], r.output


@pytest.mark.parametrize("command", [["serve", "no-such-checkpoint"], ["atlas", "serve", "tiny"]])
def test_a_taken_port_is_said_before_anything_is_loaded(command, taken):
    r = CliRunner().invoke(app, [*command, "--port", str(taken)])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and f"port {taken} on 127.0.0.1 is taken" in lines[0], (
        r.output
    )


def test_tries_move_to_the_next_free_port(taken):
    with listening_socket("127.0.0.1", taken, tries=20) as sock:
        assert sock.getsockname()[1] != taken
        assert url_of(sock) == f"http://127.0.0.1:{sock.getsockname()[1]}/"
    with pytest.raises(ListenError, match="is taken"):
        listening_socket("127.0.0.1", taken)


def test_the_printed_url_is_the_one_serving(tmp_path):
    """`k3 sandbox serve --port 0`: uvicorn serves on the socket bound first, at the URL printed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "K3_SANDBOX_ROOT": str(tmp_path)}
    args = [sys.executable, "-m", "k3", "sandbox", "serve", "--port", "0"]
    with subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as server:
        try:
            lines = [server.stdout.readline() for _ in range(2)]
            url = next(
                line.split(" on ", 1)[1].strip() for line in lines if line.startswith("sandbox API on")
            )
            assert not url.endswith(":0/")
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(url + "sandboxes", timeout=30)
            assert refused.value.code == 401  # no bearer token: the sandbox API answered
        finally:
            server.terminate()


def test_what_is_alive_when_serving_starts_is_frozen_out_of_the_collector(monkeypatch):
    """`run_app` freezes the startup heap before uvicorn serves: an object made before it is no longer among
    those the collector walks, while one made after it is; garbage in a cycle is collected, not kept."""
    import uvicorn

    static = ["made before serving"]  # lists are always tracked (a dict of strings is not)
    cycle = [None]
    cycle[0] = cycle
    seen = {}

    def serve(server, sockets):
        later = ["made while serving"]
        walked = gc.get_objects()
        seen.update(static=any(o is static for o in walked), later=any(o is later for o in walked))
        seen["frozen"] = gc.get_freeze_count()

    monkeypatch.setattr(uvicorn.Server, "run", serve)
    collected = []
    del cycle
    gc.callbacks.append(lambda phase, info: phase == "stop" and collected.append(info["collected"]))
    try:
        with socket.socket() as sock:
            run_app(None, sock, "warning")
    finally:
        gc.callbacks.pop()
        gc.unfreeze()  # the other tests in this process collect as before
    assert not seen["static"] and seen["later"] and seen["frozen"] > 1000, seen
    assert sum(collected) >= 1  # the cycle was collected before the freeze


@pytest.mark.parametrize(
    "host, alone", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("0.0.0.0", False)]
)
def test_only_a_loopback_address_is_this_machine_alone(host, alone):
    with listening_socket(host, 0) as sock:
        assert only_this_machine(sock) is alone


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_the_atlas_on_an_address_others_reach_needs_a_key_before_anything_is_done(command, tmp_path):
    where = (
        [command, str(tmp_path / "no-such-checkpoint")]
        if command == "serve"
        else [command, "--dir", str(tmp_path)]
    )
    r = CliRunner().invoke(
        app, ["atlas", *where, "--host", "0.0.0.0", "--port", "0"], env={"K3_ATLAS_KEY": None}
    )
    assert r.exit_code == 1 and r.output.strip().splitlines() == [
        "error: --host 0.0.0.0 takes requests from other machines, which must authenticate: give a key with "
        "--key KEY (or K3_ATLAS_KEY), or write a static site to host with `k3 atlas build`"
    ], r.output
    assert not any(tmp_path.iterdir())  # nothing created, nothing scanned


def test_k3_serve_on_an_address_others_reach_needs_a_key_before_anything_is_loaded(tmp_path):
    """No checkpoint is there: the refusal comes first. With a key it gets as far as the checkpoint."""
    args = ["serve", str(tmp_path / "no-such-checkpoint"), "--host", "0.0.0.0", "--port", "0"]
    r = CliRunner().invoke(app, args, env={"K3_API_KEY": None})
    assert r.exit_code == 1 and r.output.strip().splitlines() == [
        "error: --host 0.0.0.0 takes requests from other machines, which must authenticate: give a key with "
        "--api-key KEY (or K3_API_KEY)"
    ], r.output
    r = CliRunner().invoke(app, [*args, "--api-key", "s3cret"])
    assert r.exit_code == 1 and "no-such-checkpoint" in r.output and "authenticate" not in r.output, r.output
    r = CliRunner().invoke(app, args, env={"K3_API_KEY": "s3cret"})
    assert r.exit_code == 1 and "authenticate" not in r.output, r.output


def body_limited_app(max_bytes: int):
    """A FastAPI app behind BodyLimit answering with the length of the body it read; `calls` counts them."""
    inner, calls = FastAPI(), []

    @inner.post("/echo")
    async def echo(request: Request) -> dict:
        calls.append(1)
        return {"read": len(await request.body())}

    inner.add_middleware(BodyLimit, max_bytes=max_bytes)
    return inner, calls


def test_a_body_over_the_limit_is_413_by_its_length_or_as_its_chunks_pass_it():
    app_, calls = body_limited_app(1000)
    client = TestClient(app_)
    assert client.post("/echo", content=b"x" * 1000).json() == {"read": 1000}  # the limit itself passes
    assert calls == [1]
    refused = client.post("/echo", content=b"x" * 1001)
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "request_too_large"
    assert calls == [1]  # refused by its Content-Length: the app never ran
    chunks = (b"x" * 300 for _ in range(5))  # no Content-Length: chunked
    refused = client.post("/echo", content=chunks)
    assert refused.status_code == 413 and "1,000 bytes" in refused.json()["error"]["message"]
    assert client.post("/echo", content=(b"x" * 300 for _ in range(3))).json() == {"read": 900}
    bad = client.post("/echo", content=b"x", headers={"Content-Length": "a lot"})
    assert bad.status_code in (400, 413)  # the HTTP layer or BodyLimit: never read as a body


def test_every_k3_server_binds_127_0_0_1_unless_told():
    """Every command with a --host option (a server) defaults to the loopback address."""
    from cli_walk import commands

    hosts = {
        " ".join(path): param.default
        for path, command in commands()
        for param in command.params
        if "--host" in getattr(param, "opts", [])
    }
    assert set(hosts) == {"serve", "atlas serve", "atlas demo", "sandbox serve"}, hosts
    assert set(hosts.values()) == {"127.0.0.1"}
