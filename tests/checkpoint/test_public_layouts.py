"""The public K3 checkpoints as k3 writes them (`k3 init --like NAME`), against the tables of
../shared/spec/checkpoints.md written out here by hand; which weights are packed, read from the checkpoint
and driven by the release's quantization_config; formats k3 does not implement refused by name; the
config traps named once each."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.utils.match import match_name

from k3.checkpoint import open_checkpoint
from k3.checkpoint.public import PUBLIC_LAYOUTS, public_tensors
from k3.checkpoint.traps import config_traps, special_id
from k3.config import ConfigError, K3Config, preset_text
from k3.errors import K3Error
from k3.layout import published_tensors
from k3.model import K3ForCausalLM
from k3.model.init import init_checkpoint, init_like
from k3.ops.mxfp4 import MXFP4Linear

DATA = Path(__file__).parent / "data"
RELEASE = json.loads((DATA / "kimi-k3-release-config.json").read_text())
CT_SCHEME = QuantizationScheme(
    targets=["Linear"],
    weights=QuantizationArgs(
        num_bits=4, type="float", strategy="group", group_size=32, symmetric=True, scale_dtype=torch.uint8
    ),
)
T, V = "language_model.model.", "vision_tower."


def table_040b(packed: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """checkpoints.md 2.3 (and 3 for the MXFP4 one): every tensor of the 0.40B, {name: (shape, dtype)}."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}

    def put(name: str, shape: tuple[int, ...]) -> None:
        out[name] = (shape, "F32")

    def linear(name: str, o: int, i: int, pack: bool) -> None:
        if pack:  # weight_packed [out, in/2] + weight_scale [out, in/32], U8
            out[f"{name}.weight_packed"], out[f"{name}.weight_scale"] = (
                ((o, i // 2), "U8"),
                ((o, i // 32), "U8"),
            )
        else:
            put(f"{name}.weight", (o, i))

    put("language_model.lm_head.weight", (163840, 1024))
    put(f"{T}embed_tokens.weight", (163840, 1024))
    put(f"{T}norm.weight", (1024,))
    put(f"{T}output_attn_res_norm.weight", (1024,))
    put(f"{T}output_attn_res_proj.weight", (1, 1024))
    for n in range(8):
        L = f"{T}layers.{n}."
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "self_attention_res_norm",
            "mlp_res_norm",
        ):
            put(f"{L}{norm}.weight", (1024,))
        put(f"{L}self_attention_res_proj.weight", (1, 1024))
        put(f"{L}mlp_res_proj.weight", (1, 1024))
        a = f"{L}self_attn."
        if n in (3, 7):  # MLA
            for name, shape in (
                ("q_a_proj.weight", (256, 1024)),
                ("q_a_layernorm.weight", (256,)),
                ("q_b_proj.weight", (768, 256)),
                ("kv_a_proj_with_mqa.weight", (160, 1024)),
                ("kv_a_layernorm.weight", (128,)),
                ("kv_b_proj.weight", (1024, 128)),
                ("g_proj.weight", (512, 1024)),
                ("o_proj.weight", (1024, 512)),
            ):
                put(a + name, shape)
        else:  # KDA
            for x in "qkv":
                put(f"{a}{x}_proj.weight", (256, 1024))
                put(f"{a}{x}_conv1d.weight", (256, 1, 4))
            for name, shape in (
                ("f_a_proj.weight", (32, 1024)),
                ("f_b_proj.weight", (256, 32)),
                ("b_proj.weight", (8, 1024)),
                ("g_proj.weight", (256, 1024)),
                ("o_norm.weight", (32,)),
                ("o_proj.weight", (1024, 256)),
                ("dt_bias", (256,)),
                ("A_log", (32,)),  # 8 heads; the stored length is uncertain (spec: [8] or zero-padded)
            ):
                put(a + name, shape)
        if n == 0:
            put(f"{L}mlp.gate_proj.weight", (2048, 1024))
            put(f"{L}mlp.up_proj.weight", (2048, 1024))
            put(f"{L}mlp.down_proj.weight", (1024, 2048))
            continue
        m = f"{L}block_sparse_moe."
        put(f"{m}gate.weight", (8, 1024))
        put(f"{m}gate.e_score_correction_bias", (8,))
        put(f"{m}routed_expert_norm.weight", (512,))
        linear(f"{m}routed_expert_down_proj", 512, 1024, packed)
        linear(f"{m}routed_expert_up_proj", 1024, 512, packed)
        linear(f"{m}shared_experts.gate_proj", 256, 1024, packed)
        linear(f"{m}shared_experts.up_proj", 256, 1024, packed)
        linear(f"{m}shared_experts.down_proj", 1024, 256, packed)
        for e in range(8):
            linear(f"{m}experts.{e}.w1", 256, 512, packed)
            linear(f"{m}experts.{e}.w3", 256, 512, packed)
            linear(f"{m}experts.{e}.w2", 512, 256, packed)
    for b in range(2):
        B = f"{V}encoder.blocks.{b}."
        put(f"{B}wqkv.weight", (4608, 256))
        put(f"{B}wo.weight", (256, 1536))
        put(f"{B}mlp.fc0.weight", (512, 256))
        put(f"{B}mlp.fc1.weight", (256, 512))
        put(f"{B}norm0.weight", (256,))
        put(f"{B}norm1.weight", (256,))
    put(f"{V}encoder.final_layernorm.weight", (256,))
    put(f"{V}patch_embed.pos_emb.weight", (64, 64, 256))
    put(f"{V}patch_embed.proj.weight", (256, 3, 14, 14))
    put("mm_projector.proj.0.weight", (1024, 1024))
    put("mm_projector.proj.2.weight", (1024, 1024))
    put("mm_projector.post_norm.weight", (1024,))
    return out


def layout_of(name: str) -> dict[str, tuple[tuple[int, ...], str]]:
    return {s.name: (s.shape, s.dtype) for s in public_tensors(PUBLIC_LAYOUTS[name])}


@pytest.mark.parametrize(("name", "packed"), [("kimi-k3-0.40b", False), ("kimi-k3-0.40b-mxfp4", True)])
def test_040b_layouts_equal_the_spec_tables(name, packed):
    table = table_040b(packed)
    assert layout_of(name) == table
    text = [n for n in table if n.startswith("language_model.")]
    assert len(text) - (168 * (2 if packed else 1)) - (35 * 2 if packed else 0) == 212 - (35 if packed else 0)
    assert len(table) == (398 if not packed else 398 + 203)  # 203 packed weights: 406 U8 tensors
    assert sum(dtype == "U8" for _, dtype in table.values()) == (406 if packed else 0)


def test_4layer_layout_spot_checks():
    layout = layout_of("kimi-k3-4layer")
    m = f"{T}layers.1.block_sparse_moe."
    assert layout[f"{m}gate.weight"] == ((128, 7168), "BF16")
    assert layout[f"{m}gate.e_score_correction_bias"] == ((128,), "F32")
    assert layout[f"{m}experts.127.w1.weight"] == ((3072, 3584), "BF16")
    assert layout[f"{m}experts.0.w2.weight"] == ((3584, 3072), "BF16")
    assert f"{m}experts.128.w1.weight" not in layout
    assert layout[f"{T}layers.0.self_attn.A_log"] == ((128,), "F32")
    assert layout[f"{T}layers.0.self_attn.dt_bias"] == ((12288,), "F32")
    assert layout[f"{T}layers.2.self_attn.q_conv1d.weight"] == ((12288, 1, 4), "F32")
    assert layout[f"{T}layers.3.self_attn.kv_b_proj.weight"] == ((24576, 512), "BF16")
    assert layout[f"{T}layers.0.mlp.down_proj.weight"] == ((7168, 33792), "BF16")
    assert layout[f"{V}encoder.blocks.26.wqkv.weight"] == ((4608, 1024), "BF16")
    assert layout["mm_projector.proj.2.weight"] == ((7168, 4096), "BF16")
    assert not any(dtype == "U8" for _, dtype in layout.values())
    assert not any(".layers.4." in n for n in layout)
    assert sum(n.startswith(V) for n in layout) == 165  # the release's tower, copied unchanged
    raw = json.loads(preset_text("kimi-k3-4layer"))
    assert "quantization_config" not in raw["text_config"]
    assert (
        raw["text_config"]["attn_res_block_size"] == 2 and raw["text_config"]["num_experts_per_token"] == 16
    )


def test_configs_are_the_published_files():
    published = preset_text("kimi-k3-0.40b").encode()
    assert len(published) == 4004 and hashlib.sha256(published).hexdigest().startswith("503bd5d1")
    release = (DATA / "kimi-k3-release-config.json").read_bytes()
    assert len(release) == 7006 and hashlib.sha256(release).hexdigest().startswith("9710e121")
    mxfp4 = json.loads(preset_text("kimi-k3-0.40b-mxfp4"))
    del mxfp4["text_config"]["quantization_config"]
    assert mxfp4 == json.loads(published)  # the F32 config plus the (reconstructed) quantization_config


def test_the_release_quantization_config_drives_what_k3_packs():
    """Packed when written: the routed experts only. compressed-tensors' own matcher says every packed
    weight is spared by the published ignore list and every ignored one is left plain; the router and the
    latent projections are neither ignored nor packed, as in the release's headers."""
    raw = json.loads(json.dumps(RELEASE))
    raw["text_config"].update(num_hidden_layers=4, num_experts=16)
    raw["text_config"]["linear_attn_config"].update(full_attn_layers=[4], kda_layers=[1, 2, 3])
    cfg = K3Config.from_dict(raw)
    ignore = RELEASE["text_config"]["quantization_config"]["ignore"]
    assert json.loads(preset_text("k3"))["text_config"]["quantization_config"]["ignore"] == ignore
    packed, plain = set(), set()
    for spec in published_tensors(cfg):
        module, _, suffix = spec.name.rpartition(".")
        (
            packed
            if suffix == "weight_packed"
            else plain
            if suffix == "weight" and len(spec.shape) == 2
            else set()
        ).add(module)
    assert packed == {m for m in packed if ".experts." in m} and len(packed) == 3 * 16 * 3
    assert not any(any(match_name(m, entry) for entry in ignore) for m in packed)
    spared_plain = {m for m in plain if not any(match_name(m, entry) for entry in ignore)}
    assert {m.rsplit(".", 1)[-1] for m in spared_plain} == {
        "routed_expert_down_proj",
        "routed_expert_up_proj",
        "gate",
        "embed_tokens",  # an Embedding, not a Linear: compressed-tensors' targets leave it out
        "self_attention_res_proj",  # the AttnRes queries [1, H]: BF16 in the release too
        "mlp_res_proj",
        "output_attn_res_proj",
    }
    everything = json.loads(json.dumps(raw))
    everything["text_config"]["quantization_config"]["ignore"].append("re:.*experts.*")
    assert K3Config.from_dict(everything).packed_components == ()


@pytest.mark.parametrize("fmt", ["nvfp4-pack-quantized", "float-quantized", "pack-quantized"])
def test_formats_k3_does_not_implement_are_refused_by_name(fmt, tmp_path):
    raw = json.loads(preset_text("tiny"))
    raw["text_config"]["quantization_config"]["format"] = fmt
    with pytest.raises(ConfigError, match=fmt):
        K3Config.from_dict(raw)
    group = json.loads(preset_text("tiny"))
    group["text_config"]["quantization_config"]["config_groups"]["group_0"]["format"] = fmt
    with pytest.raises(ConfigError, match=fmt):
        K3Config.from_dict(group)
    init_checkpoint(K3Config.preset("tiny"), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(K3Error, match=fmt) as info:
        K3ForCausalLM.from_pretrained(tmp_path)
    assert "\n" not in str(info.value)


def test_quantization_config_at_the_top_level_is_read(tmp_path):
    init_checkpoint(K3Config.preset("tiny"), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = raw["text_config"].pop("quantization_config")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.config is not None and ckpt.config.experts_mxfp4
        assert any("top level" in trap for trap in ckpt.traps)
    K3ForCausalLM.from_pretrained(tmp_path)


def test_packed_latent_and_shared_experts_load_run_and_decode_like_compressed_tensors(tmp_path):
    """A checkpoint that packs what the 0.40B-MXFP4 packs (tiny sizes): the headers alone make k3 build
    MXFP4 latent projections and shared experts; decoded bit for bit as compressed-tensors decodes them;
    the logits those give equal a model holding the decoded weights in plain layers."""
    cfg = K3Config.preset("tiny")
    cfg.mxfp4_components = ("routed_experts", "latent_projections", "shared_experts")
    init_checkpoint(cfg, tmp_path / "packed")
    model = K3ForCausalLM.from_pretrained(tmp_path / "packed", dtype=torch.float32)
    moe = model.model.layers[cfg.first_k_dense_replace].ffn
    modules = [moe.routed_expert_down_proj, moe.routed_expert_up_proj, moe.shared_experts.down_proj]
    assert all(isinstance(m, MXFP4Linear) for m in modules)
    with open_checkpoint(tmp_path / "packed") as ckpt:
        pairs = [n.removesuffix(".weight_packed") for n in ckpt.names if n.endswith(".weight_packed")]
        odd = [p for p in pairs if ".experts." not in p]
        assert len(odd) == 5 * cfg.num_moe_layers
        for p in odd:
            packed, scale = ckpt.read(p + ".weight_packed"), ckpt.read(p + ".weight_scale")
            theirs = MXFP4PackedCompressor.decompress(
                {"weight_packed": packed, "weight_scale": scale}, CT_SCHEME
            )
            ours = MXFP4Linear(packed.shape[1] * 2, packed.shape[0])
            ours.weight_packed, ours.weight_scale = packed, scale
            mine = ours.dequantized_weight(torch.bfloat16)
            assert torch.equal(mine.view(torch.int16), theirs["weight"].view(torch.int16))
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        logits = model(ids)
        cache = model.new_cache(1)  # the cached one-token steps (the fused decode path stands aside)
        model(ids[:, :-1], cache)
        assert torch.allclose(model(ids[:, -1:], cache)[0, -1], logits[0, -1], rtol=1e-4, atol=1e-4)
        for layer in model.model.layers:
            ffn = layer.ffn
            if hasattr(ffn, "routed_expert_down_proj"):
                for owner, name in ((ffn, "routed_expert_down_proj"), (ffn, "routed_expert_up_proj")) + tuple(
                    (ffn.shared_experts, n) for n in ("gate_proj", "up_proj", "down_proj")
                ):
                    packed = getattr(owner, name)
                    plain = torch.nn.Linear(packed.in_features, packed.out_features, bias=False)
                    plain.weight = torch.nn.Parameter(packed.dequantized_weight(torch.float32))
                    setattr(owner, name, plain)
        assert torch.allclose(model(ids), logits, rtol=1e-5, atol=1e-5)


def test_config_traps_are_named_once_each(tmp_path, caplog):
    raw = json.loads(preset_text("kimi-k3-0.40b"))
    headers = {"a": ("F32", (2,)), "b": ("F32", (3, 4))}
    names = [
        "im_end",
        "im_user",
        "im_assistant",
        "start_header_id",
        "end_header_id",
        "im_system",
        "im_middle",
    ]
    added = {f"<|{name}|>": 163840 + i for i, name in enumerate(names)}
    traps = config_traps(raw, headers, added)
    keys = [
        "gate_lower_bound",
        "head_dim 74",
        "rope_theta",
        "bos_token_id 1",
        "eos_token_id 2",
        "pad_token_id 0",
    ]
    keys += ["163840..163846", "F32"]
    assert len(traps) == len(keys) and all(k in t for k, t in zip(keys, traps, strict=True))
    assert config_traps(RELEASE, {"a": ("BF16", (2,)), "b": ("F32", (2,))}) == []
    assert special_id(2, 163585, 163840) == 163585  # 0.40B: the tokenizer's [EOS]
    assert special_id(163586, 163585, 163840) == 163586  # release: <|end_of_msg|>, as the reference stops
    cfg = K3Config.preset("kimi-k3-0.40b")
    assert cfg.kda_gate_lower_bound is None  # the unbounded softplus gate, not -5
    # a small checkpoint carrying the same traps: one warning line each at load
    small = json.loads(preset_text("tiny"))
    small["text_config"].update(head_dim=74, eos_token_id=2, rope_theta=10000.0)
    del small["text_config"]["linear_attn_config"]["gate_lower_bound"]
    init_checkpoint(K3Config.from_dict(small), tmp_path)
    with caplog.at_level(logging.WARNING, logger="k3.checkpoint"):
        K3ForCausalLM.from_pretrained(tmp_path)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4 and all("\n" not in line and line.startswith(str(tmp_path)) for line in lines)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kimi-k3-0.40b", "kimi-k3-0.40b-mxfp4"])
def test_init_like_writes_the_published_files_and_the_model_runs(name, tmp_path):
    """~1.5 GB each: the layout written, read back from the file's own header, loaded and run."""
    files = init_like(name, tmp_path)
    assert sorted(f.name for f in files) == ["added_tokens.json", "config.json", "model.safetensors"]
    assert (tmp_path / "config.json").read_bytes() == preset_text(name).encode()
    assert hashlib.sha256((tmp_path / "added_tokens.json").read_bytes()).hexdigest().startswith("27373c2f")
    with open_checkpoint(tmp_path) as ckpt:
        assert {t.name: (t.shape, t.dtype) for t in ckpt.tensors()} == table_040b(name.endswith("mxfp4"))
        if name.endswith("mxfp4"):
            for p in [n.removesuffix(".weight_packed") for n in ckpt.names if n.endswith(".weight_packed")]:
                packed, scale = ckpt.read(p + ".weight_packed"), ckpt.read(p + ".weight_scale")
                theirs = MXFP4PackedCompressor.decompress(
                    {"weight_packed": packed, "weight_scale": scale}, CT_SCHEME
                )
                ours = MXFP4Linear(packed.shape[1] * 2, packed.shape[0])
                ours.weight_packed, ours.weight_scale = packed, scale
                assert torch.equal(
                    ours.dequantized_weight(torch.bfloat16).view(torch.int16),
                    theirs["weight"].view(torch.int16),
                )
    model = K3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([[18805, 308, 799, 5624, 12524]]))
    assert logits.shape == (1, 5, 163840) and torch.isfinite(logits).all()


def test_a_log_stored_one_entry_per_head_loads_like_the_padded_one(tmp_path):
    """The 0.40B's stored A_log length is not public: [heads] and the zero-padded form give one model."""
    from safetensors.torch import load_file, save_file

    cfg = K3Config.preset("tiny")
    init_checkpoint(cfg, tmp_path / "padded")
    (tmp_path / "heads").mkdir()
    for p in (tmp_path / "padded").iterdir():
        if p.suffix == ".safetensors":
            tensors = load_file(p)
            for name in [n for n in tensors if n.endswith(".A_log")]:
                assert tensors[name].shape[0] > cfg.kda_num_heads
                tensors[name] = tensors[name][: cfg.kda_num_heads].clone()
            save_file(tensors, tmp_path / "heads" / p.name, metadata={"format": "pt"})
        else:
            (tmp_path / "heads" / p.name).write_bytes(p.read_bytes())
    index = json.loads((tmp_path / "heads" / "model.safetensors.index.json").read_text())
    index["metadata"].pop("total_size", None)
    (tmp_path / "heads" / "model.safetensors.index.json").write_text(json.dumps(index))
    ids = torch.tensor([[5, 4, 3, 2, 1]])
    with torch.no_grad():
        padded = K3ForCausalLM.from_pretrained(tmp_path / "padded", dtype=torch.float32)(ids)
        heads = K3ForCausalLM.from_pretrained(tmp_path / "heads", dtype=torch.float32)(ids)
    assert torch.equal(padded, heads)


def test_inspect_shows_what_is_packed_and_why(tmp_path):
    """Headers decide, the ignore list explains: shared experts packed although the (release's) list
    ignores them, the router neither ignored nor packed, attention ignored."""
    from typer.testing import CliRunner

    from k3.cli import app

    cfg = K3Config.preset("tiny")
    cfg.mxfp4_components = ("routed_experts", "shared_experts")
    cfg.quantization_config = json.loads(json.dumps(RELEASE["text_config"]["quantization_config"]))
    init_checkpoint(cfg, tmp_path)
    result = CliRunner().invoke(app, ["inspect", str(tmp_path), "--json", "--filter", r"layers\.1\."])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    why = {r["name"].split("layers.1.", 1)[1]: r.get("packing", "") for r in report["tensors"]}
    assert why["block_sparse_moe.experts.0.w1.weight_packed"].startswith(
        "packed: weight_packed + weight_scale"
    )
    assert "not ignored" in why["block_sparse_moe.experts.0.w1.weight_packed"]
    shared = why["block_sparse_moe.shared_experts.up_proj.weight_scale"]
    assert (
        shared.startswith("packed")
        and "although quantization_config ignores it (re:.*shared_experts.*)" in shared
    )
    assert why["self_attn.o_proj.weight"] == "not packed: ignored by re:.*self_attn.*"
    assert why["block_sparse_moe.gate.weight"].startswith("not packed: BF16 in the header (not ignored")
    assert report["packed"] == cfg.num_moe_layers * (3 * cfg.num_experts + 3)
