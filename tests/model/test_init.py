"""`k3 init` / init_checkpoint: the published layout, k3's validation, loading back, sane activations."""

from __future__ import annotations

import json
import re

import pytest
import torch
import typer
from safetensors import safe_open
from typer.testing import CliRunner

from k3.checkpoint import open_checkpoint
from k3.checkpoint.writer import with_converter_keys
from k3.config import K3Config
from k3.layout import checkpoint_tensors
from k3.model import K3ForCausalLM, K3ForConditionalGeneration
from k3.model.commands import init

# Every tensor name pattern of K3.md section 3, with its published dtype.
P = r"language_model\.model\."
L = P + r"layers\.\d+\."
SPEC_PATTERNS = {
    P + r"embed_tokens\.weight": "BF16",
    P + r"norm\.weight": "BF16",
    r"language_model\.lm_head\.weight": "BF16",
    P + r"output_attn_res_norm\.weight": "BF16",
    P + r"output_attn_res_proj\.weight": "BF16",
    L + r"(input_layernorm|post_attention_layernorm)\.weight": "BF16",
    L + r"(self_attention|mlp)_res_(norm|proj)\.weight": "BF16",
    L + r"self_attn\.[qkv]_proj\.weight": "BF16",
    L + r"self_attn\.[qkv]_conv1d\.weight": "F32",
    L + r"self_attn\.f_[ab]_proj\.weight": "BF16",
    L + r"self_attn\.A_log": "F32",
    L + r"self_attn\.dt_bias": "F32",
    L + r"self_attn\.b_proj\.weight": "BF16",
    L + r"self_attn\.g_proj\.weight": "BF16",
    L + r"self_attn\.o_norm\.weight": "F32",
    L + r"self_attn\.o_proj\.weight": "BF16",
    L + r"self_attn\.(q_a_proj|q_a_layernorm|q_b_proj)\.weight": "BF16",
    L + r"self_attn\.(kv_a_proj_with_mqa|kv_a_layernorm|kv_b_proj)\.weight": "BF16",
    P + r"layers\.0\.mlp\.(gate|up|down)_proj\.weight": "BF16",
    L + r"block_sparse_moe\.gate\.weight": "BF16",
    L + r"block_sparse_moe\.gate\.e_score_correction_bias": "F32",
    L + r"block_sparse_moe\.routed_expert_(down|up)_proj\.weight": "BF16",
    L + r"block_sparse_moe\.routed_expert_norm\.weight": "BF16",
    L + r"block_sparse_moe\.experts\.\d+\.w[123]\.weight_(packed|scale)": "U8",
    L + r"block_sparse_moe\.shared_experts\.(gate|up|down)_proj\.weight": "BF16",
    # the vision path (K3-vision.md section 3): BF16, no biases
    r"vision_tower\.patch_embed\.(proj|pos_emb)\.weight": "BF16",
    r"vision_tower\.encoder\.blocks\.\d+\.(norm0|norm1|wqkv|wo|mlp\.fc0|mlp\.fc1)\.weight": "BF16",
    r"vision_tower\.encoder\.final_layernorm\.weight": "BF16",
    r"mm_projector\.(proj\.0|proj\.2|post_norm)\.weight": "BF16",
}


