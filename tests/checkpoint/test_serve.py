"""`k3.checkpoint.serve`: the Range server that `open_checkpoint(url)` and the atlas read through."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from k3.checkpoint.serve import RangeServer, main


@pytest.fixture
def served(tmp_path: Path):
    root = tmp_path / "ckpt"
    root.mkdir()
    data = bytes(range(256)) * (2 * 2**20 // 256 + 3)  # 2 MiB and a bit: more than one socket buffer
    (root / "model.safetensors").write_bytes(data)
    (root / "sub").mkdir()
    (root / "with space.json").write_text("{}")
    (tmp_path / "secret.txt").write_text("outside the root")
    with RangeServer(root) as server:
        yield server, data


def raw_get(server: RangeServer, path: str) -> bytes:
    """A request line sent as is (httpx would normalise the `..`)."""
    host, port = server.server_address[:2]
    with socket.create_connection((host, port)) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        return b"".join(iter(lambda: sock.recv(65536), b""))


def test_ranges_whole_files_and_counters(served) -> None:
    server, data = served
    url = f"{server.url}/model.safetensors"
    r = httpx.get(url, headers={"Range": "bytes=10-19"})
    assert r.status_code == 206 and r.content == data[10:20]
    assert r.headers["Content-Range"] == f"bytes 10-19/{len(data)}"
    r = httpx.get(url, headers={"Range": f"bytes={len(data) - 5}-"})  # open end
    assert r.status_code == 206 and r.content == data[-5:]
    r = httpx.get(url, headers={"Range": f"bytes=0-{10 * len(data)}"})  # end past the file: clipped
    assert r.content == data
    r = httpx.get(url)
    assert r.status_code == 200 and r.content == data and r.headers["Accept-Ranges"] == "bytes"
    assert server.bytes_served == 10 + 5 + 2 * len(data)
    head = httpx.head(url)
    assert head.status_code == 200 and int(head.headers["Content-Length"]) == len(data)
    assert server.bytes_served == 10 + 5 + 2 * len(data)  # HEAD sends no body
    assert httpx.get(url, headers={"Range": f"bytes={len(data)}-"}).status_code == 416
    assert [p for p, _ in server.requests] == ["/model.safetensors"] * 6
    assert httpx.get(f"{server.url}/with%20space.json").text == "{}"  # percent-encoded names


def test_nothing_outside_the_root_nor_folders(served) -> None:
    server, _ = served
    for path in ("/../secret.txt", "/sub/../../secret.txt", "/%2e%2e/secret.txt", "/sub", "/missing"):
        answer = raw_get(server, path)
        assert answer.startswith(b"HTTP/1.1 404") and b"outside the root" not in answer, path


def test_command_refuses_a_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="not a directory"):
        main([str(tmp_path / "nope")])
