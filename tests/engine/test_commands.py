"""The engine's CLI commands, run through typer's test runner on a random `tiny` checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from k3.chat.encoder import encode_chat
from k3.chat.parser import parse_reply
from k3.config import K3Config
from k3.engine import commands
from k3.engine.generate import Engine
from k3.engine.sampling import SamplingParams
from k3.model import K3ForCausalLM
from k3.model.init import init_checkpoint
from k3.tokenizer.build import write_tokenizer
from k3.tokenizer.kimi import Tokenizer

app = typer.Typer()
for fn in (commands.tokenize, commands.generate, commands.chat, commands.serve):
    app.command()(fn)
runner = CliRunner()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    init_checkpoint(K3Config.preset("tiny"), out, seed=4)
    write_tokenizer(out, 1024)
    return out


def test_tokenize_shows_pieces(checkpoint: Path) -> None:
    tok = Tokenizer.from_dir(checkpoint)
    r = runner.invoke(app, ["tokenize", "Extraordinario", "--checkpoint", str(checkpoint)])
    assert r.exit_code == 0, r.output
    pieces = [p.decode() for _, p in tok.pieces("Extraordinario")]
    assert f"{len(pieces)} tokens" in r.output and " · ".join(pieces) in r.output
    r = runner.invoke(app, ["tokenize", "<|open|>hola", "--special", "--vocab-size", "1024"])
    assert r.exit_code == 0 and "771" in r.output  # <|open|> as one special id
    r = runner.invoke(app, ["tokenize", "x", "--checkpoint", str(checkpoint / "missing")])
    assert r.exit_code == 1 and "missing: no such directory" in r.output
    r = runner.invoke(app, ["generate", str(checkpoint / "missing"), "--prompt", "x"])
    assert r.exit_code == 1 and "missing: no such directory" in r.output
    r = runner.invoke(app, ["tokenize", "x", "--checkpoint", str(checkpoint / "config.json")])
    assert r.exit_code == 1 and "config.json: not a directory" in r.output


def test_generate_streams_the_greedy_continuation(checkpoint: Path) -> None:
    tok = Tokenizer.from_dir(checkpoint)
    want = Engine(K3ForCausalLM.from_pretrained(checkpoint)).generate(
        [tok.encode("Hola")], SamplingParams(temperature=0, max_tokens=8, stop_ids={tok.special.eos})
    )[0]
    r = runner.invoke(app, ["generate", str(checkpoint), "--prompt", "Hola", "-n", "8", "-t", "0"])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("Hola" + tok.decode(want))


def test_generate_with_int8_expert_inputs(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--int8-expert-inputs sets the model's mode (k3.ops.mxfp4.int8_x) before it generates."""
    tok = Tokenizer.from_dir(checkpoint)
    model = K3ForCausalLM.from_pretrained(checkpoint).set_int8_expert_inputs(True)
    params = SamplingParams(temperature=0, max_tokens=8, stop_ids={tok.special.eos})
    want = Engine(model).generate([tok.encode("Hola")], params)[0]
    modes: list[bool] = []
    setter = K3ForCausalLM.set_int8_expert_inputs

    def spy(model: K3ForCausalLM, enabled: bool) -> K3ForCausalLM:
        modes.append(enabled)
        return setter(model, enabled)

    monkeypatch.setattr(K3ForCausalLM, "set_int8_expert_inputs", spy)
    args = ["generate", str(checkpoint), "--prompt", "Hola", "-n", "8", "-t", "0"]
    r = runner.invoke(app, [*args, "--int8-expert-inputs"])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("Hola" + tok.decode(want)) and modes == [True]
    assert runner.invoke(app, args).exit_code == 0 and modes == [True, False]


