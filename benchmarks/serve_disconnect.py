"""Disconnect-to-stop: how soon a streaming request whose client goes away leaves the engine's batch.

    .venv/bin/python benchmarks/serve_disconnect.py [--preset tiny|mini] [--trials 20] [--streams 4]

Serves a random model of the preset (built-in tokenizer) on 127.0.0.1 with `k3.engine.server.create_app`,
keeps `--streams - 1` other streams decoding beside it, then `--trials` times: opens one more streaming
completion, reads 3 tokens, closes the connection and polls (every 0.2 ms) until the engine reports its
sequence finished ("cancelled"). Prints the decode step time while the batch runs, the close-to-cancel
latency (median, max) and the most engine steps that finished after the close (`Engine.steps`; the step in
progress at the close is one). Timings are noisy when other jobs share the CPUs: the load is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import threading
import time

import httpx
import torch
import uvicorn

from k3.config import K3Config
from k3.engine.generate import Engine
from k3.engine.sequence import Status
from k3.engine.server import create_app
from k3.model import K3ForCausalLM
from k3.tokenizer.build import builtin_tokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(app) -> object:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument(
        "--streams", type=int, default=4, help="sequences decoding together, the measured one included"
    )
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = K3Config.preset(args.preset)
    model = K3ForCausalLM.from_config(cfg, seed=0)
    tok = builtin_tokenizer(cfg.vocab_size)
    engine = Engine(model, max_batch=args.streams)
    body = {"model": "m", "prompt": "uno dos tres", "max_tokens": 8000, "ignore_eos": True, "stream": True}
    latencies, steps_after = [], []
    with served(create_app(engine, tok, "m")) as base, contextlib.ExitStack() as others:
        readers = []  # kept: dropping a line iterator closes its stream
        for _ in range(args.streams - 1):
            c = others.enter_context(httpx.Client(timeout=60))
            r = others.enter_context(c.stream("POST", f"{base}/v1/completions", json=body))
            readers.append(r.iter_lines())
            next(readers[-1])
        others_seqs = list(engine.running)
        s0, t0 = engine.steps, time.perf_counter()
        time.sleep(1.0)
        step_ms = 1000 * (time.perf_counter() - t0) / max(1, engine.steps - s0)
        for _ in range(args.trials):
            with httpx.Client(timeout=60) as c, c.stream("POST", f"{base}/v1/completions", json=body) as r:
                data = (line for line in r.iter_lines() if line)
                for _ in range(3):
                    next(data)
                (seq,) = [s for s in engine.running if s not in others_seqs]
                steps, start = engine.steps, time.perf_counter()
            while seq.status is not Status.FINISHED:
                time.sleep(0.0002)
            latencies.append(1000 * (time.perf_counter() - start))
            steps_after.append(engine.steps - steps)
            assert seq.finish_reason == "cancelled"
    print(f"preset {args.preset}, {args.streams} streams decoding together, {args.threads} thread(s)")
    print(f"decode step: {step_ms:.1f} ms")
    print(
        f"close -> cancelled: median {statistics.median(latencies):.1f} ms, max {max(latencies):.1f} ms; "
        f"engine steps finished after the close: max {max(steps_after)} "
        f"(of {args.trials} trials; 1 = the step in progress)"
    )
    print(f"load: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
