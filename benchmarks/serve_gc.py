"""Python's cyclic collector in `k3 serve`: its passes while a server answers, with the startup heap as it is
and frozen (`k3.listen.freeze_startup_heap`, which `run_app` calls before serving).

    .venv/bin/python benchmarks/serve_gc.py [--preset mini] [--waves 40] [--tokens 32]

Each setting runs in a fresh process: a random model of the preset (weights laid out as `k3 serve` loads
them), the built-in tokenizer, the engine with a prefix cache keeping states every 64 prompt tokens (`k3
serve` keeps one every 2,048 by default: more states here, so more objects that live on), served on 127.0.0.1
by `k3.engine.server.create_app`; then `--waves` times 8 concurrent completions of `--tokens` tokens, each
prompt a shared 682-token document and a line of its own. A `gc.callbacks` probe times every pass of the
collector by generation; the oldest generation's passes stop every stream for as long as they take. Nothing is
collected by hand before serving in the first setting, as in a server that does not freeze. Prints per setting
the objects tracked when serving starts, the passes (count, total, longest) and what one full collection takes
after serving.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import subprocess
import sys
import time

import httpx
import torch
from decode import as_loaded  # benchmarks/ is on the path as a script
from serve_disconnect import served

from k3.config import K3Config
from k3.engine.generate import Engine
from k3.engine.prefix_cache import PrefixCache
from k3.engine.server import create_app
from k3.engine.state_store import checkpoint_identity
from k3.listen import freeze_startup_heap
from k3.model import K3ForCausalLM
from k3.ops.roofline import machine_line
from k3.tokenizer.build import builtin_tokenizer

DOCUMENT = "Un documento largo que cada pedido repite antes de su propia línea. " * 20


class CollectorProbe:
    """Every pass of the cyclic collector, timed: {generation: [seconds, ...]}."""

    def __init__(self) -> None:
        self.passes: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.passes[info["generation"]].append(time.perf_counter() - self._start)


async def completions(base: str, waves: int, tokens: int) -> int:
    """`waves` rounds of 8 concurrent completions; the tokens generated."""

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": "bench", "prompt": DOCUMENT + f"Pedido {i}.", "max_tokens": tokens}
        body |= {"temperature": 0.8, "seed": i, "ignore_eos": True}
        r = await client.post(base + "/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600) as client:
        done = 0
        for wave in range(waves):
            done += sum(await asyncio.gather(*(one(client, 8 * wave + i) for i in range(8))))
        return done


def one_setting(preset: str, frozen: bool, waves: int, tokens: int) -> dict:
    cfg = K3Config.preset(preset)
    model = as_loaded(K3ForCausalLM.from_config(cfg, seed=0))  # weights as `k3 serve` loads a checkpoint's
    cache = PrefixCache(64, 2**30, checkpoint_identity(model), None)
    app = create_app(
        Engine(model, max_batch=8, prefix_cache=cache), builtin_tokenizer(cfg.vocab_size), "bench"
    )
    probe = CollectorProbe()
    with served(app) as base:
        tracked = len(gc.get_objects())
        t = time.perf_counter()
        frozen_count = freeze_startup_heap() if frozen else 0  # its full collection runs here, before serving
        freezing = time.perf_counter() - t
        gc.callbacks.append(probe)
        t = time.perf_counter()
        generated = asyncio.run(completions(base, waves, tokens))
        seconds = time.perf_counter() - t
        gc.callbacks.remove(probe)
        t = time.perf_counter()
        gc.collect()  # what a pass of the oldest generation takes after serving
        full = time.perf_counter() - t
    passes = {g: [len(p), 1e3 * sum(p), 1e3 * max(p, default=0.0)] for g, p in probe.passes.items()}
    start = {"tracked": tracked, "frozen": frozen_count, "freezing_ms": 1e3 * freezing}
    return start | {"tokens": generated, "seconds": seconds, "passes": passes, "full_ms": 1e3 * full}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--waves", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--setting", choices=["as is", "frozen"], help=argparse.SUPPRESS)  # one child's
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.setting:
        print(json.dumps(one_setting(args.preset, args.setting == "frozen", args.waves, args.tokens)))
        return
    print(machine_line())
    workload = f"{args.waves} x 8 completions of {args.tokens} tokens"
    print(f"{args.preset}: {workload}, each setting in a fresh process")
    for setting in ("as is", "frozen"):
        argv = [sys.executable, __file__, "--preset", args.preset, "--waves", str(args.waves)]
        argv += ["--tokens", str(args.tokens), "--threads", str(args.threads), "--setting", setting]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        r = json.loads(out)
        passes = ", ".join(
            f"gen {g}: {n} passes, {total:.1f} ms, longest {longest:.1f} ms"
            for g, (n, total, longest) in r["passes"].items()
        )
        frozen = f"{r['frozen']:,} frozen in {r['freezing_ms']:.0f} ms" if r["frozen"] else "none frozen"
        print(
            f"{setting:>6}: {r['tracked']:,} objects tracked at the start, {frozen}; {r['tokens']} tokens in "
            f"{r['seconds']:.1f} s; {passes}; a full collection after serving {r['full_ms']:.1f} ms"
        )


if __name__ == "__main__":
    main()
