"""`hf://` sources through huggingface_hub, against a local fake Hub + CDN (tests/checkpoint/fake_hub.py)
reached through HF_ENDPOINT: the same results as the local folder, the token only ever sent to the Hub
host, only the bytes an operation needs fetched, the revision pinned once, and one-line errors."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fake_hub import FakeHub, Repo, repo_from_folder
from safetensors import safe_open
from typer.testing import CliRunner

from k3.atlas.scan import scan
from k3.checkpoint import CheckpointError, open_checkpoint
from k3.checkpoint.remote import RemoteOptions
from k3.cli import app
from k3.errors import K3Error
from k3.model import K3ForCausalLM
from k3.tokenizer.kimi import Tokenizer

COMMIT = "c0ffee" + "1" * 34
TOKEN = "hf_secret"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hub") / "tiny"
    result = CliRunner().invoke(app, ["init", str(out), "--preset", "tiny", "--seed", "5"])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def fake(tiny, tmp_path_factory):
    broken = tmp_path_factory.mktemp("broken")  # packed weights, but no quantization_config
    for p in tiny.iterdir():
        (broken / p.name).write_bytes(p.read_bytes())
    raw = json.loads((tiny / "config.json").read_text())
    del raw["text_config"]["quantization_config"]
    (broken / "config.json").write_text(json.dumps(raw))
    repos = {
        "org/tiny": repo_from_folder(tiny, COMMIT, token=TOKEN),
        "org/open": repo_from_folder(tiny, COMMIT),
        "org/broken": repo_from_folder(broken, COMMIT),
    }
    with FakeHub(repos) as hub:
        yield hub


@pytest.fixture
def hub(fake, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", fake.endpoint)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    fake.fault, fake.pace = None, None
    fake.hub_log.clear()
    fake.cdn_log.clear()
    fake.cdn_bytes = 0
    return fake


def test_from_pretrained_equals_local_and_keeps_the_token_off_the_cdn(tiny, hub):
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    local = K3ForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    remote = K3ForCausalLM.from_pretrained("hf://org/tiny", dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(local(ids), remote(ids))
    assert hub.cdn_log, "the safetensors bytes came through the CDN"
    assert all("authorization" not in headers for _, _, headers in hub.cdn_log)
    assert all("range" in headers for _, _, headers in hub.cdn_log)  # no whole-file download
    resolves = [(path, h) for _, path, h in hub.hub_log if "/resolve/" in path]
    assert resolves and all(f"/resolve/{COMMIT}/" in path for path, _ in resolves)  # the commit, every time
    assert all(h.get("authorization") == f"Bearer {TOKEN}" for _, h in resolves)
    revision_lookups = [path for _, path, _ in hub.hub_log if "/revision/" in path]
    assert revision_lookups == ["/api/models/org/tiny/revision/main"]  # resolved once


def test_stream_and_atlas_scan_equal_local_and_record_the_commit(tiny, hub, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n" + json.dumps({"input_ids": [7]}) + "\n")
    outs = {}
    for name, source in (("local", str(tiny)), ("hub", "hf://org/tiny")):
        args = ["stream", source, "--prompts", str(prompts), "--out", str(tmp_path / name), "--all-positions"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        with safe_open(tmp_path / name / "logits.safetensors", "pt") as f:
            outs[name] = ({k: f.get_tensor(k) for k in f.keys()}, f.metadata())  # noqa: SIM118
    assert outs["local"][0].keys() == outs["hub"][0].keys()
    assert all(torch.equal(outs["local"][0][k], outs["hub"][0][k]) for k in outs["local"][0])
    assert outs["hub"][1]["revision"] == COMMIT and outs["hub"][1]["source"] == f"hf://org/tiny@{COMMIT}"
    summary = json.loads((tmp_path / "hub" / "summary.json").read_text())
    assert summary["revision"] == COMMIT

    def dump(db: Path) -> dict:
        conn = sqlite3.connect(db)
        stats = {r[0]: json.loads(r[1]) for r in conn.execute("SELECT id, record FROM stats")}
        sim = sorted(conn.execute("SELECT * FROM similarity").fetchall())
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        conn.close()
        return {"stats": stats, "similarity": sim, "revision": json.loads(meta["revision"])}

    local = dump(scan(tiny, tmp_path / "a" / "atlas.sqlite", workers=1, similarity=False))
    remote = dump(scan("hf://org/tiny", tmp_path / "b" / "atlas.sqlite", workers=1, similarity=False))
    assert local["stats"] == remote["stats"] and local["similarity"] == remote["similarity"]
    assert remote["revision"] == COMMIT and local["revision"] is None
    assert all("authorization" not in headers for _, _, headers in hub.cdn_log)


def test_bytes_served_are_the_bytes_needed(tiny, hub):
    first = RemoteOptions().first_read
    shard = tiny / "model-00001-of-00001.safetensors"
    size = shard.stat().st_size
    with open_checkpoint("hf://org/tiny") as ckpt:
        assert hub.cdn_bytes == min(first, size)  # opening: the header, in the first read
        far = next(t for t in ckpt.tensors() if t.start + 8 > first and t.nbytes > 1000)
        before = hub.cdn_bytes
        data = ckpt.read(far.name)
        assert hub.cdn_bytes - before == far.nbytes
        with open_checkpoint(tiny) as local:
            assert torch.equal(data, local.read(far.name))
        assert ckpt.location == f"hf://org/tiny@{COMMIT}" and ckpt.revision == COMMIT


def test_pinned_revisions_and_resolve_urls_name_the_same_checkpoint(tiny, hub):
    shard = "model-00001-of-00001.safetensors"
    sources = [
        f"hf://org/tiny@{COMMIT}",
        f"{hub.endpoint}/org/tiny/resolve/main/{shard}",
        f"{hub.endpoint}/org/tiny/resolve/{COMMIT}",
    ]
    with open_checkpoint(tiny) as local:
        names = local.names
    for source in sources:
        with open_checkpoint(source) as ckpt:
            assert ckpt.names == names and ckpt.revision == COMMIT


def test_tokenizer_and_generate_from_the_hub_equal_local(tiny, hub):
    text = "hello hub, 123"
    assert Tokenizer.from_source("hf://org/tiny").encode(text) == Tokenizer.from_dir(tiny).encode(text)
    outputs = []
    hub.hub_log.clear()
    for source in (str(tiny), "hf://org/tiny"):
        args = ["generate", source, "--prompt", "hello", "--max-tokens", "4", "--temperature", "0"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        outputs.append(result.stdout)
    assert outputs[0] == outputs[1]
    lookups = [p for _, p, _ in hub.hub_log if "/revision/" in p]
    # `main` resolved once (the engine's look at the config: is there a vision tower); the model and the
    # tokenizer then read that commit, each checking it
    assert lookups == ["/api/models/org/tiny/revision/main"] + [f"/api/models/org/tiny/revision/{COMMIT}"] * 2


def test_the_server_names_the_commit_it_serves(hub):
    from starlette.testclient import TestClient

    from k3.engine.generate import Engine
    from k3.engine.server import create_app

    model = K3ForCausalLM.from_pretrained("hf://org/tiny")
    app = create_app(Engine(model), Tokenizer.from_source(model.source), "tiny")
    with TestClient(app) as client:
        models = client.get("/v1/models").json()["data"]
    assert models[0]["root"] == f"hf://org/tiny@{COMMIT}"


def test_an_unreachable_hub_is_one_line(hub, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    message = one_line_error("hf://org/tiny")
    assert "http://127.0.0.1:9/api/models/org/tiny/revision/main" in message


def one_line_error(source: str) -> str:
    with pytest.raises(K3Error) as info:
        K3ForCausalLM.from_pretrained(source)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_repo_revision_and_file(hub):
    message = one_line_error("hf://org/nothing")
    assert f"{hub.endpoint}/api/models/org/nothing/revision/main" in message
    assert "repository not found (HTTP 404)" in message
    message = one_line_error("hf://org/tiny@no-such-branch")
    assert "revision/no-such-branch" in message and "revision not found (HTTP 404)" in message
    message = one_line_error("hf://org/tiny/absent.safetensors")
    assert f"{hub.endpoint}/org/tiny/resolve/{COMMIT}/absent.safetensors" in message and "HTTP 404" in message


def test_gated_repo_without_or_with_a_bad_token(hub, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    monkeypatch.setenv("HF_HOME", str(Path(os.environ["HF_HUB_CACHE"]).parent / "home"))  # no token file
    message = one_line_error("hf://org/tiny")
    assert "org/tiny" in message and "(HTTP 401)" in message and "HF_TOKEN" in message
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    message = one_line_error("hf://org/tiny")
    assert "org/tiny" in message and "forbidden" in message and "(HTTP 403)" in message


def test_a_revision_that_moves_under_its_pinned_hash(hub):
    hub.fault = "move"
    message = one_line_error(f"hf://org/tiny@{COMMIT}")
    assert f"/org/tiny/resolve/{COMMIT}/" in message and "revision moved" in message and "HTTP" in message


@pytest.mark.parametrize(
    ("fault", "expected"),
    [("wrong-range", "got Content-Range"), ("ignore-range", "ignored the Range request (HTTP 200")],
)
def test_wrong_or_ignored_ranges(hub, fault, expected):
    hub.fault = fault
    message = one_line_error("hf://org/open")
    assert f"/org/open/resolve/{COMMIT}/model-00001-of-00001.safetensors" in message and expected in message


def test_a_short_answer_is_retried_then_reported(hub):
    hub.fault = "short"
    with pytest.raises(CheckpointError) as info:
        open_checkpoint("hf://org/open", remote=RemoteOptions(retries=1, backoff=0.01))
    message = str(info.value)
    assert "\n" not in message and f"/org/open/resolve/{COMMIT}/model-00001-of-00001.safetensors" in message
    assert "giving up after 2 attempts" in message and "short body" in message and "HTTP 206" in message


def test_tensors_that_disagree_with_the_config(hub):
    message = one_line_error("hf://org/broken")
    assert f"hf://org/broken@{COMMIT}" in message
    assert "is packed (weight_packed) but config.json has no quantization_config" in message


def test_download_is_verified_and_fills_the_cache_reads_then_skip(tiny, hub, tmp_path):
    typo = CliRunner().invoke(app, ["download", "hf://org/tiny", "--include", "*.jsn"])
    assert typo.exit_code == 1 and "no file matches *.jsn (it has config.json" in typo.output, typo.output
    result = CliRunner().invoke(app, ["download", "hf://org/tiny", "--include", "*.json"])
    assert result.exit_code == 0, result.output
    assert hub.cdn_bytes == 0  # JSON files are served by the Hub itself; no safetensors fetched
    result = CliRunner().invoke(app, ["download", "hf://org/tiny", "--local-dir", str(tmp_path / "copy")])
    assert result.exit_code == 0, result.output
    for p in tiny.iterdir():
        assert (tmp_path / "copy" / p.name).read_bytes() == p.read_bytes()
    assert CliRunner().invoke(app, ["download", "hf://org/tiny"]).exit_code == 0  # into the cache
    served = hub.cdn_bytes
    with open_checkpoint("hf://org/tiny") as ckpt:
        ckpt.read(ckpt.names[-1])
    assert hub.cdn_bytes == served  # read from the local Hugging Face cache
    hub.fault = "corrupt"
    result = CliRunner().invoke(app, ["download", "hf://org/open", "--local-dir", str(tmp_path / "bad")])
    assert (
        result.exit_code != 0 and "sha256" in result.output and "HTTP" not in result.output.split("sha256")[0]
    )
    assert not (tmp_path / "bad" / "model-00001-of-00001.safetensors").exists()


@pytest.mark.parametrize("into", ["local-dir", "cache"])
def test_a_download_killed_midway_resumes_where_it_stopped(hub, tmp_path, into):
    """SIGKILL during `k3 download` over a slow link, then the same command again: the file is finished from
    where the first process stopped (one Range request from its partial length on) and checked by sha256,
    in a local dir and in the Hugging Face cache (which huggingface_hub's own scan then finds whole). The
    shard is 24 MiB of random bytes, more than the 10 MiB huggingface_hub writes at a time."""
    name, size = "model-00001-of-00001.safetensors", 24 * 2**20
    hub.repos["org/big"] = Repo({name: os.urandom(size)}, COMMIT, {"main": COMMIT})
    hub.pace = size / 3  # bytes per second: ~3 s for the file
    argv = [sys.executable, "-m", "k3", "download", "hf://org/big"]
    if into == "local-dir":
        where, pattern = tmp_path / "d", "*.part"
        argv += ["--local-dir", str(where)]
    else:
        where, pattern = Path(os.environ["HF_HUB_CACHE"]), "*.k3.incomplete"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    first = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not [p for p in where.rglob(pattern) if p.stat().st_size > 0]:
        assert first.poll() is None and time.monotonic() < deadline, "no partial file appeared"
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    [partial] = list(where.rglob(pattern))
    kept = partial.stat().st_size
    assert 0 < kept < size
    hub.pace, before, served = None, len(hub.cdn_log), hub.cdn_bytes
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    folder = where / "models--org--big" / "snapshots" / COMMIT if into == "cache" else where
    assert (folder / name).read_bytes() == hub.repos["org/big"].files[name]
    asked = [h.get("range") for method, path, h in hub.cdn_log[before:] if method == "GET" and name in path]
    assert asked == [f"bytes={kept}-"] and hub.cdn_bytes - served == size - kept, (asked, kept)
    assert not list(where.rglob(pattern)) and not list(where.rglob("*.incomplete"))
    assert not [h for _, _, h in hub.cdn_log if "authorization" in h]  # HF_TOKEN is set: the Hub's only
    if into == "cache":
        from huggingface_hub import scan_cache_dir

        scanned = scan_cache_dir(where)
        assert not scanned.warnings and {r.repo_id for r in scanned.repos} == {"org/big"}


def test_not_a_hub_source_is_one_line():
    with pytest.raises(CheckpointError, match="not a Hub source"):
        open_checkpoint("hf://just-a-name")
