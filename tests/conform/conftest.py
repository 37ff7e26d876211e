"""A `tiny` checkpoint (with its small vision tower) with a 4,096-token context (so `long` reaches the limit
cheaply) and a tokenizer; apps of k3's server on it, whole or broken (broken_engines.py), served on a local
port; one reference for all."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import pytest
import torch
import uvicorn

from k3.config import K3Config
from k3.conform.reference import CheckpointReference, reference_model
from k3.model.init import init_checkpoint
from k3.tokenizer.build import write_tokenizer

CONTEXT = 4096


@pytest.fixture(autouse=True, scope="package")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="package")
def checkpoint(tmp_path_factory):
    raw = json.loads(json.dumps(K3Config.preset("tiny").to_dict()))
    raw["text_config"]["max_position_embeddings"] = CONTEXT
    out = tmp_path_factory.mktemp("tiny4096")
    init_checkpoint(K3Config.from_dict(raw), out, seed=3)
    write_tokenizer(out, 1024)
    return out


@pytest.fixture(scope="package")
def reference(checkpoint):
    """The checkpoint's reference, shared by every server the tests hold against it: the requests the servers
    agree on (all of them for k3's own engine, most for the broken ones) are computed once. A few hundred
    distinct requests at most, each a few [4, V] float64 tables."""
    return CheckpointReference(reference_model(checkpoint), remember=512)  # with its vision tower


@contextlib.contextmanager
def live(app):
    """Run a FastAPI app under uvicorn on 127.0.0.1 in a thread; yields its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(400):
        if server.started:
            break
        time.sleep(0.025)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="package")
def serve():
    return live
