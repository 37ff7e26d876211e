"""K3Config: both published forms, round trips, presets and every validation error."""

import copy
import json

import pytest

from k3.config import FFN, PRESETS, ConfigError, K3Config, Mixer

SPEC_CONFIG = "../shared/spec/kimi-k3-config.json"


@pytest.fixture(scope="module")
def k3_raw() -> dict:
    from importlib import resources

    return json.loads(resources.files("k3").joinpath("presets", "k3.json").read_text())


def test_shipped_k3_preset_is_the_published_config(k3_raw):
    from pathlib import Path

    spec = Path(__file__).resolve().parents[2] / "shared" / "spec" / "kimi-k3-config.json"
    if not spec.exists():
        pytest.skip("../shared/spec is not beside this checkout")
    assert json.loads(spec.read_text()) == k3_raw


def test_k3_layer_plan_matches_the_published_lists(k3_raw):
    cfg = K3Config.from_dict(k3_raw)
    lin = k3_raw["text_config"]["linear_attn_config"]
    # Rebuild the plan independently from the 1-indexed lists.
    expected_mla = {i - 1 for i in lin["full_attn_layers"]}
    for plan in cfg.layer_plan:
        assert plan.mixer is (Mixer.MLA if plan.index in expected_mla else Mixer.KDA)
        assert plan.ffn is (FFN.DENSE if plan.index == 0 else FFN.MOE)
    assert [p.index for p in cfg.layer_plan if p.mixer is Mixer.MLA][-2:] == [91, 92]
    assert cfg.kda_proj_size == 96 * 128
    assert cfg.qk_head_dim == 192
    assert cfg.expert_input_size == 3584
    assert cfg.experts_mxfp4 and cfg.is_latent_moe and cfg.uses_attn_res
    assert cfg.kda_gate_lower_bound == -5.0 and cfg.kda_use_full_rank_gate
    blocks = cfg.attn_res_blocks
    assert len(blocks) == 8 and blocks[0] == list(range(12)) and blocks[-1] == list(range(84, 93))


@pytest.mark.parametrize("name", PRESETS)
def test_round_trip_load_save_load(name, tmp_path):
    cfg = K3Config.preset(name)
    path = tmp_path / "config.json"
    cfg.save(path)
    again = K3Config.from_json(path)
    assert again == cfg
    assert again.to_dict() == cfg.to_dict()
    assert not list(tmp_path.glob("*.tmp"))  # written atomically, temp file gone


def test_k3_round_trip_writes_the_published_form_back(k3_raw):
    written = K3Config.from_dict(k3_raw).to_dict()
    assert written == k3_raw


def test_kimi_linear_flat_form():
    cfg = K3Config.preset("kimi-linear-48b")
    assert cfg.published_form == "kimi_linear"
    assert cfg.kda_gate_lower_bound is None  # softplus gate
    assert not cfg.kda_use_full_rank_gate  # low-rank output gate
    assert not cfg.is_latent_moe and not cfg.uses_attn_res
    assert cfg.hidden_act == "silu" and cfg.q_lora_rank is None
    assert [p.index + 1 for p in cfg.layer_plan if p.mixer is Mixer.MLA] == [4, 8, 12, 16, 20, 24, 27]
    d = cfg.to_dict()
    assert "text_config" not in d and d["model_type"] == "kimi_linear"


def test_transformers_spelling_loads():
    """transformers' KimiLinearConfig.save_pretrained writes layer_types and its own key names."""
    transformers = pytest.importorskip("transformers")
    tcfg = transformers.KimiLinearConfig(
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        intermediate_size=96,
        linear_num_heads=2,
        linear_head_dim=32,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        vocab_size=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg = K3Config.from_dict(tcfg.to_dict())
    assert cfg.num_experts == 4 and cfg.num_experts_per_token == 2
    # transformers' default plan: full attention at 0-based layers 4, 8, ...
    assert [p.mixer for p in cfg.layer_plan] == [Mixer.KDA] * 4 + [Mixer.MLA, Mixer.KDA]
    assert [p.ffn for p in cfg.layer_plan] == [FFN.DENSE] + [FFN.MOE] * 5
    assert cfg.kda_num_heads == 2 and cfg.kda_head_dim == 32


def _with(raw: dict, **changes) -> dict:
    raw = copy.deepcopy(raw)
    text = raw["text_config"]
    for key, value in changes.items():
        if key.startswith("lin_"):
            text["linear_attn_config"][key[4:]] = value
        elif value is None:
            text.pop(key)
        else:
            text[key] = value
    return raw


@pytest.mark.parametrize(
    "changes, key, problem",
    [
        ({"hidden_size": None}, "hidden_size", "missing"),
        ({"vocab_size": 0}, "vocab_size", "positive integer"),
        ({"lin_kda_layers": [1, 1, 2, 3]}, "kda_layers", "twice"),
        ({"lin_full_attn_layers": [4, 94]}, "full_attn_layers", "outside 1..93"),
        ({"lin_full_attn_layers": [3, 4, 8]}, "linear_attn_config", "both KDA and full attention"),
        ({"lin_full_attn_layers": [4]}, "linear_attn_config", "neither KDA nor full attention"),
        ({"num_experts_per_token": 900}, "num_experts_per_token", "only 896 experts"),
        ({"num_expert_group": 3}, "num_expert_group", "do not divide"),
        ({"num_key_value_heads": 7}, "num_key_value_heads", "does not divide"),
        ({"hidden_act": "gelu"}, "hidden_act", "unsupported"),
        ({"lin_gate_lower_bound": 1.0}, "gate_lower_bound", "negative"),
        ({"moe_intermediate_size": 3080}, "moe_intermediate_size", "multiple of 32"),
        ({"attn_res_block_size": -1}, "attn_res_block_size", "positive"),
        ({"linear_attn_config": None}, "linear_attn_config", "missing"),
        ({"mla_use_nope": False}, "mla_use_nope", "not part of the K3 family"),
    ],
)
def test_validation_errors_name_key_and_problem(k3_raw, changes, key, problem):
    with pytest.raises(ConfigError) as err:
        K3Config.from_dict(_with(k3_raw, **changes))
    assert key in str(err.value) and problem in str(err.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        K3Config.from_json(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        K3Config.from_json(bad)
    with pytest.raises(ConfigError, match="unknown preset"):
        K3Config.preset("k4")
    with pytest.raises(ConfigError, match="wrong type"):
        K3Config.from_dict({"text_config": {"linear_attn_config": 5, "num_hidden_layers": 4}})
    with pytest.raises(ConfigError, match="text_config"):
        K3Config.from_dict({"model_type": "kimi_k3", "text_config": []})
