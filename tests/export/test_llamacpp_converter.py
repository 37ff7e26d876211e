"""The export against llama.cpp's own converter: same tensors (bytes), metadata and vocabulary.

Slow and optional: set LLAMA_CPP_SRC to a llama.cpp source tree with `convert_hf_to_gguf.py` (for example
`vendor/llama.cpp` of the llama-cpp-python 0.3.36 sdist). The converter runs in a subprocess with its own
`gguf-py`; its tokenizer step is given an object with the interface of Moonshot's `tokenization_kimi.py`
built from k3's `tiktoken.model`, and k3's synthetic BPE (whose pre-tokenizer hash llama.cpp does not know)
is declared `kimi-k2`, the split k3 uses.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from k3.export.gguf import export_gguf

pytestmark = pytest.mark.slow

CONVERT = """
import json, runpy, sys
src, ckpt, out, outtype = sys.argv[1:5]
sys.path[:0] = [src + "/gguf-py", src]
import transformers
from k3.tokenizer.kimi import Tokenizer

class MoonshotLikeTokenizer:
    def __init__(self, directory):
        self._t = Tokenizer.from_dir(directory)
        self.model, self.special_tokens = self._t._enc, self._t.special_tokens
        self.eos_id, self.bos_id = self._t.special.eos, self._t.special.bos
    def encode(self, text, **kwargs):
        return self._t.encode(text)

def from_pretrained(path, *args, trust_remote_code=False, **kwargs):
    if trust_remote_code:
        return MoonshotLikeTokenizer(path)
    raise OSError("no transformers tokenizer: take the Kimi (tiktoken) branch")

transformers.AutoTokenizer.from_pretrained = from_pretrained
from conversion.kimi_linear import KimiLinearModel
from conversion.kimi_k3 import KimiK3Model
for cls in (KimiLinearModel, KimiK3Model):
    cls.get_vocab_base_pre = lambda self, tokenizer: "kimi-k2"
sys.argv = [src + "/convert_hf_to_gguf.py", ckpt, "--outfile", out, "--outtype", outtype]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""
ONLY_K3 = {"tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token"}  # what k3 adds
ONLY_CONVERTER = {"general.size_label"}  # what k3 does not write
OWN = {"tokenizer.chat_template"}  # k3 writes its own (K3's chat format); the converter, llama.cpp's


def converter_output(src: str, ckpt: Path, out: Path, outtype: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-c", CONVERT, src, str(ckpt), str(out), outtype],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("which,outtype", [("k3", "f32"), ("k3", "q8_0"), ("kimi_linear", "bf16")])
def test_same_file_as_llama_cpp_converter(which, outtype, k3_tiny, kimi_linear_tiny_ckpt, tmp_path):
    src = os.environ.get("LLAMA_CPP_SRC")
    if not src or not (Path(src) / "convert_hf_to_gguf.py").exists():
        pytest.skip("set LLAMA_CPP_SRC to a llama.cpp tree with convert_hf_to_gguf.py")
    ckpt = k3_tiny if which == "k3" else kimi_linear_tiny_ckpt
    converter_output(src, ckpt, tmp_path / "theirs.gguf", outtype)
    export_gguf(ckpt, tmp_path / "ours.gguf", outtype=outtype)
    ours, theirs = GGUFReader(tmp_path / "ours.gguf"), GGUFReader(tmp_path / "theirs.gguf")

    def fields(r, drop):
        return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.") and k not in drop}

    # the directory name, and Kimi Linear's value_length (k3: kv_lora_rank; the converter: an unused head_dim)
    drop = {"general.name"} | ({"kimi-linear.attention.value_length"} if which == "kimi_linear" else set())
    fo, ft = fields(ours, ONLY_K3 | OWN | drop), fields(theirs, ONLY_CONVERTER | OWN | drop)
    assert fo.keys() == ft.keys()
    for key, value in ft.items():
        assert fo[key] == (pytest.approx(value) if isinstance(value, float) else value), key
    to, tt = {t.name: t for t in ours.tensors}, {t.name: t for t in theirs.tensors}
    assert to.keys() == tt.keys()
    for name, t in tt.items():
        assert to[name].tensor_type == t.tensor_type and list(to[name].shape) == list(t.shape), name
        assert np.array_equal(np.asarray(to[name].data).view(np.uint8), np.asarray(t.data).view(np.uint8)), (
            name
        )
