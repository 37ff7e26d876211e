"""`k3 stream` end to end: a `k3 init` checkpoint, JSONL prompts (text and ids), locally and from
`python -m k3.checkpoint.serve`; the files it writes; clear errors for bad input."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from k3.checkpoint import open_checkpoint
from k3.cli import app
from k3.stream.commands import parse_size
from k3.stream.plan import StreamPlan
from k3.tokenizer.kimi import Tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "tiny"
    result = CliRunner().invoke(app, ["init", str(out), "--preset", "tiny", "--seed", "3"])
    assert result.exit_code == 0, result.output
    return out


def write_prompts(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_stream_writes_logits_and_summary(ckpt, tmp_path):
    prompts = write_prompts(
        tmp_path / "p.jsonl", [{"text": "hello streaming world"}, {"input_ids": [5, 6, 7]}]
    )
    args = ["stream", str(ckpt), "--prompts", str(prompts), "--out", str(tmp_path / "out")]
    result = CliRunner().invoke(
        app, [*args, "--max-new-tokens", "2", "--dump-hidden", "1,3", "--threads", "1"]
    )
    assert result.exit_code == 0, result.output
    assert "2 pass(es)" in result.output
    out = load_file(tmp_path / "out" / "logits.safetensors")
    ids = Tokenizer.from_dir(ckpt).encode("hello streaming world")
    assert out["lengths"].tolist() == [len(ids), 3]
    assert out["input_ids"][0, : len(ids)].tolist() == ids
    assert out["logits"].shape == (2, 1024) and out["logits"].dtype == torch.float32
    assert out["generated"].shape == (2, 2) and out["hidden.3"].shape == (2, len(ids), 64)
    assert torch.equal(out["topk_ids"][:, 0], out["logits"].argmax(-1))
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["bytes_dense"] == sum(summary["dense_bytes_per_pass"])  # one pass per new token
    with open_checkpoint(ckpt) as c:
        plan = StreamPlan(c)
    table, distinct = plan.embed.tensors[0][1], len(set(ids) | {5, 6, 7})
    assert summary["dense_bytes_per_pass"][0] == plan.layer_bytes + table.nbytes // table.shape[0] * distinct
    for key in ("bytes_experts", "experts_touched", "seconds_reading", "seconds_compute", "peak_rss_bytes"):
        assert key in summary
    assert not (tmp_path / "out" / "scratch").exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_stream_from_the_range_server_equals_local(ckpt, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [{"input_ids": [1, 2, 3, 4]}, {"input_ids": [9]}])
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "k3.checkpoint.serve", str(ckpt), "--port", str(port)], cwd=ROOT
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                httpx.get(url + "/config.json")
                break
            except httpx.TransportError:
                time.sleep(0.05)
        for name, source in (("local", str(ckpt)), ("remote", url)):
            args = [
                "stream",
                source,
                "--prompts",
                str(prompts),
                "--out",
                str(tmp_path / name),
                "--all-positions",
            ]
            result = CliRunner().invoke(app, args)
            assert result.exit_code == 0, result.output
    finally:
        server.terminate()
        server.wait(10)
    local, remote = (
        load_file(tmp_path / "local" / "logits.safetensors"),
        load_file(tmp_path / "remote" / "logits.safetensors"),
    )
    assert torch.equal(local["logits"], remote["logits"])
    summary = json.loads((tmp_path / "remote" / "summary.json").read_text())
    assert summary["http"]["requests"] > summary["reads"] > 0


@pytest.mark.parametrize(
    "line,message",
    [
        ("not json", "not JSON"),
        ('{"input_ids": [1, "a"]}', "list of integers"),
        ('{"ids": [1]}', 'expected {"input_ids"'),
        ('{"input_ids": [5000]}', "outside the vocabulary"),
        ('{"input_ids": []}', "at least one token"),
    ],
)
def test_bad_prompts_are_one_line_errors(ckpt, tmp_path, line, message):
    (tmp_path / "p.jsonl").write_text(line + "\n")
    result = CliRunner().invoke(
        app, ["stream", str(ckpt), "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "o").exists()  # a failed command leaves no empty output folder behind


def test_a_failed_run_leaves_no_empty_folder_but_keeps_resumable_state(tmp_path):
    from k3.terminal import remove_if_empty

    (tmp_path / "empty" / "scratch" / "deeper").mkdir(parents=True)
    remove_if_empty(tmp_path / "empty")
    assert not (tmp_path / "empty").exists()
    (tmp_path / "kept" / "scratch").mkdir(parents=True)
    (tmp_path / "kept" / "other").mkdir()
    (tmp_path / "kept" / "scratch" / "state.safetensors").write_bytes(b"x")
    remove_if_empty(tmp_path / "kept")
    assert (tmp_path / "kept" / "scratch" / "state.safetensors").is_file()
    assert not (tmp_path / "kept" / "other").exists()


def test_text_over_http_takes_the_url_s_tokenizer_and_sizes_parse(ckpt, tmp_path):
    """Text prompts of a URL source are encoded by the tokenizer served beside its weights (the same ids as
    the folder's); an unreachable URL is a one-line error naming it."""
    from k3.checkpoint.serve import RangeServer

    write_prompts(tmp_path / "p.jsonl", [{"text": "hola streaming"}])
    with RangeServer(ckpt) as server:
        args = ["stream", server.url, "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o")]
        result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    ids = load_file(tmp_path / "o" / "logits.safetensors")["input_ids"][0].tolist()
    assert ids == Tokenizer.from_dir(ckpt).encode("hola streaming")
    result = CliRunner().invoke(app, ["stream", "http://127.0.0.1:9/x", *args[2:]])
    assert (
        result.exit_code == 1
        and "http://127.0.0.1:9/x/" in result.output
        and "Traceback" not in result.output
    )
    assert parse_size("4GB") == 4 * 10**9 and parse_size("512MiB") == 512 * 2**20 and parse_size("10") == 10
    result = CliRunner().invoke(app, [*args[:4], "--out", "o", "--memory-budget", "lots"])
    assert result.exit_code == 1 and "not a size" in result.output
    result = CliRunner().invoke(app, [*args[:4], "--out", "o", "--compute", "float16"])
    assert result.exit_code == 1 and "--compute must be one of float32, bfloat16" in result.output
