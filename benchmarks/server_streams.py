"""Server throughput with 1 vs N concurrent streams (`decode.py --server`): k3's OpenAI-compatible server
on random `mini` weights, N streamed completions at once through httpx, tokens/s from each stream's usage."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from serve_disconnect import served  # benchmarks/ is on the path as a script

from k3.config import K3Config
from k3.engine.generate import Engine
from k3.engine.server import create_app
from k3.model import K3ForCausalLM
from k3.tokenizer.build import builtin_tokenizer


def server_throughput(cfg: K3Config, streams: list[int], tokens: int) -> list[dict]:
    model = K3ForCausalLM.from_config(cfg, seed=0)
    tok = builtin_tokenizer(cfg.vocab_size)
    app = create_app(Engine(model, max_batch=max(streams)), tok, "mini", max_queue=max(streams))
    with served(app) as base:
        return _streams(base, streams, tokens)


def _streams(base: str, streams: list[int], tokens: int) -> list[dict]:
    """Tokens/s of 1 (a warm-up) then each count of concurrent streamed completions against `base`."""

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {
            "model": "mini",
            "prompt": f"Request {i}: el modelo lee el texto por pedazos.",
            "max_tokens": tokens,
            "temperature": 0.8,
            "seed": i,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        used = 0
        async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"usage"' in line:
                    used = json.loads(line[6:])["usage"]["completion_tokens"]
        return used

    async def run(n: int) -> dict:
        async with httpx.AsyncClient(timeout=None) as client:
            t = time.perf_counter()
            counts = await asyncio.gather(*(one(client, i) for i in range(n)))
            wall = time.perf_counter() - t
        total = sum(counts)
        return {"streams": n, "tokens": total, "seconds": wall, "tokens_per_s": total / wall}

    rows = []
    asyncio.run(run(1))  # warm-up
    for n in streams:
        row = asyncio.run(run(n))
        rows.append(row)
        print(
            f"[server] {n:>2} streams: {row['tokens']} tokens in {row['seconds']:.1f} s = "
            f"{row['tokens_per_s']:.1f} tokens/s",
            flush=True,
        )
    return rows
