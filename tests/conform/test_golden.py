"""Golden packs: written (in memory and through `k3 stream`), verified (hashes, the checkpoint's identity, a
recomputed sample), read back by `k3 stream compare` and by `k3 conform --golden` against k3's server."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from k3.cli import app
from k3.conform.client import EngineClient
from k3.conform.golden import read_sequences, verify_golden, write_golden
from k3.conform.reference import GoldenReference, ReferenceError, reference_model
from k3.conform.report import THRESHOLDS
from k3.conform.scenarios import Run, run_scenarios
from k3.conform.texts import chat_ids, image_chats
from k3.engine.generate import Engine
from k3.engine.server import create_app
from k3.model import K3ForCausalLM
from k3.tokenizer.kimi import Tokenizer

runner = CliRunner()


@pytest.fixture(scope="module")
def pack(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("golden") / "pack"
    result = runner.invoke(app, ["golden", str(checkpoint), "--out", str(out), "--continuation", "4"])
    assert result.exit_code == 0, result.output
    return out


def test_the_pack_holds_what_the_manifest_says(pack, checkpoint):
    manifest = json.loads((pack / "manifest.json").read_text())
    assert manifest["format"] == "k3-golden/1" and manifest["expert_format"] == "mxfp4"
    names = {f["name"] for f in manifest["checkpoint"]["files"]}
    assert {"config.json", "tiktoken.model"} <= names and all(
        len(f["sha256"]) == 64 for f in manifest["checkpoint"]["files"]
    )
    data = load_file(pack / "data.safetensors")
    n = len(manifest["sequences"])
    assert n == 8 + 4 + 4 + 10 + 2 + 5  # prompts, concurrent's, growing chat, tool chat, shifted, images
    model = K3ForCausalLM.from_pretrained(checkpoint)
    ids = data["seq.13.ids"].tolist()  # a chat turn: prompt + 4 greedy tokens
    with torch.no_grad():
        lp = model(torch.tensor([ids]))[0].double().log_softmax(-1)
    assert ids[-4:] == lp[-5:-1].argmax(-1).tolist()  # the continuation is greedy
    assert torch.equal(data["seq.13.top_ids"][:, 0], lp.argmax(-1))
    assert (data["seq.13.top_logprobs"].double() - lp.topk(20, -1).values).abs().max() < 1e-5
    assert (
        data["seq.13.next_logprob"].double() - lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    ).abs().max() < 1e-5
    assert data["seq.13.hidden_rms"].shape == (5, len(ids)) and (data["seq.13.hidden_rms"] > 0).all()
    assert data["seq.13.experts"].shape == (len(ids), 4, 2)  # 4 MoE layers, top-2
    kda = manifest["kda_sequence"]
    bounds = data["kda_boundaries"].tolist()
    assert bounds == list(range(64, len(data[f"seq.{kda}.ids"]) - 4 + 1, 64))  # within the prompt
    assert data["kda.1"].shape[0] == len(bounds) and data["kda.1"].abs().sum() > 0


def test_verify_checks_hashes_identity_and_a_recomputed_sample(pack, checkpoint, tmp_path):
    assert verify_golden(pack, checkpoint) == []
    result = runner.invoke(app, ["golden", "verify", str(pack), "--checkpoint", str(checkpoint)])
    assert result.exit_code == 0 and "sound" in result.output
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for f in pack.iterdir():
        (damaged / f.name).write_bytes(f.read_bytes())
    data = load_file(damaged / "data.safetensors")
    data["seq.0.top_logprobs"] = data["seq.0.top_logprobs"] + 1e-3
    from safetensors.torch import save_file

    save_file(data, damaged / "data.safetensors")
    assert any("sha256" in p for p in verify_golden(damaged, checkpoint))
    result = runner.invoke(app, ["golden", "verify", str(damaged)])
    assert result.exit_code == 1 and "FAIL data.safetensors" in result.output
    # rehashed, the damage is found by recomputing
    manifest = json.loads((damaged / "manifest.json").read_text())
    from k3.conform.golden import sha256

    manifest["data"]["data.safetensors"] = sha256(damaged / "data.safetensors")
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    assert any("recomputed" in p for p in verify_golden(damaged, checkpoint))
    # the first sequence with images is recomputed with its pixels too: damage there is found, and an
    # image this k3 does not make is named
    k = next(i for i, d in enumerate(manifest["sequences"]) if d["images"])
    data = load_file(pack / "data.safetensors")
    data[f"seq.{k}.top_logprobs"] = data[f"seq.{k}.top_logprobs"] + 1e-3
    save_file(data, damaged / "data.safetensors")
    manifest["data"]["data.safetensors"] = sha256(damaged / "data.safetensors")
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    assert [p for p in verify_golden(damaged, checkpoint) if "recomputed" in p] == [
        f"sequence {k}: recomputed top-20 logprobs differ by 0.001 (> 0.0001)"
    ]
    manifest["sequences"][k]["images"] = ["0" * 64]
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    assert f"sequence {k}: its images are not the ones this k3 makes (k3.conform.texts)" in verify_golden(
        damaged, checkpoint
    )


def test_k3_stream_compare_reads_the_pack(pack, checkpoint, tmp_path):
    out = tmp_path / "stream"
    result = runner.invoke(
        app,
        [
            "stream",
            str(checkpoint),
            "--prompts",
            str(pack / "prompts.jsonl"),
            "--out",
            str(out),
            "--all-positions",
        ],
    )
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["stream", "compare", str(pack), str(out), "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    rows = rows if isinstance(rows, list) else rows["prompts"]
    assert len(rows) == 8 and max(r["max_abs"] for r in rows) < 1e-4 and all(r["top1"] == 1.0 for r in rows)


@pytest.mark.slow  # 6.5 to 74 s on the shared 2-core machine: k3 stream reads every weight per greedy token
def test_through_k3_stream_equals_in_memory(pack, checkpoint, tmp_path):
    write_golden(checkpoint, tmp_path / "streamed", continuation=4, via_stream=True)
    ours, theirs = read_sequences(pack), read_sequences(tmp_path / "streamed")
    assert sum(bool(s.images) for s in theirs) == 5  # the image chats, their pixels through the stream
    for a, b in zip(ours, theirs, strict=True):
        assert a.ids == b.ids and a.images == b.images
        assert (a.top_logprobs - b.top_logprobs).abs().max() < 1e-4
    manifest = json.loads((tmp_path / "streamed" / "manifest.json").read_text())
    assert manifest["computed"] == "k3 stream" and manifest["kda_every"] is None


def test_conform_against_the_golden_pack(pack, checkpoint, reference, serve):
    tokenizer = Tokenizer.from_source(pack)  # the pack carries its tokenizer
    with serve(create_app(Engine(reference_model(checkpoint)), tokenizer, "tiny")) as base:
        client = EngineClient(f"{base}/v1", tokenizer)
        golden = run_scenarios(
            Run(client, GoldenReference(read_sequences(pack)), THRESHOLDS["exact"], 4),
            ["prefix", "tools", "concurrent", "repeat", "images"],
        )
        exact = run_scenarios(Run(client, reference, THRESHOLDS["exact"], 4), ["prefix"])
        client.close()
        result = runner.invoke(
            app,
            [
                "conform",
                "--engine",
                f"{base}/v1",
                "--golden",
                str(pack),
                "--scenarios",
                "prefix,repeat,long",
                "--report",
                str(pack.parent / "rep"),
            ],
        )
    assert [r.passed for r in golden] == [True] * 5 and not any(r.skipped for r in golden)
    assert golden[0].positions == exact[0].positions and golden[0].max_dlogprob < 1e-4
    assert result.exit_code == 0, result.output
    report = json.loads((pack.parent / "rep.json").read_text())
    assert report["passed"] and [s["name"] for s in report["scenarios"]] == ["prefix", "repeat", "long"]
    assert report["scenarios"][2]["skipped"]  # no near-limit document in the default suite


@pytest.mark.parametrize(
    "args, message",
    [
        (["golden", "/nonexistent", "--out", "x"], "not a checkpoint folder"),
        (["golden", "verify", "/nonexistent"], "not a golden pack"),
        (["conform", "--engine", "http://127.0.0.1:9/v1"], "give exactly one of --checkpoint"),
        (
            ["conform", "--engine", "http://127.0.0.1:9/v1", "--golden", "g", "--scenarios", "x"],
            "unknown scenarios",
        ),
        (
            ["conform", "--engine", "http://127.0.0.1:9/v1", "--golden", "g", "--expert-format", "x"],
            "--expert-format",
        ),
    ],
)
def test_bad_input_is_one_line(args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output


def test_an_engine_that_is_not_there_is_one_line(pack):
    result = runner.invoke(app, ["conform", "--engine", "http://127.0.0.1:9/v1", "--golden", str(pack)])
    assert result.exit_code == 1 and "ConnectError" in result.output and len(result.output.splitlines()) == 1


def test_an_engine_without_logprobs_is_told_so(pack, checkpoint, serve):
    """A server that ignores `logprobs` fails each scenario with that reason, not with a parting."""
    from fastapi import FastAPI

    app_ = FastAPI()

    @app_.get("/v1/models")
    def models():
        return {"data": [{"id": "m", "max_model_len": 4096}]}

    @app_.post("/v1/completions")
    def completions():
        return {"choices": [{"text": "hola", "logprobs": None, "finish_reason": "length"}]}

    tokenizer = Tokenizer.from_source(pack)
    with serve(app_) as base:
        client = EngineClient(f"{base}/v1", tokenizer)
        [result] = run_scenarios(Run(client, GoldenReference(read_sequences(pack)), 1e-3, 4), ["repeat"])
        client.close()
    assert not result.passed and "no logprobs" in result.notes[0]


def test_a_base_url_without_v1_is_told_so(pack, serve):
    """The engine is there but answers 404 at BASE/models: the error names the URL and the missing /v1."""
    from fastapi import FastAPI

    app_ = FastAPI()

    @app_.get("/v1/models")
    def models():
        return {"data": [{"id": "m", "max_model_len": 4096}]}

    with serve(app_) as base:
        result = runner.invoke(app, ["conform", "--engine", base, "--golden", str(pack)])
        assert result.exit_code == 1 and len(result.output.splitlines()) == 1, result.output
        assert f"GET {base}/models: HTTP 404 (an OpenAI-compatible base URL ends in /v1)" in result.output
        result = runner.invoke(
            app, ["conform", "--engine", f"{base}/v1", "--golden", str(pack), "--scenarios", "tokenize"]
        )
        assert "ends in /v1" not in result.output


def test_a_streamed_pack_interrupted_resumes_from_its_scratch(checkpoint, tmp_path, monkeypatch):
    """`k3 golden write` through `k3 stream` keeps each pass's state under OUT/scratch: stopped after a few
    layers of its scoring pass, it is run again and goes on from the last committed layer (not from the
    first), and the pack is bit for bit the one an uninterrupted run writes; the scratch is gone after."""
    from k3.stream.runner import StreamRun
    from k3.stream.scratch import Scratch

    kwargs = dict(continuation=1, via_stream=True, long_tokens=64)
    write_golden(checkpoint, tmp_path / "whole", **kwargs)
    commit, commits = Scratch.commit, []

    def stop_in_scoring(self, progress, streams):
        commit(self, progress, streams)
        commits.append(self.directory.name)
        if commits.count("score") == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(Scratch, "commit", stop_in_scoring)
    with pytest.raises(KeyboardInterrupt):
        write_golden(checkpoint, tmp_path / "resumed", **kwargs)
    monkeypatch.setattr(Scratch, "commit", commit)
    assert (tmp_path / "resumed" / "scratch" / "score" / "state.safetensors").is_file()
    run_pass, starts = StreamRun._pass, []

    def spy(self, tokens, start_layer, streams):
        starts.append((self.scratch.directory.name, self.pass_index, start_layer))
        return run_pass(self, tokens, start_layer, streams)

    monkeypatch.setattr(StreamRun, "_pass", spy)
    write_golden(checkpoint, tmp_path / "resumed", **kwargs)
    assert starts[0][0] == "generate" and starts[0][2] > 0  # its last pass was whole: only the output read
    assert ("score", 0, 3) in starts and ("score", 0, 0) not in starts, starts
    assert not (tmp_path / "resumed" / "scratch").exists()
    for name in ("data.safetensors", "logits.safetensors", "prompts.jsonl"):
        assert (tmp_path / "resumed" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


def test_the_pack_holds_the_image_chats_computed_with_their_pixels(pack, checkpoint):
    """With a vision tower the pack holds the `images` scenario's chats, each with its images' content
    hashes: the second chat (the first's ids, other pixels) is its own forward with its own image, and
    GoldenReference tells the two apart by those hashes."""
    chats = image_chats()
    name, messages, images = chats[1]
    manifest = json.loads((pack / "manifest.json").read_text())
    i = next(i for i, s in enumerate(manifest["sequences"]) if s["name"] == name)
    assert manifest["sequences"][i]["images"] == [im.key for im in images]
    data = load_file(pack / "data.safetensors")
    ids = data[f"seq.{i}.ids"].tolist()
    assert ids[: manifest["sequences"][i]["prompt_tokens"]] == chat_ids(
        Tokenizer.from_source(checkpoint), messages, images
    )
    model = reference_model(checkpoint)
    with torch.no_grad():
        lp = model(torch.tensor([ids]), images=[im.item for im in images])[0].double().log_softmax(-1)
    assert (data[f"seq.{i}.top_logprobs"].double() - lp.topk(20, -1).values).abs().max() < 1e-5
    golden, [a] = GoldenReference(read_sequences(pack)), chats[0][2]
    first = manifest["sequences"][i]["prompt_tokens"]  # the first generated token: after the prompt
    [with_b] = golden.expect(ids, [first], images)
    [with_a] = golden.expect(ids, [first], [a])  # the first chat: the same ids, image a
    assert with_b.top_logprobs == pytest.approx(lp[first - 1].topk(20).values.tolist(), abs=1e-5)
    assert with_a.top_logprobs != pytest.approx(with_b.top_logprobs, abs=1e-3)
    with pytest.raises(ReferenceError, match="and these 2 images"):
        golden.expect(ids, [first], [a, *images])
