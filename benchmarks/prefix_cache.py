"""The prefix cache: time to first token per turn of a chat and of an agent rollout, with the cache and
without it in the same run; bytes per cached token against the formula; long prompts' prefill speed and
peak RSS.

    .venv/bin/python benchmarks/prefix_cache.py [--preset mini] [--turns 10] [--new-tokens 2048]
        [--reply 32] [--interval 2048] [--agent-steps 8] [--image-turns 4] [--image-size 448 336]
        [--long 32768 131072] [--threads 1]

Chat: turn t's prompt is turn t-1's prompt, its greedy reply and `--new-tokens` new ids (a user message in
ids: the chat template does not change what is measured). Each turn runs on two engines over the same
random model, one with a `PrefixCache` (`--interval`), one without, one after the other; TTFT is the
time from submit to the first token. The greedy replies of both are compared (they must be the same).
Agent: a 1,024-id system prompt, then `--agent-steps` steps of a 16-token reply and a 256-id tool result.
Image chat: the chat again in the model with its vision tower, an image's pads in its first turn.
Long prompts: each `--long` length prefilled alone (the engine's standard chunks, no prefix cache) in a
fresh process: prefill tokens/s and the process's peak RSS.

Timings on a shared machine are noisy: the load average is printed with each part. llama.cpp's slot
cache is not compared here (no llama.cpp server is built on this machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from k3.config import K3Config
from k3.engine.generate import Engine
from k3.engine.prefix_cache import PrefixCache
from k3.engine.sampling import SamplingParams
from k3.engine.sequence_cache import cache_bytes_formula
from k3.engine.state_store import checkpoint_identity
from k3.model import K3ForCausalLM


def load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


def ttft(engine: Engine, prompt: list[int], max_tokens: int, images=None) -> tuple[float, list[int], int]:
    """(seconds to the first token, the greedy reply, prompt tokens restored from the cache)."""
    start = time.perf_counter()
    seq = engine.submit(prompt, SamplingParams(temperature=0, max_tokens=max_tokens), images=images)
    first = None
    while engine.has_work:
        events = engine.step()
        if first is None and any(e.seq is seq for e in events):
            first = time.perf_counter() - start
    return first or 0.0, list(seq.output), seq.cached


def conversation(model, pc, steps: list[list[int]], reply: int, label: str, images=None) -> list[dict]:
    """Feed the turns (new ids each) to a cached and an uncached engine; one row per turn. `images`: those
    whose pads the first turn holds (both engines keep their tower rows after the first turn)."""
    cached, plain = Engine(model, prefix_cache=pc), Engine(model)
    rows, prompt = [], []
    for t, new in enumerate(steps, 1):
        prompt = prompt + new
        t_on, out_on, restored = ttft(cached, prompt, reply, images)
        t_off, out_off, _ = ttft(plain, prompt, reply, images)
        rows.append(
            {
                "turn": t,
                "prompt": len(prompt),
                "cached": restored,
                "ttft_cache_s": round(t_on, 3),
                "ttft_plain_s": round(t_off, 3),
                "speedup": round(t_off / max(t_on, 1e-9), 2),
                "same_reply": out_on == out_off,
                "load": os.getloadavg()[0],
            }
        )
        print(f"{label} {rows[-1]}", flush=True)
        prompt = prompt + out_on
    return rows


def long_prompt(preset: str, n: int, threads: int) -> dict:
    """Prefill n random ids on a fresh process: tokens/s and peak RSS (GiB)."""
    code = f"""
import json, math, resource, time, torch
from k3.config import K3Config
from k3.engine.generate import Engine
from k3.engine.sequence_cache import cache_bytes_formula
from k3.engine.sampling import SamplingParams
from k3.model import K3ForCausalLM
torch.set_num_threads({threads})
cfg = K3Config.preset({preset!r})
model = K3ForCausalLM.from_config(cfg, seed=0)
ids = torch.randint(0, cfg.vocab_size, ({n},), generator=torch.Generator().manual_seed(0)).tolist()
engine = Engine(model, record_logits=True)
start = time.perf_counter()
seq = engine.submit(ids, SamplingParams(temperature=0, max_tokens=1))
finite = True
while engine.has_work:
    for e in engine.step():
        finite &= bool(torch.isfinite(e.logits).all())
