"""`k3 stream compare` against another engine: transformers' Kimi Linear, dumped with the snippet of
docs/stream.md (run here as written), and a copy of k3's own logits with one logit perturbed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from kimi_linear_oracle import tiny_kimi_linear
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from k3.cli import app
from k3.stream.api import stream_to_dir
from k3.stream.compare import CompareError, compare_logits, read_logits
from k3.stream.runner import StreamOptions

DOCS = Path(__file__).resolve().parents[2] / "docs" / "stream.md"


def docs_snippet() -> str:
    """The transformers example of docs/stream.md (the python block after 'Dumping logits')."""
    text = DOCS.read_text()
    return re.search(r"Dumping logits.*?```python\n(.*?)```", text, re.S).group(1)


def test_against_transformers_dumped_with_the_documented_snippet(tmp_path, monkeypatch):
    oracle = tiny_kimi_linear(num_layers=4)
    oracle.save_pretrained(tmp_path / "ckpt")
    prompts = [[3, 14, 15, 92, 65, 35], list(range(40, 80)), [7]]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    monkeypatch.chdir(tmp_path)
    snippet = docs_snippet()
    assert len(snippet.strip().splitlines()) <= 10
    exec(compile(snippet, str(DOCS), "exec"), {})
    options = StreamOptions(all_positions=True, dump_hidden=(0, 2))
    ours = stream_to_dir(tmp_path / "ckpt", prompts, tmp_path / "out", options)
    with torch.no_grad():  # --dump-hidden i is transformers' hidden_states[i + 1] (the residual stream)
        for p, ids in enumerate(prompts):
            hidden = oracle(torch.tensor([ids]), output_hidden_states=True).hidden_states
            for i in (0, 2):
                got, want = ours.outputs[f"hidden.{i}"][p, : len(ids)], hidden[i + 1][0]
                assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    rows = compare_logits(read_logits(tmp_path / "out"), read_logits(tmp_path / "hf.safetensors"))
    scale = float(ours.outputs["logits"].abs().max())
    assert scale > 1.0
    for r, p in zip(rows, prompts, strict=True):
        assert r.positions == len(p)
        assert r.max_abs <= 1e-4 * scale and r.kl_max < 1e-8
        assert r.top1 == 1.0 and r.top5 == 1.0
        assert r.first_over_tolerance is None and r.first_top1_mismatch is None
    result = CliRunner().invoke(
        app, ["stream", "compare", str(tmp_path / "out"), str(tmp_path / "hf.safetensors"), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert [r["positions"] for r in json.loads(result.output)] == [6, 40, 1]


def test_one_perturbed_logit_is_reported_at_its_prompt_and_position(checkpoints, tmp_path):
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13]]
    stream_to_dir(checkpoints("tiny"), prompts, tmp_path / "out", StreamOptions(all_positions=True))
    tensors = load_file(tmp_path / "out" / "logits.safetensors")
    logits = tensors["logits"].clone()
    top = int(logits[1, 6].argmax())
    logits[1, 6, (top + 1) % logits.shape[-1]] += 50.0  # a new top-1 at prompt 1, position 6
    save_file(
        {"logits": logits.to(torch.bfloat16), "lengths": tensors["lengths"]}, tmp_path / "other.safetensors"
    )
    rows = compare_logits(
        read_logits(tmp_path / "out"), read_logits(tmp_path / "other.safetensors"), tolerance=1.0
    )
    assert [r.first_over_tolerance for r in rows] == [None, 6, None]  # bf16 rounding stays under 1.0
    assert [r.first_top1_mismatch for r in rows] == [None, 6, None]
    assert rows[1].max_abs > 49 and rows[1].top1 == pytest.approx(9 / 10) and rows[1].kl_max > 1
    result = CliRunner().invoke(
        app,
        ["stream", "compare", str(tmp_path / "out"), str(tmp_path / "other.safetensors"), "--tolerance", "1"],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0 and "6 (top-1 at 6)" in result.output


def test_last_positions_against_every_position_and_bad_files(checkpoints, tmp_path):
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6]]
    every = stream_to_dir(checkpoints("tiny"), prompts, tmp_path / "all", StreamOptions(all_positions=True))
    last = stream_to_dir(checkpoints("tiny"), prompts, tmp_path / "last", StreamOptions())
    assert last.outputs["logits"].shape == (2, 1024)
    rows = compare_logits(read_logits(tmp_path / "all"), read_logits(tmp_path / "last"))
    assert [r.positions for r in rows] == [1, 1] and all(r.max_abs <= 1e-5 for r in rows)
    assert torch.allclose(every.outputs["logits"][1, 5], last.outputs["logits"][1], atol=1e-5)
    stream_to_dir(checkpoints("tiny"), [[5, 6, 7], [1, 2, 3, 4, 9, 6]], tmp_path / "other", StreamOptions())
    with pytest.raises(CompareError, match="prompt 1: the files' token ids differ at position 4"):
        compare_logits(read_logits(tmp_path / "last"), read_logits(tmp_path / "other"))
    stream_to_dir(checkpoints("tiny"), [[5, 6, 7], [1, 2, 3, 4, 5]], tmp_path / "shorter", StreamOptions())
    with pytest.raises(CompareError, match="prompt 1: 6 tokens in one file, 5 in the other"):
        compare_logits(read_logits(tmp_path / "all"), read_logits(tmp_path / "shorter"))
    save_file({"scores": torch.zeros(2, 3)}, tmp_path / "bad.safetensors")
    with pytest.raises(CompareError, match="no tensor 'logits'"):
        read_logits(tmp_path / "bad.safetensors")
    save_file({"logits": torch.zeros(2, 10)}, tmp_path / "small.safetensors")
    with pytest.raises(CompareError, match="vocabularies differ"):
        compare_logits(read_logits(tmp_path / "last"), read_logits(tmp_path / "small.safetensors"))