@pytest.fixture(scope="module")
def tiny_init(tmp_path_factory):
    out = tmp_path_factory.mktemp("init") / "tiny"
    app = typer.Typer()
    app.command("init")(init)
    app.command("unused")(lambda: None)  # two commands: typer keeps the `init` subcommand name
    result = CliRunner().invoke(app, ["init", "--preset", "tiny", "--seed", "5", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_every_spec_pattern_with_its_dtype(tiny_init):
    with open_checkpoint(tiny_init) as ckpt:
        found = {t.name: t for t in ckpt.tensors()}
    for pattern, dtype in SPEC_PATTERNS.items():
        hits = [t for n, t in found.items() if re.fullmatch(pattern, n)]
        assert hits, f"no tensor matches {pattern}"
        assert {t.dtype for t in hits} == {dtype}, pattern
    unmatched = [n for n in found if not any(re.fullmatch(p, n) for p in SPEC_PATTERNS)]
    assert not unmatched
    # and exactly the names, shapes and dtypes of the layout table
    cfg = K3Config.preset("tiny")
    layout = {s.name: (s.dtype, s.shape) for s in checkpoint_tensors(cfg)}
    assert {n: (t.dtype, tuple(t.shape)) for n, t in found.items()} == layout
    kda = "language_model.model.layers.1.self_attn."
    assert found[kda + "A_log"].shape == (max(cfg.kda_num_heads, cfg.kda_head_dim),)
    w2 = "language_model.model.layers.1.block_sparse_moe.experts.7.w2."
    assert tuple(found[w2 + "weight_packed"].shape) == (cfg.expert_input_size, cfg.moe_intermediate_size // 2)
    assert tuple(found[w2 + "weight_scale"].shape) == (cfg.expert_input_size, cfg.moe_intermediate_size // 32)


def test_passes_validation_with_config_and_index(tiny_init):
    with open_checkpoint(tiny_init) as ckpt:
        assert ckpt.findings == []
        # the preset, plus the keys llama.cpp's converter needs (architectures)
        assert ckpt.config.to_dict() == with_converter_keys(K3Config.preset("tiny").to_dict())
        total = ckpt.total_bytes
    raw = json.loads((tiny_init / "config.json").read_text())
    assert raw["model_type"] == "kimi_k3"
    assert raw["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    index = json.loads((tiny_init / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == total
    assert (tiny_init / "model-00001-of-00001.safetensors").exists()


def test_loads_back_identically(tiny_init):
    model = K3ForConditionalGeneration.from_pretrained(tiny_init)
    state = model.state_dict()
    with safe_open(tiny_init / "model-00001-of-00001.safetensors", "pt") as f:
        for name in f.keys():
            ours = state[
                "lm_head.weight"
                if name == "language_model.lm_head.weight"
                else name.removeprefix("language_model.")
            ]
            stored = f.get_tensor(name)
            assert ours.dtype == stored.dtype and torch.equal(ours, stored), name
    # from_config draws the same values as `k3 init` for the same seed
    fresh = K3ForConditionalGeneration.from_config(K3Config.preset("tiny"), seed=5).state_dict()
    for name, t in state.items():
        assert torch.equal(fresh[name], t.float() if t.is_floating_point() else t), name


def test_seed_changes_weights(tiny_init):
    a = K3ForCausalLM.from_config(K3Config.preset("tiny"), seed=5).lm_head.weight
    b = K3ForCausalLM.from_config(K3Config.preset("tiny"), seed=6).lm_head.weight
    assert not torch.equal(a, b)


def test_init_keeps_mini_activations_sane():
    cfg = K3Config.preset("mini")
    model = K3ForCausalLM.from_config(cfg, seed=0)
    sizes = []

    def record(module, inputs, output):
        sizes.append(output.float().pow(2).mean().sqrt().item())

    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(record)
        layer.ffn.register_forward_hook(record)
    ids = torch.randint(0, cfg.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids)
    assert len(sizes) == 2 * cfg.num_hidden_layers
    assert all(0.01 < s < 10 for s in sizes), sizes  # every sublayer writes O(1) updates
    assert logits.isfinite().all() and 0.3 < logits.std() < 3


def test_k3_init_counts_every_file_it_writes(tmp_path):
    """`k3 init` (weights + the built-in tokenizer) says as many files as the folder holds."""
    from k3.cli import app as k3_app

    result = CliRunner().invoke(k3_app, ["init", str(tmp_path / "ckpt"), "--preset", "tiny"])
    assert result.exit_code == 0, result.output
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    said = " ".join(result.output.split())  # the console wraps a long path's line at its width
    assert "tiktoken.model" in files and f": {len(files)} files," in said, (files, result.output)