took = time.perf_counter() - start
print(json.dumps({{"tokens": {n}, "seconds": round(took, 1), "tok_s": round({n} / took, 1),
    "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2), "finite": finite,
    "model_gib": round(sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**30, 2),
    "cache_gib": round(cache_bytes_formula(cfg, {n})["total"] / 2**30, 2),
    "chunk_activations_gib": round(2 * engine.attention_budget / 2**30, 2)}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        return {"tokens": n, "error": out.stderr.strip().splitlines()[-1]}
    return {**json.loads(out.stdout), "load": os.getloadavg()[0]}


def image_chat(args, rand) -> list[dict]:
    """A chat whose first turn holds an image (`--image-size`, seeded pixels) in the model with its vision
    tower: later turns resume past the image's pads from blocks keyed by its content."""
    import io

    import numpy as np
    from PIL import Image

    from k3.engine.images import load_image
    from k3.model import K3ForConditionalGeneration

    model = K3ForConditionalGeneration.from_config(K3Config.preset(args.preset), seed=0)
    w, h = args.image_size
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    image = load_image(buf.getvalue())
    first = rand(64) + [model.media_pad_id] * image.tokens + rand(args.new_tokens - 64 - image.tokens)
    steps = [first] + [rand(args.new_tokens) for _ in range(args.image_turns - 1)]
    pc = PrefixCache(args.interval, 8 * 2**30, checkpoint_identity(model))
    print(
        f"image chat: a {w}x{h} image ({image.tokens} pads), {args.image_turns} turns, {load()}", flush=True
    )
    return conversation(model, pc, steps, args.reply, "image chat", images=[image])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=2048)
    ap.add_argument("--reply", type=int, default=32)
    ap.add_argument("--interval", type=int, default=2048)
    ap.add_argument("--agent-steps", type=int, default=8)
    ap.add_argument("--image-turns", type=int, default=4, help="turns of the chat with an image (0: none)")
    ap.add_argument("--image-size", type=int, nargs=2, default=[448, 336], metavar=("W", "H"))
    ap.add_argument("--long", type=int, nargs="*", default=[32768, 131072])
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (2 on a loaded 2-core machine spin)"
    )
    ap.add_argument("--out", default="benchmarks/results/prefix_cache.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = K3Config.preset(args.preset)
    model = K3ForCausalLM.from_config(cfg, seed=0)
    gen = torch.Generator().manual_seed(0)

    def rand(n: int) -> list[int]:
        return torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()

    result: dict = {"preset": args.preset, "interval": args.interval, "threads": args.threads}
    Engine(model).generate([rand(64)], SamplingParams(temperature=0, max_tokens=2))  # warm-up, not timed
    pc = PrefixCache(args.interval, 8 * 2**30, checkpoint_identity(model))
    print(f"chat: {args.turns} turns of {args.new_tokens} new ids, {load()}", flush=True)
    result["chat"] = conversation(
        model, pc, [rand(args.new_tokens) for _ in range(args.turns)], args.reply, "chat"
    )

    blocks = max(len(pc.blocks), 1)
    per_block = cache_bytes_formula(cfg, args.interval)["total"] + 4 * args.interval  # + the ids (int32)
    result["bytes_per_cached_token"] = {
        "measured": round(pc.bytes / (blocks * args.interval), 1),
        "formula": round(per_block / args.interval, 1),
        "blocks": blocks,
        "mla_only_formula": round(cache_bytes_formula(cfg, args.interval)["mla"] / args.interval, 1),
    }
    print("bytes per cached token", result["bytes_per_cached_token"], flush=True)

    if args.agent_steps:
        agent = PrefixCache(args.interval, 8 * 2**30, checkpoint_identity(model))
        steps = [rand(1024)] + [rand(256) for _ in range(args.agent_steps - 1)]
        print(f"agent: {args.agent_steps} steps, {load()}", flush=True)
        result["agent"] = conversation(model, agent, steps, 16, "agent")

    if args.image_turns:
        result["image_chat"] = image_chat(args, rand)

    result["long"] = []
    for n in args.long:
        print(f"long prompt {n}, {load()}", flush=True)
        result["long"].append(long_prompt(args.preset, n, args.threads))
        print(result["long"][-1], flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
