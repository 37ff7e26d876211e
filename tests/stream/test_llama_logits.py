"""llama.cpp's --kl-divergence-base files in `k3 stream compare`: planted files, written here by an encoder
transcribed from llama.cpp's tools/perplexity/perplexity.cpp (log_softmax with uint16 output, nearest_int),
independently of the reader; and (slow) llama-cpp-python's logits_all scores of `k3 export gguf`'s file,
dumped with the snippet of docs/stream.md, against `k3 stream` of the same checkpoint."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from k3.cli import app
from k3.config import K3Config
from k3.stream.api import stream_to_dir
from k3.stream.compare import CompareError, Logits, compare_logits, read_logits
from k3.stream.llama_logits import KldFileError
from k3.stream.runner import StreamOptions
from k3.tokenizer.build import write_tokenizer

N_CTX = 16
DOCS = Path(__file__).resolve().parents[2] / "docs" / "stream.md"


def encode_position(logits: np.ndarray) -> np.ndarray:
    """One position as perplexity.cpp stores it: [scale, min_log_prob] as 2 float32, then uint16 codes."""
    x = logits.astype(np.float32)
    max_logit = np.float32(x.max())
    min_logit = np.float32(max(x.min(), max_logit - np.float32(16)))
    sum_exp = float(np.exp((x - max_logit).astype(np.float32)).astype(np.float64).sum())
    log_sum_exp = np.float32(np.log(sum_exp))
    min_log_prob = np.float32(min_logit - max_logit - log_sum_exp)
    scale = np.float32((max_logit - min_logit) / np.float32(65535))
    codes = np.zeros(2 * ((len(x) + 1) // 2), dtype=np.uint16)
    if scale:
        q = np.rint(np.float32(1 / scale) * (x - min_logit)).astype(np.int64)  # nearest_int: to even
        codes[: len(x)] = np.where(x > min_logit, q, 0)
    head = np.array([scale, min_log_prob], dtype=np.float32).view(np.uint16)
    return np.concatenate([head, codes])


def write_kld(path: Path, tokens: np.ndarray, logits: np.ndarray) -> None:
    """tokens [n_chunk, n_ctx], logits [n_chunk, n_ctx, V]: the positions n_ctx/2 .. n_ctx-2 are stored."""
    n_chunk, n_ctx, V = logits.shape
    with open(path, "wb") as f:
        f.write(b"_logits_")
        f.write(np.array([n_ctx, V, n_chunk], dtype="<i4").tobytes())
        f.write(tokens.astype("<i4").tobytes())
        for c in range(n_chunk):
            for j in range(n_ctx // 2, n_ctx - 1):
                f.write(encode_position(logits[c, j]).astype("<u2").tobytes())


@pytest.fixture(scope="module")
def streamed(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    gen = torch.Generator().manual_seed(4)
    prompts = torch.randint(1, 500, (2, N_CTX), generator=gen).tolist()
    stream_to_dir(checkpoints("tiny"), prompts, out, StreamOptions(all_positions=True))
    return out, prompts


def test_a_planted_kld_file_agrees_to_its_16_bit_resolution(streamed, tmp_path):
    out, prompts = streamed
    logits = read_logits(out).values.numpy()  # [2, 16, V], k3's own: the other engine agrees exactly
    tokens = np.array(prompts)
    tokens[:, 0] = 999  # llama.cpp stores the text's token where the model saw BOS
    write_kld(tmp_path / "base.kld", tokens, logits)
    rows = compare_logits(read_logits(out), read_logits(tmp_path / "base.kld"))
    for r in rows:
        assert r.positions == N_CTX - 1 - N_CTX // 2
        assert r.max_abs <= 3e-4  # 16 log units over 65535 steps: half a step, plus float32 rounding
        assert r.kl_max < 1e-6 and r.top1 == 1.0 and r.top5 == 1.0
        assert r.first_over_tolerance is None and r.first_top1_mismatch is None

    planted = logits.copy()
    planted[1, 10, int(planted[1, 10].argmin())] += 5.0  # one logit of prompt 1, position 10
    write_kld(tmp_path / "planted.kld", tokens, planted)
    rows = compare_logits(read_logits(out), read_logits(tmp_path / "planted.kld"))
    assert rows[0].first_over_tolerance is None
    assert rows[1].first_over_tolerance == 10 and rows[1].max_abs > 1.0
    result = CliRunner().invoke(app, ["stream", "compare", str(out), str(tmp_path / "planted.kld"), "--json"])
    assert result.exit_code == 0, result.output
    assert [r["first_over_tolerance"] for r in json.loads(result.output)] == [None, 10]


def test_kld_files_that_do_not_fit_are_errors(streamed, tmp_path):
    out, prompts = streamed
    logits = read_logits(out).values.numpy()
    tokens = np.array(prompts)
    write_kld(tmp_path / "base.kld", tokens, logits)
    data = (tmp_path / "base.kld").read_bytes()
    (tmp_path / "short.kld").write_bytes(data[:-2])
    with pytest.raises(KldFileError, match="truncated"):
        read_logits(tmp_path / "short.kld")
    other = tokens.copy()
    other[1, 5] += 1
    write_kld(tmp_path / "other.kld", other, logits)
    with pytest.raises(CompareError, match="prompt 1: .* position 5"):
        compare_logits(read_logits(out), read_logits(tmp_path / "other.kld"))
    with pytest.raises(CompareError, match="--all-positions"):
        compare_logits(Logits(read_logits(out).values[:, -1]), read_logits(tmp_path / "base.kld"))


def llama_cpp_snippet() -> str:
    """The llama-cpp-python example of docs/stream.md (the python block after 'From llama-cpp-python')."""
    return re.search(r"From llama-cpp-python.*?```python\n(.*?)```", DOCS.read_text(), re.S).group(1)


@pytest.mark.slow
def test_llama_cpp_python_on_the_exported_gguf(checkpoints, tmp_path, monkeypatch):
    """llama.cpp runs `k3 export gguf`'s file (F32, experts decoded exactly, F32 KV cache); its scores,
    dumped with the documented snippet, agree with `k3 stream` of the checkpoint."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is a benchmark tool, never a CI dependency")
    from k3.export.gguf import export_gguf

    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints("tiny"), ckpt)
    write_tokenizer(ckpt, K3Config.preset("tiny").vocab_size)  # the GGUF carries the vocabulary
    export_gguf(ckpt, tmp_path / "k3.gguf", experts="f32")
    prompts = [np.random.default_rng(5).integers(0, 768, n).tolist() for n in (24, 9)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    monkeypatch.chdir(tmp_path)
    exec(compile(llama_cpp_snippet(), str(DOCS), "exec"), {})
    ours = stream_to_dir(ckpt, prompts, tmp_path / "out", StreamOptions(all_positions=True))
    rows = compare_logits(read_logits(tmp_path / "out"), read_logits(tmp_path / "llama.safetensors"))
    scale = float(ours.outputs["logits"].abs().max())
    for r, p in zip(rows, prompts, strict=True):
        print(f"prompt {r.prompt}: max |d| / max |logit| {r.max_abs / scale:.2e}, KL max {r.kl_max:.1e}")
        assert r.positions == len(p)
        assert r.max_abs <= 2e-4 * scale and r.top1 == 1.0
