"""Engine tests run tiny models, where torch's intra-op threads cost more than they give (and the CI
machine's cores are shared): one thread while these tests run, restored afterwards. Also: a `tiny`
checkpoint on disk and a way to serve an app on a local port (the server tests)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import uvicorn

from k3.config import K3Config
from k3.model.init import init_checkpoint
from k3.tokenizer.build import write_tokenizer


@pytest.fixture(autouse=True, scope="package")
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="package")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random `tiny` checkpoint (seed 3) with a 1,024-id built-in tokenizer."""
    out = tmp_path_factory.mktemp("tiny")
    init_checkpoint(K3Config.preset("tiny"), out, seed=3)
    write_tokenizer(out, 1024)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live(app) -> Iterator[str]:
    """Run a FastAPI app under uvicorn on 127.0.0.1 in a thread; yields its base URL."""
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(400):
        if server.started:
            break
        time.sleep(0.025)
    assert server.started, "uvicorn did not start"
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="package")
def live_server():
    """`live(app)`: a context manager serving an app on a free local port."""
    return live