def test_generate_with_bf16_products(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--bf16-products reaches the model's tiling. Without AVX-512 BF16: a one-line error."""
    from k3.ops.decode.native import load_native

    asked: list[bool] = []
    tile = K3ForCausalLM.tile_weights
    monkeypatch.setattr(K3ForCausalLM, "tile_weights", lambda m, b=False: asked.append(b) or tile(m, b))
    args = ["generate", str(checkpoint), "--prompt", "Hola", "-n", "4", "-t", "0"]
    r = runner.invoke(app, [*args, "--bf16-products"])
    native = load_native()
    if native is not None and native.bf16_products_supported():
        assert r.exit_code == 0 and r.stdout.startswith("Hola"), r.output
    else:
        assert r.exit_code == 1 and "AVX-512 BF16" in r.output
    assert runner.invoke(app, args).exit_code == 0 and asked == [True, False]


def test_threads_reach_torch_before_the_model_runs(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--threads N sets torch's thread count before the model is loaded (generate, chat, serve; the same
    tokens as with the default); without it the count is left as it was; 0 is a one-line error."""
    import torch

    import k3.listen

    monkeypatch.setattr(k3.listen, "run_app", lambda app, sock, level: sock.close())
    counts: list[int] = []
    forward = K3ForCausalLM.forward

    def counting(model: K3ForCausalLM, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202 (forward's own)
        counts.append(torch.get_num_threads())
        return forward(model, *args, **kwargs)

    monkeypatch.setattr(K3ForCausalLM, "forward", counting)
    before = torch.get_num_threads()
    args = ["generate", str(checkpoint), "--prompt", "Hola", "-n", "4", "-t", "0"]
    try:
        torch.set_num_threads(2)
        default = runner.invoke(app, args)
        assert default.exit_code == 0 and set(counts) == {2}, (default.output, counts)
        counts.clear()
        one = runner.invoke(app, [*args, "--threads", "1"])
        assert one.exit_code == 0 and set(counts) == {1} and one.stdout == default.stdout, (
            one.output,
            counts,
        )
        torch.set_num_threads(2)
        counts.clear()
        chat = runner.invoke(
            app, ["chat", str(checkpoint), "-n", "2", "-t", "0", "--threads", "1"], input="hola\n"
        )
        assert chat.exit_code == 0 and counts and set(counts) == {1}, (chat.output, counts)
        torch.set_num_threads(2)
        served = runner.invoke(app, ["serve", str(checkpoint), "--port", "0", "--threads", "1"])
        assert served.exit_code == 0 and torch.get_num_threads() == 1, served.output
        bad = runner.invoke(app, [*args, "--threads", "0"])
        assert bad.exit_code == 1 and "--threads must be >= 1" in bad.output
    finally:
        torch.set_num_threads(before)


def test_chat_reads_piped_turns(checkpoint: Path) -> None:
    tok = Tokenizer.from_dir(checkpoint)
    params = SamplingParams(temperature=0, max_tokens=6, stop_ids={tok.special.eos, tok.special.end_of_msg})
    first = Engine(K3ForCausalLM.from_pretrained(checkpoint)).generate(
        [encode_chat(tok, [{"role": "user", "content": "hola"}])], params
    )[0]
    r = runner.invoke(app, ["chat", str(checkpoint), "-n", "6", "-t", "0"], input="hola\n\n¿qué tal?\n")
    assert r.exit_code == 0, r.output
    assert r.output.count("you> ") == 2 and r.output.count("k3> ") == 2
    reply = parse_reply(tok, first)
    assert (reply.reasoning + reply.content).split()[0] in r.output


def test_serve_wires_its_options(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`k3 serve` binds 127.0.0.1 by default and hands --max-queue, --request-timeout, --max-request-mb and
    the API key (from K3_API_KEY, checked before the body's size) to the app (k3.listen.run_app is replaced
    by a recorder; the app runs in-process)."""
    from fastapi.testclient import TestClient

    import k3.listen

    seen: dict = {}
    monkeypatch.setattr(k3.listen, "run_app", lambda app, sock, level: seen.update(app=app, sock=sock))
    monkeypatch.setenv("K3_API_KEY", "k")
    args = ["serve", str(checkpoint), "--max-queue", "3", "--request-timeout", "9", "--port", "0"]
    result = runner.invoke(app, [*args, "--max-request-mb", "1"])
    assert result.exit_code == 0, result.output
    with seen["sock"] as sock:
        host, port = sock.getsockname()
    assert host == "127.0.0.1" and f"on http://127.0.0.1:{port}/v1" in result.output
    served = seen["app"]
    assert served.state.worker.capacity == 16 + 3 and served.state.request_timeout == 9
    with TestClient(served) as client:
        assert client.get("/v1/models").status_code == 401
        r = client.get("/v1/models", headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == checkpoint.name
        big = {"Authorization": "Bearer k", "Content-Length": str(2**20 + 1)}
        assert client.post("/v1/completions", headers=big, content=b" " * (2**20 + 1)).status_code == 413
        assert client.post("/v1/completions", headers={"Content-Length": str(2**20 + 1)}).status_code == 401
    result = runner.invoke(app, ["serve", str(checkpoint), "--max-request-mb", "0"])
    assert result.exit_code != 0 and "--max-request-mb" in result.output
    result = runner.invoke(app, ["serve", str(checkpoint), "--request-timeout", "0"])
    assert result.exit_code != 0 and "--request-timeout" in result.output
    result = runner.invoke(app, ["serve", str(checkpoint), "--max-queue", "-1"])
    assert result.exit_code != 0 and "--max-queue" in result.output
    result = runner.invoke(app, ["serve", str(checkpoint), "--private-image-hosts", "img.lan"])
    assert result.exit_code != 0 and "it needs --allow-remote-images" in result.output


def test_serve_hands_the_remote_image_rule_to_the_app(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Remote image URLs: refused by default (None), public hosts with --allow-remote-images, and the hosts
    named by --private-image-hosts besides (k3.engine.server.create_app replaced by a recorder)."""
    import k3.engine.server
    import k3.listen
    from k3.engine.remote_images import RemoteImages

    rules = []
    monkeypatch.setattr(k3.listen, "run_app", lambda app, sock, level: sock.close())
    monkeypatch.setattr(k3.engine.server, "create_app", lambda *a, **kw: rules.append(kw["remote_images"]))
    base = ["serve", str(checkpoint), "--port", "0"]
    for extra in (
        [],
        ["--allow-remote-images"],
        ["--allow-remote-images", *"--private-image-hosts a --private-image-hosts b".split()],
    ):
        result = runner.invoke(app, [*base, *extra])
        assert result.exit_code == 0, result.output
    assert rules == [None, RemoteImages(), RemoteImages(frozenset({"a", "b"}))]


def test_generate_from_a_url_prints_what_the_folder_gives(checkpoint: Path) -> None:
    """`k3 generate URL`: tokenizer and weights over HTTP (experts on first use), the same continuation."""
    from k3.checkpoint.serve import RangeServer

    args = ["--prompt", "Hola", "-n", "8", "-t", "0"]
    local = runner.invoke(app, ["generate", str(checkpoint), *args])
    with RangeServer(checkpoint) as server:
        remote = runner.invoke(app, ["generate", server.url, *args])
        assert server.bytes_served > 0
    assert local.exit_code == 0 and remote.exit_code == 0, remote.output
    assert remote.stdout == local.stdout and len(local.stdout) > len("Hola\n")
