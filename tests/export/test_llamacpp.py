"""The exported GGUF opened by llama.cpp itself (llama-cpp-python): logits of the same ids agree with k3's.

Slow and optional: deselected in CI (`-m slow` runs it); skipped where llama-cpp-python is not installed
(`pip install llama-cpp-python==0.3.36`, which compiles llama.cpp). F32 weights and an F32 KV cache; K3
with its experts exactly decoded (`--experts f32`), since llama.cpp's CPU path rounds the activations of
MXFP4 matmuls to 8 bits (docs/llamacpp.md).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from k3.export.gguf import export_gguf
from k3.model import K3ForCausalLM

pytestmark = pytest.mark.slow
GGML_F32 = 0  # ggml_type of the KV cache


def llama_cpp_logits(path, ids: list[int]) -> np.ndarray:
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (see docs/llamacpp.md)"
    )
    n = len(ids)
    model = llama_cpp.Llama(
        model_path=str(path), n_ctx=n, n_batch=n, n_ubatch=n, n_threads=2, n_threads_batch=2,
        logits_all=True, type_k=GGML_F32, type_v=GGML_F32, verbose=False,
    )  # fmt: skip
    model.eval(ids)
    return np.array(model.scores[:n], dtype=np.float64)


@pytest.mark.parametrize("which", ["kimi_linear", "k3"])
def test_llama_cpp_logits_match_k3(which, k3_tiny, kimi_linear_tiny_ckpt, tmp_path):
    ckpt = k3_tiny if which == "k3" else kimi_linear_tiny_ckpt
    export_gguf(ckpt, tmp_path / "m.gguf", experts="f32")
    ids = np.random.default_rng(3).integers(0, 768, 96).tolist()  # BPE ranks of the tiny tokenizer
    theirs = llama_cpp_logits(tmp_path / "m.gguf", ids)
    with torch.no_grad():
        ours = (
            K3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32)(torch.tensor([ids]))[0].double().numpy()
        )
    scale = np.abs(ours).max()
    assert scale > 1.0
    assert np.abs(ours - theirs).max() <= 2e-4 * scale
