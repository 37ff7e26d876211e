"""K3Config: both published forms, round trips, presets and every validation error."""

import copy
import json
from dataclasses import MISSING
from pathlib import Path

import pytest
import transformers

from k3.config import FFN, PRESETS, SPELLINGS, ConfigError, K3Config, Mixer, published_fields

SPEC_CONFIG = Path(__file__).resolve().parents[1] / "docs" / "spec" / "kimi-k3-config.json"


@pytest.fixture(scope="module")
def k3_raw() -> dict:
    from importlib import resources

    return json.loads(resources.files("k3").joinpath("presets", "k3.json").read_text())


def test_shipped_k3_preset_is_the_published_config(k3_raw):
    """The preset k3 ships is the published config that travels with the code (docs/spec/)."""
    assert json.loads(SPEC_CONFIG.read_text()) == k3_raw


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


def _published_raw(name: str) -> dict:
    from importlib import resources

    return json.loads(resources.files("k3").joinpath("presets", f"{name}.json").read_text())


@pytest.mark.parametrize("name", PRESETS)
def test_every_field_reads_its_published_spelling(name):
    """Each published field equals the value at its spelling in the raw JSON (read here by hand), or the
    field's default where the JSON leaves the key out; nothing k3 reads is left in `extra`."""
    raw = _published_raw(name)
    text = raw.get("text_config", raw)
    cfg = K3Config.from_dict(raw)
    for f in published_fields():
        key = SPELLINGS[f.name].key if f.name in SPELLINGS else f.name
        where = text["linear_attn_config"] if key.startswith("linear_attn_config.") else text
        key = key.removeprefix("linear_attn_config.")
        if key not in where:
            expected = f.default if f.name != "num_key_value_heads" else cfg.num_attention_heads
        elif f.name in ("kda_layers", "mla_layers"):
            expected = [i - 1 for i in where[key]]
        else:
            expected = where[key]
        assert getattr(cfg, f.name) == expected, f.name
    spelled = {SPELLINGS[f.name].key if f.name in SPELLINGS else f.name for f in published_fields()}
    assert not spelled & set(cfg.extra), "a key k3 reads was also kept as an extra"


@pytest.mark.parametrize("name", PRESETS)
def test_to_dict_writes_every_field_back_in_its_published_form(name):
    raw = _published_raw(name)
    cfg = K3Config.from_dict(raw)
    written = cfg.to_dict()
    assert K3Config.from_dict(written) == cfg
    if "text_config" in raw:  # K3's nested form comes back whole, in K3's order (the field order)
        assert written == raw
        ours = {SPELLINGS[f.name].key if f.name in SPELLINGS else f.name for f in published_fields()}
        ours |= {"linear_attn_config"}
        assert [k for k in written["text_config"] if k in ours] == [
            k for k in raw["text_config"] if k in ours
        ]
    else:  # Kimi Linear's flat form: every key comes back, a transformers spelling under the published one
        renamed = {other: s.key for s in SPELLINGS.values() for other in s.also}
        for key, value in raw.items():
            assert written[renamed.get(key, key)] == value, key
        assert "model_max_length" in raw and "model_max_length" not in written


def test_a_minimal_config_gets_the_dataclass_defaults():
    """Only the required keys: every other field takes the dataclass default, and the defaults are the
    meanings k3 has always given an absent key (planted here), num_shared_experts that of transformers."""

    required = [f.name for f in published_fields() if f.default is MISSING]
    assert required == [
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "num_attention_heads",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "kda_layers",
        "mla_layers",
        "kda_num_heads",
        "kda_head_dim",
    ]
    text = {key: 8 for key in required[:9]}
    text["num_hidden_layers"] = 2
    text["linear_attn_config"] = {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 2, "head_dim": 8}
    cfg = K3Config.from_dict({"model_type": "kimi_k3", "text_config": text})
    planted = {
        "first_k_dense_replace": 1,
        "num_experts": 0,
        "num_experts_per_token": 0,
        "moe_intermediate_size": 0,
        "routed_expert_hidden_size": None,
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "q_lora_rank": None,
        "kda_short_conv_kernel_size": 4,
        "kda_gate_lower_bound": None,
        "kda_use_full_rank_gate": False,
        "attn_res_block_size": None,
        "max_position_embeddings": 1048576,
        "quantization_config": None,
    }
    assert {k: getattr(cfg, k) for k in planted} == planted
    assert cfg.num_shared_experts == transformers.KimiLinearConfig().num_shared_experts == 1
    assert cfg.num_key_value_heads == cfg.num_attention_heads == 8
    written = cfg.to_dict()["text_config"]
    assert "routed_expert_hidden_size" not in written and written["num_shared_experts"] == 1
    again = K3Config.from_dict(cfg.to_dict())
    assert K3Config.from_dict(again.to_dict()) == again


def test_transformers_names_are_read_ours_win_and_theirs_stay():
    """The transformers spellings fill a field only where the published key is absent; where both are
    present, the published key wins and transformers' key is kept (written back) as an extra."""
    raw = _published_raw("tiny")
    text = raw["text_config"]
    text["n_shared_experts"] = 7
    del text["moe_renormalize"]
    text["norm_topk_prob"] = False
    cfg = K3Config.from_dict(raw)
    assert cfg.num_shared_experts == 2 and cfg.extra["n_shared_experts"] == 7
    assert cfg.moe_renormalize is False and "norm_topk_prob" not in cfg.extra
    assert cfg.to_dict()["text_config"]["moe_renormalize"] is False


def test_a_source_that_is_neither_preset_nor_path_lists_the_presets(tmp_path):
    """`--preset minii` and the like: every command that takes a preset says which there are."""
    from typer.testing import CliRunner

    from k3.cli import app

    with pytest.raises(ConfigError, match="minii: no such preset, config.json or checkpoint directory"):
        K3Config.from_pretrained("minii")
    for args in (
        ["train", "--preset", "minii", "--out", str(tmp_path / "run"), "--quiet"],
        ["census", "minii"],
        ["atlas", "serve", "minii", "--port", "0"],
        ["init", str(tmp_path / "ckpt"), "--preset", "minii"],
    ):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 1 and "minii" in result.output, (args, result.output)
        assert ", ".join(PRESETS) in result.output and "Traceback" not in result.output, args
    assert not (tmp_path / "run").exists() and not (tmp_path / "ckpt").exists()
