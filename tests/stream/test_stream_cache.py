"""The size-capped block cache of `k3 stream URL --cache-dir --cache-size`: later passes (greedy tokens) and
later runs read what they read before from the cache, which the Range server's own byte count proves;
outputs equal an uncached run; over the cap the least recently used ranges go, atomically written."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file
from stream_testing import prompts_for
from typer.testing import CliRunner

from k3.checkpoint import open_checkpoint
from k3.checkpoint.remote import RemoteOptions
from k3.checkpoint.serve import RangeServer
from k3.cli import app
from k3.stream.api import stream_logits
from k3.stream.plan import StreamPlan
from k3.stream.runner import StreamOptions

OPTIONS = StreamOptions(max_new_tokens=3, all_positions=True)


def cache_files(directory):
    return [p for p in directory.rglob("*") if p.is_file()]


def test_later_passes_and_runs_read_from_the_cache(checkpoints, tmp_path):
    ckpt = checkpoints("k3ish")
    with open_checkpoint(ckpt) as c:
        plan = StreamPlan(c)
        prompts = prompts_for(c.config.vocab_size, (7, 3, 12))
    reference = stream_logits(ckpt, prompts, OPTIONS)
    remote = RemoteOptions(cache_dir=tmp_path / "cache")
    with RangeServer(ckpt) as server:
        server.reset_counters()
        open_checkpoint(server.url, remote=RemoteOptions(cache_dir=tmp_path / "probe")).close()
        opening = server.bytes_served  # config, index, headers (read through cache blocks, as the run does)
        server.reset_counters()
        first = stream_logits(server.url, prompts, OPTIONS, remote=remote)
        touched = {
            (int(layer), e)
            for p in first.summary["experts_touched_ids"]
            for layer, ids in p.items()
            for e in ids
        }
        generated = first.outputs["generated"]
        passes = [{t for p in prompts for t in p}, *({int(t) for t in generated[:, j]} for j in (0, 1))]
        embed = {span for ids in passes for span in plan.embed_rows(sorted(ids)).spans()}  # distinct ranges
        distinct = sum(plan.expert_bytes(layer, e) for layer, e in touched) + plan.layer_bytes
        distinct += sum(span.nbytes for span in embed)
        assert first.summary["bytes_read"] > distinct  # 3 passes read the dense stages 3 times,
        assert server.bytes_served == opening + distinct  # but each range went out once
        assert first.summary["http"]["cache_hits"] > 0
        for name, tensor in reference.outputs.items():
            assert torch.equal(first.outputs[name], tensor), name

        server.reset_counters()
        again = stream_logits(server.url, prompts, OPTIONS, remote=remote)
        probes = {f"bytes=0-{RemoteOptions().first_read - 1}", None}  # shard openings; config and index
        assert {header for _, header in server.requests} <= probes  # a second run: nothing else fetched
        assert again.summary["http"]["cache_hits"] >= again.summary["reads"]  # + the header blocks
        assert torch.equal(again.outputs["logits"], reference.outputs["logits"])
    assert not any(p.name.startswith(".tmp-") for p in cache_files(tmp_path / "cache"))


def test_the_cache_stays_under_its_cap(checkpoints, tmp_path):
    ckpt = checkpoints("k3ish")
    with open_checkpoint(ckpt) as c:
        prompts = prompts_for(c.config.vocab_size, (5, 2))
        cap = max(s.nbytes for s in StreamPlan(c).mixer) * 3
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    reference = stream_logits(ckpt, prompts, StreamOptions(max_new_tokens=2))
    with RangeServer(ckpt) as server:
        args = ["stream", server.url, "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "out")]
        args += ["--max-new-tokens", "2", "--cache-dir", str(tmp_path / "cache"), "--cache-size", str(cap)]
        args += ["--threads", "1"]  # the reference's: bits hold at one thread count (k3.ops.reproducible)
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
    files = cache_files(tmp_path / "cache")
    assert files and sum(p.stat().st_size for p in files) <= cap
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["http"]["cache_hits"] < summary["reads"]  # evicted ranges were fetched again
    out = load_file(tmp_path / "out" / "logits.safetensors")
    assert torch.equal(out["generated"], reference.outputs["generated"])
    assert torch.equal(out["logits"], reference.outputs["logits"])
