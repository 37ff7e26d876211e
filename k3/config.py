"""The K3 text-model configuration: one dataclass, loaded from and saved to the published `config.json`.

Two published forms are understood:

* K3: `{"model_type": "kimi_k3", "text_config": {...}}`, the text tower under `text_config`;
* Kimi Linear: a flat `{"model_type": "kimi_linear", ...}` (softplus gate, low-rank output gate, SiLU,
  no latent MoE, no AttnRes). Configs written by `transformers.KimiLinearConfig.save_pretrained` (which
  spell some keys differently and list `layer_types`) load too.

Everything else in k3 reads sizes from `K3Config` and its derived properties, never from raw JSON.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import MISSING, Field, dataclass, field, fields
from enum import StrEnum
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

from k3.errors import K3Error
from k3.vision.config import VisionConfig

PRESETS = ("k3", "kimi-linear-48b", "mini", "tiny", "k3-slice")
# The public small K3 checkpoints, config.json as published (k3.checkpoint.public: their whole layouts)
PUBLIC_PRESETS = ("kimi-k3-0.40b", "kimi-k3-0.40b-mxfp4", "kimi-k3-4layer")
# What a preset's checkpoint packs where its quantization_config cannot say (the 0.40B-MXFP4's headers)
PRESET_PACKING = {"kimi-k3-0.40b-mxfp4": ("routed_experts", "latent_projections", "shared_experts")}
MXFP4_FORMAT = "mxfp4-pack-quantized"  # the one compressed-tensors format k3 implements


class ConfigError(K3Error):
    """A config that k3 cannot use; the message names the key and the problem."""


class Mixer(StrEnum):
    KDA = "kda"
    MLA = "mla"


class FFN(StrEnum):
    DENSE = "dense"
    MOE = "moe"


@dataclass(frozen=True)
class LayerPlan:
    index: int  # 0-based, as in tensor names
    mixer: Mixer
    ffn: FFN


@dataclass(frozen=True)
class Spelling:
    """How a field is published, where that is not simply `text_config[field name]`, always written."""

    key: str  # a text_config key, or "linear_attn_config.<key>"
    # transformers' KimiLinearConfig spellings (text_config keys): read, never written
    also: tuple[str, ...] = ()
    optional: bool = False  # left out of the written config while the field holds its default
    one_indexed: bool = False  # a list of layer numbers counted from 1 there (from 0 here)

    def place(self, text: dict[str, Any], lin: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """Where the key lives, given a text_config and its linear_attn_config: (that dict, the key)."""
        if self.key.startswith(LINEAR_ATTN):
            return lin, self.key[len(LINEAR_ATTN) :]
        return text, self.key


LINEAR_ATTN = "linear_attn_config."

# The one rename table: every field not listed is published as text_config[its name] and always written.
SPELLINGS = {
    "num_experts": Spelling("num_experts", also=("num_local_experts",)),
    "num_experts_per_token": Spelling("num_experts_per_token", also=("num_experts_per_tok",)),
    "num_shared_experts": Spelling("num_shared_experts", also=("n_shared_experts",)),
    "moe_renormalize": Spelling("moe_renormalize", also=("norm_topk_prob",)),
    "num_expert_group": Spelling("num_expert_group", also=("n_group",)),
    "max_position_embeddings": Spelling("max_position_embeddings", also=("model_max_length",)),
    # absent in Kimi Linear's published form
    "routed_expert_hidden_size": Spelling("routed_expert_hidden_size", optional=True),
    "attn_res_block_size": Spelling("attn_res_block_size", optional=True),
    "kda_layers": Spelling(LINEAR_ATTN + "kda_layers", one_indexed=True),
    "mla_layers": Spelling(LINEAR_ATTN + "full_attn_layers", one_indexed=True),
    "kda_num_heads": Spelling(LINEAR_ATTN + "num_heads", also=("linear_num_heads",)),
    "kda_head_dim": Spelling(LINEAR_ATTN + "head_dim", also=("linear_head_dim",)),
    "kda_short_conv_kernel_size": Spelling(
        LINEAR_ATTN + "short_conv_kernel_size", also=("linear_conv_kernel_dim",)
    ),
    "kda_gate_lower_bound": Spelling(LINEAR_ATTN + "gate_lower_bound", optional=True),
    "kda_use_full_rank_gate": Spelling(LINEAR_ATTN + "use_full_rank_gate", optional=True),
    "quantization_config": Spelling("quantization_config", optional=True),
    # not published keys (docs/epsilons.md): written only when set to something else than the default
    "mla_latent_norm_eps": Spelling("mla_latent_norm_eps", optional=True),
    "kda_l2norm_eps": Spelling("kda_l2norm_eps", optional=True),
}
_NOT_PUBLISHED = {"published": False}  # field metadata of the bookkeeping fields below the published ones


@dataclass(kw_only=True)
class K3Config:
    """The text model: one field per published setting, in the order `to_dict` writes them (K3's order).
    Names are the published `text_config` keys except where `SPELLINGS` says otherwise; a field's default is
    what a config.json without that key means."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    intermediate_size: int
    # mixture of experts (num_experts 0: every layer dense)
    num_experts: int = 0
    num_experts_per_token: int = 0
    num_shared_experts: int = 1  # as transformers' KimiLinearConfig; every published config states it
    routed_expert_hidden_size: int | None = None  # the latent width; None = experts run on the hidden state
    moe_intermediate_size: int = 0
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    num_expert_group: int = 1
    topk_group: int = 1
    latent_moe_use_norm: bool = False
    # activation, residual stream, norms
    hidden_act: str = "silu"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float | None = 25.0  # null: no cap on the up projection (as the release)
    attn_res_block_size: int | None = None  # None = a plain pre-norm residual stream
    rms_norm_eps: float = 1e-5
    # eps of the MLA latent norms (q_a_layernorm, kv_a_layernorm) and of KDA's q/k L2 norm. Not published
    # keys: Moonshot's reference code for both Kimi Linear and K3 hard-codes 1e-6 for both (its RMSNorm's
    # default, fla's l2norm default), not rms_norm_eps; sources in docs/epsilons.md.
    mla_latent_norm_eps: float = 1e-6
    kda_l2norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    # attention: MLA
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None = num_attention_heads
    q_lora_rank: int | None = None  # None = a single q_proj (Kimi Linear)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_nope: bool = True
    mla_use_output_gate: bool = False
    max_position_embeddings: int = 1048576
    # attention: KDA, from `linear_attn_config`
    kda_layers: list[int]
    mla_layers: list[int]
    kda_num_heads: int
    kda_head_dim: int
    kda_short_conv_kernel_size: int = 4
    kda_gate_lower_bound: float | None = None  # None = the softplus gate of Kimi Linear
    kda_use_full_rank_gate: bool = False  # False = the low-rank output gate g_b(g_a(x)) of Kimi Linear
    quantization_config: dict[str, Any] | None = None
    # Keys k3 does not interpret, kept so that saving writes them back.
    extra: dict[str, Any] = field(default_factory=dict, repr=False, metadata=_NOT_PUBLISHED)
    # K3 components whose Linear weights are MXFP4-packed (`weight_packed` + `weight_scale`): what a
    # checkpoint's headers say (k3.checkpoint.quant). None = the release's rule: the routed experts when
    # the quantization_config says mxfp4-pack-quantized, nothing otherwise.
    mxfp4_components: tuple[str, ...] | None = field(default=None, metadata=_NOT_PUBLISHED)
    # The published form this config came from: "kimi_k3" (nested) or "kimi_linear" (flat).
    published_form: str = field(default="kimi_k3", metadata=_NOT_PUBLISHED)
    outer_extra: dict[str, Any] = field(default_factory=dict, repr=False, metadata=_NOT_PUBLISHED)
    # The vision tower (top-level `vision_config`, `media_placeholder_token_id`): None = text only.
    vision_config: VisionConfig | None = field(default=None, repr=False, metadata=_NOT_PUBLISHED)
    media_placeholder_token_id: int | None = field(default=None, metadata=_NOT_PUBLISHED)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self.validate()

    # ---- derived properties -------------------------------------------------------------------------------
    @cached_property
    def layer_plan(self) -> list[LayerPlan]:
        kda = set(self.kda_layers)
        return [
            LayerPlan(
                index=i,
                mixer=Mixer.KDA if i in kda else Mixer.MLA,
                ffn=FFN.MOE if self.is_moe_layer(i) else FFN.DENSE,
            )
            for i in range(self.num_hidden_layers)
        ]

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_proj_size(self) -> int:
        """P = heads x head_dim: the width of the KDA q, k, v projections."""
        return self.kda_num_heads * self.kda_head_dim

    @property
    def expert_input_size(self) -> int:
        """Width the routed experts read and write: the latent width, or the hidden size without one."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def is_latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def uses_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def quantization(self) -> dict[str, Any] | None:
        """The quantization_config wherever the published config holds it: in text_config (the release) or
        at the top level (derived repos; transformers hoists it there at runtime)."""
        found = self.quantization_config or self.outer_extra.get("quantization_config")
        return found if isinstance(found, dict) else None

    @property
    def packed_components(self) -> tuple[str, ...]:
        """The components whose weights are MXFP4-packed (see `mxfp4_components`). Without headers to say
        it (a config k3 writes a checkpoint of): the routed experts, as the release packs them, when the
        quantization_config is MXFP4 and its `ignore` list spares them."""
        if self.mxfp4_components is not None:
            return self.mxfp4_components
        q = self.quantization or {}
        if q.get("format") != MXFP4_FORMAT or not self.num_experts:
            return ()
        prefix = "language_model.model." if self.published_form == "kimi_k3" else "model."
        expert = f"{prefix}layers.{self.first_k_dense_replace}.block_sparse_moe.experts.0."
        spared = all(ignored_by(q, expert + w) is None for w in ("w1", "w2", "w3"))
        return ("routed_experts",) if spared else ()

    @property
    def experts_mxfp4(self) -> bool:
        """True when routed experts are stored as MXFP4 (`mxfp4-pack-quantized`)."""
        return "routed_experts" in self.packed_components

    @property
    def attn_res_blocks(self) -> list[list[int]]:
        """Layer indices grouped into AttnRes blocks (one block = every layer if AttnRes is off)."""
        size = self.attn_res_block_size or self.num_hidden_layers
        n = self.num_hidden_layers
        return [list(range(s, min(s + size, n))) for s in range(0, n, size)]

    @property
    def num_moe_layers(self) -> int:
        return sum(p.ffn is FFN.MOE for p in self.layer_plan)

    # ---- validation ---------------------------------------------------------------------------------------
    def validate(self) -> None:
        def fail(key: str, problem: str) -> None:
            raise ConfigError(f"{key}: {problem}")

        for key in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kda_num_heads",
            "kda_head_dim",
            "kv_lora_rank",
            "v_head_dim",
            "kda_short_conv_kernel_size",
        ):
            if not isinstance(getattr(self, key), int) or getattr(self, key) <= 0:
                fail(key, f"must be a positive integer, got {getattr(self, key)!r}")
        n = self.num_hidden_layers
        kda, mla = self.kda_layers, self.mla_layers
        for name, layers in (
            ("linear_attn_config.kda_layers", kda),
            ("linear_attn_config.full_attn_layers", mla),
        ):
            if len(set(layers)) != len(layers):
                fail(name, "lists a layer twice")
            bad = [i + 1 for i in layers if not 0 <= i < n]
            if bad:
                fail(name, f"layers {bad} are outside 1..{n} (num_hidden_layers)")
        if both := sorted(set(kda) & set(mla)):
            fail("linear_attn_config", f"layers {[i + 1 for i in both]} are both KDA and full attention")
        if missing := sorted(set(range(n)) - set(kda) - set(mla)):
            fail(
                "linear_attn_config", f"layers {[i + 1 for i in missing]} are neither KDA nor full attention"
            )
        if self.num_experts < 0:
            fail("num_experts", "must not be negative")
        if self.num_experts and not 0 < self.num_experts_per_token <= self.num_experts:
            fail(
                "num_experts_per_token",
                f"{self.num_experts_per_token} experts per token but only {self.num_experts} experts",
            )
        if self.num_experts and self.num_experts % self.num_expert_group:
            fail(
                "num_expert_group", f"{self.num_expert_group} groups do not divide {self.num_experts} experts"
            )
        if self.topk_group > self.num_expert_group:
            fail("topk_group", f"{self.topk_group} exceeds num_expert_group {self.num_expert_group}")
        if self.num_attention_heads % self.num_key_value_heads:
            fail(
                "num_key_value_heads",
                f"{self.num_key_value_heads} does not divide num_attention_heads {self.num_attention_heads}",
            )
        if self.hidden_act not in ("silu", "situ"):
            fail("hidden_act", f"unsupported activation {self.hidden_act!r} (expected 'silu' or 'situ')")
        if self.moe_router_activation_func != "sigmoid":
            fail(
                "moe_router_activation_func",
                f"only 'sigmoid' is supported, got {self.moe_router_activation_func!r}",
            )
        if self.kda_gate_lower_bound is not None and self.kda_gate_lower_bound >= 0:
            fail("linear_attn_config.gate_lower_bound", f"must be negative, got {self.kda_gate_lower_bound}")
        for key in ("rms_norm_eps", "mla_latent_norm_eps", "kda_l2norm_eps"):
            if not isinstance(getattr(self, key), int | float) or not getattr(self, key) > 0:
                fail(key, f"must be a positive number, got {getattr(self, key)!r}")
        if self.vision_config is not None:
            pad = self.media_placeholder_token_id
            if not isinstance(pad, int) or not 0 <= pad < self.vocab_size:
                fail("media_placeholder_token_id", f"must be a token id below {self.vocab_size}, got {pad!r}")
        if self.attn_res_block_size is not None and self.attn_res_block_size <= 0:
            fail("attn_res_block_size", f"must be positive, got {self.attn_res_block_size}")
        self._validate_quantization(fail)
        if self.experts_mxfp4 and self.num_experts:
            for key, size in (
                ("routed_expert_hidden_size", self.expert_input_size),
                ("moe_intermediate_size", self.moe_intermediate_size),
            ):
                if size % 32:
                    fail(key, f"{size} is not a multiple of 32, the MXFP4 block size")

    def _validate_quantization(self, fail: Any) -> None:
        """A quantization format (or scheme) k3 does not implement is refused by name: never misread."""
        q = self.quantization
        if q is None:
            return
        groups = q.get("config_groups") or {}
        formats = {q.get("format")} | {g.get("format") for g in groups.values() if isinstance(g, dict)}
        for fmt in sorted(f for f in formats if f is not None and f != MXFP4_FORMAT):
            fail(
                "quantization_config.format",
                f"{fmt!r} is a format k3 does not implement (only {MXFP4_FORMAT})",
            )
        for name, group in groups.items():
            weights = group.get("weights") if isinstance(group, dict) else None
            if not isinstance(weights, dict):
                continue
            scheme = {k: weights.get(k) for k in ("num_bits", "type", "group_size")}
            if scheme != {"num_bits": 4, "type": "float", "group_size": 32}:
                fail(
                    f"quantization_config.config_groups.{name}.weights",
                    f"{scheme} is not MXFP4 (4-bit float, groups of 32)",
                )
        unknown = set(self.mxfp4_components or ()) - {
            "routed_experts",
            "latent_projections",
            "shared_experts",
        }
        if unknown:
            fail(
                "quantization_config",
                "k3 runs MXFP4 only for routed experts, latent projections and shared experts, "
                f"not {sorted(unknown)}",
            )

    # ---- loading and saving -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> K3Config:
        """Parse a published config.json (either form) into a K3Config."""
        if not isinstance(raw, dict):
            raise ConfigError(f"config: expected a JSON object, got {type(raw).__name__}")
        raw = copy.deepcopy(raw)
        if "text_config" in raw:
            outer = {k: v for k, v in raw.items() if k != "text_config"}
            text, form = raw["text_config"], "kimi_k3"
            if not isinstance(text, dict):
                raise ConfigError("text_config: expected a JSON object")
        else:
            outer, text, form = {}, raw, "kimi_linear"
        try:
            return cls._from_text_config(text, form, outer)
        except (TypeError, AttributeError) as e:  # a value of the wrong JSON type somewhere
            raise ConfigError(f"config: a value has the wrong type ({e})") from None

    @classmethod
    def _from_text_config(cls, text: dict[str, Any], form: str, outer: dict[str, Any]) -> K3Config:
        lin = dict(text.pop("linear_attn_config", None) or {})
        _layer_lists_from_transformers(text, lin)
        values: dict[str, Any] = {}
        for f in published_fields():
            spelling = SPELLINGS.get(f.name, Spelling(f.name))
            where, key = spelling.place(text, lin)
            if key in where:
                value = where.pop(key)
            elif present := [other for other in spelling.also if other in text]:
                value = text.pop(present[0])
            elif f.default is not MISSING:
                continue
            else:
                raise ConfigError(f"{spelling.key}: missing (required in text_config)")
            if spelling.one_indexed:
                if not isinstance(value, list) or not all(isinstance(i, int) for i in value):
                    raise ConfigError(f"{spelling.key}: expected a list of integers")
                value = [i - 1 for i in value]
            values[f.name] = value
        values["quantization_config"] = values.get("quantization_config") or outer.get("quantization_config")
        vision = outer.pop("vision_config", None)
        media_pad = outer.pop("media_placeholder_token_id", None)
        cfg = cls(
            **values,
            extra={**text, **({"linear_attn_config": lin} if lin else {})},  # whatever else they held
            published_form=form,
            outer_extra=outer,
            vision_config=None if vision is None else VisionConfig.from_dict(vision),
            media_placeholder_token_id=media_pad,
        )
        if not cfg.mla_use_nope:
            raise ConfigError("mla_use_nope: false (rotary MLA) is not part of the K3 family")
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """The published form this config was loaded from (or K3's nested form for new configs)."""
        text: dict[str, Any] = {k: v for k, v in self.extra.items() if k != "linear_attn_config"}
        text.setdefault("model_type", "kimi_linear")
        lin: dict[str, Any] = {}
        lin_extra = self.extra.get("linear_attn_config", {})
        for f in published_fields():
            spelling = SPELLINGS.get(f.name, Spelling(f.name))
            value = getattr(self, f.name)
            if spelling.optional and value == f.default:
                continue
            if spelling.one_indexed:
                value = [i + 1 for i in value]
            where, key = spelling.place(text, lin)
            if where is lin:
                text.setdefault("linear_attn_config", lin)  # in text_config where its first key falls
                if spelling.optional:
                    lin.update(lin_extra)  # keys k3 does not read go before the optional ones
            where[key] = value
        lin.update(lin_extra)
        if self.published_form == "kimi_linear":
            return text
        vision = {}
        if self.vision_config is not None:
            vision["vision_config"] = self.vision_config.to_dict()
        if self.media_placeholder_token_id is not None:
            vision["media_placeholder_token_id"] = self.media_placeholder_token_id
        return {"model_type": "kimi_k3", **self.outer_extra, "text_config": text, **vision}

    @classmethod
    def from_json(cls, path: str | Path) -> K3Config:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw)

    def save(self, path: str | Path) -> None:
        """Write config.json atomically (temporary name, then rename)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(path)

    @classmethod
    def preset(cls, name: str) -> K3Config:
        if name not in PRESETS + PUBLIC_PRESETS:
            raise ConfigError(f"unknown preset {name!r} (known: {', '.join(PRESETS + PUBLIC_PRESETS)})")
        cfg = cls.from_dict(json.loads(preset_text(name)))
        if name in PRESET_PACKING:
            cfg.mxfp4_components = PRESET_PACKING[name]
        return cfg

    @classmethod
    def from_pretrained(cls, target: str | Path) -> K3Config:
        """A preset name, a config.json path, or a directory holding config.json."""
        if isinstance(target, str) and target in PRESETS + PUBLIC_PRESETS:
            return cls.preset(target)
        path = Path(target)
        if not path.exists():
            raise no_such_source(str(target))
        if path.is_dir():
            path = path / "config.json"
        return cls.from_json(path)


def no_such_source(target: str) -> ConfigError:
    """The error for a model source that is neither a preset nor an existing path: it lists the presets."""
    return ConfigError(
        f"{target}: no such preset, config.json or checkpoint directory "
        f"(presets: {', '.join(PRESETS + PUBLIC_PRESETS)})"
    )


def ignored_by(quantization: dict[str, Any] | None, module: str) -> str | None:
    """The first entry of a quantization_config's `ignore` list that matches the module name `module`
    (a weight's name less `.weight`), by compressed-tensors' rule: `re:PATTERN` by `re.match`, anything
    else by equality; None when none does."""
    for entry in (quantization or {}).get("ignore") or []:
        if isinstance(entry, str) and (
            entry.startswith("re:") and re.match(entry[3:], module) or entry == module
        ):
            return entry
    return None


def preset_text(name: str) -> str:
    """A preset's config.json, byte for byte as shipped in k3/presets (the public ones as published)."""
    return resources.files("k3").joinpath("presets", f"{name}.json").read_text()


def published_fields() -> list[Field]:
    """The fields of K3Config that config.json holds, in the order they are written."""
    return [f for f in fields(K3Config) if f.metadata.get("published", True)]


def _layer_lists_from_transformers(text: dict[str, Any], lin: dict[str, Any]) -> None:
    """transformers' spellings of the layer plan (one `layer_types` / `mlp_layer_types` entry per layer),
    rewritten in place into the published `linear_attn_config` lists and `first_k_dense_replace`."""
    layer_types = text.pop("layer_types", None)
    if "kda_layers" in lin or "full_attn_layers" in lin:
        for key in ("kda_layers", "full_attn_layers"):
            if key not in lin:
                raise ConfigError(f"linear_attn_config.{key}: missing")
    elif layer_types is not None:
        lin["kda_layers"] = [i + 1 for i, t in enumerate(layer_types) if t == "linear_attention"]
        lin["full_attn_layers"] = [i + 1 for i, t in enumerate(layer_types) if t == "full_attention"]
    else:
        raise ConfigError("linear_attn_config: missing (needs kda_layers and full_attn_layers)")
    mlp_types = text.pop("mlp_layer_types", None)
    if mlp_types is not None and "first_k_dense_replace" not in text:
        dense = [t == "dense" for t in mlp_types]
        first_sparse = dense.index(False) if False in dense else len(dense)
        if any(dense[first_sparse:]):
            raise ConfigError("mlp_layer_types: dense layers after the first MoE layer are not supported")
        text["first_k_dense_replace"] = first_sparse
