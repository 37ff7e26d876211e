"""The prefix cache through `k3 serve` on a random `tiny` checkpoint: multi-turn chats with the cache on
and off (same greedy tokens, log-probs within the chunking bound, `cached_tokens` as the ids predict),
16 concurrent clients with shared and distinct prefixes, a tiny byte budget, a restart on `--state-dir`
with a damaged file, and the serve flags."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
import typer
from typer.testing import CliRunner

from k3.engine import commands, state_store
from k3.engine.generate import Engine
from k3.engine.prefix_cache import PrefixCache
from k3.engine.sampling import SamplingParams
from k3.engine.server import create_app
from k3.model import K3ForCausalLM
from k3.tokenizer.kimi import Tokenizer

INTERVAL = 16
BOUND = 1e-4  # log-probs, cache on (chunks end every 16 tokens) against off: see test_prefix_cache.py
SYSTEM = "Eres un asistente que responde con calma, en frases cortas, y que cita sus fuentes siempre."
TURNS = ["Hola, ¿qué tal?", "Cuéntame algo de los ríos de Europa.", "¿Y de los lagos?", "Gracias, adiós."]


@pytest.fixture(scope="module")
def tok(tiny_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_checkpoint)


def serve(checkpoint: Path, tok: Tokenizer, live_server, pc: bool = True, **kw):
    model = K3ForCausalLM.from_pretrained(checkpoint)
    cache = None
    if pc:
        identity = state_store.checkpoint_identity(model)
        cache = PrefixCache(kw.pop("interval", INTERVAL), kw.pop("max_bytes", 2**30), identity, **kw)
    app = create_app(Engine(model, max_batch=16, prefix_cache=cache), tok, "k3-tiny", max_queue=16)
    return live_server(app), cache


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def chat(c: openai.OpenAI, messages: list[dict]):
    return c.chat.completions.create(
        model="k3-tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )


def conversation(base: str, system: str = SYSTEM) -> Iterator[tuple[list[int], object]]:
    """Each turn's prompt ids (from /tokenize) and reply; the reply's text goes into the next turn."""
    c, messages = client(base), [{"role": "system", "content": system}]
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        ids = httpx.post(f"{base}/tokenize", json={"messages": messages}).json()["tokens"]
        reply = chat(c, messages)
        yield ids, reply
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or "..."})


def expected_cached(earlier: list[list[int]], ids: list[int]) -> int:
    """The deepest boundary of ids (leaving one id to prefill) inside a prefix an earlier prompt stored."""
    best = 0
    for prev in earlier:
        common = next(
            (i for i, (a, b) in enumerate(zip(prev, ids, strict=False)) if a != b), min(len(prev), len(ids))
        )
        best = max(best, min(common, len(ids) - 1) // INTERVAL * INTERVAL)
    return best


def test_multi_turn_chat_with_and_without_the_cache(tiny_checkpoint, tok, live_server) -> None:
    on_ctx, _ = serve(tiny_checkpoint, tok, live_server)
    off_ctx, _ = serve(tiny_checkpoint, tok, live_server, pc=False)
    with on_ctx as on, off_ctx as off:
        turns_on, turns_off = list(conversation(on)), list(conversation(off))
        health_on, health_off = httpx.get(f"{on}/health").json(), httpx.get(f"{off}/health").json()
    assert "prefix_cache" not in health_off
    cached = [expected_cached([ids for ids, _ in turns_on[:i]], ids) for i, (ids, _) in enumerate(turns_on)]
    seen = health_on["prefix_cache"]
    assert (seen["hits"], seen["misses"]) == (sum(c > 0 for c in cached), sum(c == 0 for c in cached))
    assert seen["cached_tokens"] == sum(cached) and seen["blocks"] > 0 and seen["evicted"] == 0
    earlier: list[list[int]] = []
    for (ids, a), (ids_off, b) in zip(turns_on, turns_off, strict=True):
        assert ids == ids_off
        assert a.choices[0].message.content == b.choices[0].message.content
        la, lb = a.choices[0].logprobs.content, b.choices[0].logprobs.content
        assert [e.token for e in la] == [e.token for e in lb]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(la, lb, strict=True)) < BOUND
        assert a.usage.prompt_tokens_details.cached_tokens == expected_cached(earlier, ids)
        assert b.usage.prompt_tokens_details.cached_tokens == 0
        earlier.append(ids)
    assert turns_on[-1][1].usage.prompt_tokens_details.cached_tokens > 0


def test_16_concurrent_clients_equal_their_runs_alone(tiny_checkpoint, tok, live_server) -> None:
    """8 clients share a long system prompt, 8 have their own; all at once on one server, each equals
    its request alone on a fresh server (tokens exactly; log-probs up to the decode batch's rounding)."""
    convs = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Pregunta número {i}."}]
        for i in range(8)
    ] + [[{"role": "user", "content": f"Otra cosa distinta, la {i}, sin sistema."}] for i in range(8)]
    ctx, cache = serve(tiny_checkpoint, tok, live_server)
    results: dict[int, object] = {}
    with ctx as base:
        c = client(base)
        threads = [
            threading.Thread(target=lambda i=i: results.update({i: chat(c, convs[i])})) for i in range(16)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert cache is not None and cache.stats.hits >= 1  # the shared system prompt was reused
    assert sum(results[i].usage.prompt_tokens_details.cached_tokens for i in range(8)) > 0
    ctx, _ = serve(tiny_checkpoint, tok, live_server)
    with ctx as base:
        c = client(base)
        for i in (0, 5, 8, 15):
            alone = chat(c, convs[i])
            got = results[i].choices[0]
            assert got.message.content == alone.choices[0].message.content
            pairs = zip(got.logprobs.content, alone.choices[0].logprobs.content, strict=True)
            assert all(x.token == y.token and abs(x.logprob - y.logprob) < BOUND for x, y in pairs)


def test_tiny_byte_budget_never_fails_a_request(tiny_checkpoint, tok, live_server) -> None:
    """Room for 3 blocks, two 4-turn conversations in token ids (completions) that would store many more:
    every turn is answered, the budget holds; the first keeps its first 3 blocks (storing never evicts a
    block's ancestors) and reuses them; the second's evict them and are reused in turn."""
    model = K3ForCausalLM.from_pretrained(tiny_checkpoint)
    probe = PrefixCache(INTERVAL, 2**30, state_store.checkpoint_identity(model))
    Engine(model, prefix_cache=probe).generate([list(range(40))], SamplingParams(temperature=0, max_tokens=1))
    per_block = next(iter(probe.blocks.values())).nbytes
    ctx, cache = serve(tiny_checkpoint, tok, live_server, max_bytes=per_block * 3)
    gen = torch.Generator().manual_seed(0)
    with ctx as base:
        c = client(base)
        for _ in range(2):
            prompt, cached = [], []
            for _turn in range(4):
                prompt = prompt + torch.randint(0, 1000, (30,), generator=gen).tolist()
                r = c.completions.create(model="k3-tiny", prompt=prompt, max_tokens=4, temperature=0)
                assert r.choices[0].finish_reason in ("stop", "length")
                assert cache is not None and cache.bytes <= cache.max_bytes
                cached.append(r.usage.prompt_tokens_details.cached_tokens)
                prompt = prompt + tok.encode(r.choices[0].text)[:4]
            assert cached == [0, 16, 48, 48]  # 30 ids: 1 block stored; 64: 3; then no room for a 4th
    assert cache.stats.evicted == 3


def test_restart_with_state_dir_and_a_damaged_file(tiny_checkpoint, tok, live_server, tmp_path) -> None:
    """A chat, the server restarted on the same --state-dir: the prompt resumes from every block it wrote;
    then the deepest file truncated: refused (logged), that block recomputed, the same reply."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[1]}]
    ctx, cache = serve(tiny_checkpoint, tok, live_server, state_dir=tmp_path)
    with ctx as base:
        first = chat(client(base), messages)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert cache is not None and len(files) == len(cache.blocks) >= 3

    ctx, cache = serve(tiny_checkpoint, tok, live_server, state_dir=tmp_path)  # a restart
    with ctx as base:
        again = chat(client(base), messages)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == len(files) * INTERVAL

    deepest = max(files, key=lambda f: int(state_store.read(f, cache.identity)[1]["end"]))
    deepest.write_bytes(deepest.read_bytes()[:100])  # truncated
    ctx, cache = serve(tiny_checkpoint, tok, live_server, state_dir=tmp_path)
    assert any("not a readable safetensors file" in r for r in cache.stats.refused)
    with ctx as base:
        third = chat(client(base), messages)
    assert third.choices[0].message.content == first.choices[0].message.content
    assert third.usage.prompt_tokens_details.cached_tokens == (len(files) - 1) * INTERVAL


def test_serve_flags(tiny_checkpoint, monkeypatch, tmp_path) -> None:
    import k3.listen

    app = typer.Typer()
    app.command()(commands.serve)
    seen: dict = {}
    monkeypatch.setattr(
        k3.listen, "run_app", lambda app, sock, *a, **kw: (seen.update(app=app), sock.close())
    )
    args = [
        "--port",
        "0",
        "--state-interval",
        "32",
        "--prefix-cache-bytes",
        "1000000",
        "--state-dir",
        str(tmp_path),
    ]
    r = CliRunner().invoke(app, [str(tiny_checkpoint), *args])
    assert r.exit_code == 0, r.output
    pc = seen["app"].state.worker.engine.prefix_cache
    assert (pc.interval, pc.max_bytes, pc.state_dir) == (32, 1_000_000, tmp_path)
    r = CliRunner().invoke(app, [str(tiny_checkpoint), "--port", "0", "--no-prefix-cache"])
    assert r.exit_code == 0 and seen["app"].state.worker.engine.prefix_cache is None
    r = CliRunner().invoke(
        app, [str(tiny_checkpoint), "--port", "0", "--no-prefix-cache", "--state-dir", str(tmp_path)]
    )
    assert r.exit_code == 1 and "--state-dir" in r.output
    r = CliRunner().invoke(app, [str(tiny_checkpoint), "--port", "0", "--state-interval", "0"])
    assert r.exit_code == 1 and "--state-interval must be >= 1" in r.output
