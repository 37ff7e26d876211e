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
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

from k3.errors import K3Error

PRESETS = ("k3", "kimi-linear-48b", "mini", "tiny", "k3-slice")


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


# Keys that transformers' KimiLinearConfig writes under other names: {its name: published name}.
_TRANSFORMERS_ALIASES = {
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group",
    "model_max_length": "max_position_embeddings",
}


@dataclass
class K3Config:
    """The text model. Field names are the published `text_config` keys."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    # attention: MLA
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # attention: KDA, from `linear_attn_config` (layer lists are 1-indexed there, 0-indexed here)
    kda_layers: list[int]
    mla_layers: list[int]
    kda_num_heads: int
    kda_head_dim: int
    # mixture of experts
    num_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int
    num_shared_experts: int = 1
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    routed_expert_hidden_size: int | None = None  # the latent width; None = experts run on the hidden state
    latent_moe_use_norm: bool = False
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    num_expert_group: int = 1
    topk_group: int = 1
    # the rest
    num_key_value_heads: int | None = None
    q_lora_rank: int | None = None  # None = a single q_proj (Kimi Linear)
    kda_short_conv_kernel_size: int = 4
    kda_gate_lower_bound: float | None = None  # None = the softplus gate of Kimi Linear
    kda_use_full_rank_gate: bool = False  # False = the low-rank output gate g_b(g_a(x)) of Kimi Linear
    hidden_act: str = "silu"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    attn_res_block_size: int | None = None  # None = a plain pre-norm residual stream
    rms_norm_eps: float = 1e-5
    # eps of the MLA latent norms (q_a_layernorm, kv_a_layernorm) and of KDA's q/k L2 norm. Not published
    # keys: Moonshot's reference code for both Kimi Linear and K3 hard-codes 1e-6 for both (its RMSNorm's
    # default, fla's l2norm default), not rms_norm_eps; sources in docs/epsilons.md.
    mla_latent_norm_eps: float = 1e-6
    kda_l2norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    mla_use_nope: bool = True
    mla_use_output_gate: bool = False
    quantization_config: dict[str, Any] | None = None
    # Keys k3 does not interpret, kept so that saving writes them back.
    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    # The published form this config came from: "kimi_k3" (nested) or "kimi_linear" (flat).
    published_form: str = "kimi_k3"
    outer_extra: dict[str, Any] = field(default_factory=dict, repr=False)

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
    def experts_mxfp4(self) -> bool:
        """True when routed experts are stored as MXFP4 (`mxfp4-pack-quantized`)."""
        q = self.quantization_config or {}
        return q.get("format") == "mxfp4-pack-quantized"

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
        if self.attn_res_block_size is not None and self.attn_res_block_size <= 0:
            fail("attn_res_block_size", f"must be positive, got {self.attn_res_block_size}")
        if self.experts_mxfp4 and self.num_experts:
            for key, size in (
                ("routed_expert_hidden_size", self.expert_input_size),
                ("moe_intermediate_size", self.moe_intermediate_size),
            ):
                if size % 32:
                    fail(key, f"{size} is not a multiple of 32, the MXFP4 block size")

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
        for theirs, ours in _TRANSFORMERS_ALIASES.items():
            if theirs in text and ours not in text:
                text[ours] = text.pop(theirs)
        try:
            return cls._from_text_config(text, form, outer)
        except (TypeError, AttributeError) as e:  # a value of the wrong JSON type somewhere
            raise ConfigError(f"config: a value has the wrong type ({e})") from None

    @classmethod
    def _from_text_config(cls, text: dict[str, Any], form: str, outer: dict[str, Any]) -> K3Config:
        def take(key: str, default: Any = ...) -> Any:
            if key in text:
                return text.pop(key)
            if default is ...:
                raise ConfigError(f"{key}: missing (required in text_config)")
            return default

        num_layers = take("num_hidden_layers")
        lin = dict(take("linear_attn_config", None) or {})
        layer_types = take("layer_types", None)
        if "kda_layers" in lin or "full_attn_layers" in lin:
            for key in ("kda_layers", "full_attn_layers"):
                if key not in lin:
                    raise ConfigError(f"linear_attn_config.{key}: missing")
                if not all(isinstance(i, int) for i in lin[key]):
                    raise ConfigError(f"linear_attn_config.{key}: expected a list of integers")
            kda = [i - 1 for i in lin.pop("kda_layers")]
            mla = [i - 1 for i in lin.pop("full_attn_layers")]
        elif layer_types is not None:  # transformers' spelling: one type per layer
            kda = [i for i, t in enumerate(layer_types) if t == "linear_attention"]
            mla = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        else:
            raise ConfigError("linear_attn_config: missing (needs kda_layers and full_attn_layers)")
        mlp_types = text.pop("mlp_layer_types", None)  # transformers' spelling of first_k_dense_replace
        if mlp_types is not None and "first_k_dense_replace" not in text:
            dense = [t == "dense" for t in mlp_types]
            first_sparse = dense.index(False) if False in dense else len(dense)
            if any(dense[first_sparse:]):
                raise ConfigError("mlp_layer_types: dense layers after the first MoE layer are not supported")
            text["first_k_dense_replace"] = first_sparse
        kda_heads = lin.pop("num_heads", text.pop("linear_num_heads", None))
        kda_head_dim = lin.pop("head_dim", text.pop("linear_head_dim", None))
        if kda_heads is None or kda_head_dim is None:
            raise ConfigError("linear_attn_config.num_heads/head_dim: missing")
        conv = lin.pop("short_conv_kernel_size", text.pop("linear_conv_kernel_dim", 4))
        lower = lin.pop("gate_lower_bound", None)
        full_rank = lin.pop("use_full_rank_gate", False)
        lin_extra = lin  # whatever else linear_attn_config held

        cfg = cls(
            vocab_size=take("vocab_size"),
            hidden_size=take("hidden_size"),
            num_hidden_layers=num_layers,
            intermediate_size=take("intermediate_size"),
            num_attention_heads=take("num_attention_heads"),
            kv_lora_rank=take("kv_lora_rank"),
            qk_nope_head_dim=take("qk_nope_head_dim"),
            qk_rope_head_dim=take("qk_rope_head_dim"),
            v_head_dim=take("v_head_dim"),
            kda_layers=kda,
            mla_layers=mla,
            kda_num_heads=kda_heads,
            kda_head_dim=kda_head_dim,
            num_experts=take("num_experts", 0),
            num_experts_per_token=take("num_experts_per_token", 0),
            moe_intermediate_size=take("moe_intermediate_size", 0),
            num_shared_experts=take("num_shared_experts", 0),
            first_k_dense_replace=take("first_k_dense_replace", 1),
            moe_layer_freq=take("moe_layer_freq", 1),
            routed_expert_hidden_size=take("routed_expert_hidden_size", None),
            latent_moe_use_norm=take("latent_moe_use_norm", False),
            moe_router_activation_func=take("moe_router_activation_func", "sigmoid"),
            moe_renormalize=take("moe_renormalize", True),
            routed_scaling_factor=take("routed_scaling_factor", 1.0),
            num_expert_group=take("num_expert_group", 1),
            topk_group=take("topk_group", 1),
            num_key_value_heads=take("num_key_value_heads", None),
            q_lora_rank=take("q_lora_rank", None),
            kda_short_conv_kernel_size=conv,
            kda_gate_lower_bound=lower,
            kda_use_full_rank_gate=full_rank,
            hidden_act=take("hidden_act", "silu"),
            activation_situ_beta=take("activation_situ_beta", 4.0),
            activation_situ_linear_beta=take("activation_situ_linear_beta", 25.0),
            attn_res_block_size=take("attn_res_block_size", None),
            rms_norm_eps=take("rms_norm_eps", 1e-5),
            tie_word_embeddings=take("tie_word_embeddings", False),
            max_position_embeddings=take("max_position_embeddings", 1048576),
            mla_use_nope=take("mla_use_nope", True),
            mla_use_output_gate=take("mla_use_output_gate", False),
            quantization_config=take("quantization_config", None) or outer.get("quantization_config"),
            extra={**text, **({"linear_attn_config": lin_extra} if lin_extra else {})},
            published_form=form,
            outer_extra=outer,
        )
        if not cfg.mla_use_nope:
            raise ConfigError("mla_use_nope: false (rotary MLA) is not part of the K3 family")
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """The published form this config was loaded from (or K3's nested form for new configs)."""
        lin_extra = dict(self.extra.get("linear_attn_config", {}))
        lin = {
            "kda_layers": [i + 1 for i in self.kda_layers],
            "full_attn_layers": [i + 1 for i in self.mla_layers],
            "num_heads": self.kda_num_heads,
            "head_dim": self.kda_head_dim,
            "short_conv_kernel_size": self.kda_short_conv_kernel_size,
            **lin_extra,
        }
        if self.kda_gate_lower_bound is not None:
            lin["gate_lower_bound"] = self.kda_gate_lower_bound
        if self.kda_use_full_rank_gate:
            lin["use_full_rank_gate"] = True
        text: dict[str, Any] = {k: v for k, v in self.extra.items() if k != "linear_attn_config"}
        text.setdefault("model_type", "kimi_linear")
        for key in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "first_k_dense_replace",
            "moe_layer_freq",
            "intermediate_size",
            "num_experts",
            "num_experts_per_token",
            "num_shared_experts",
            "routed_expert_hidden_size",
            "moe_intermediate_size",
            "moe_router_activation_func",
            "moe_renormalize",
            "routed_scaling_factor",
            "num_expert_group",
            "topk_group",
            "latent_moe_use_norm",
            "hidden_act",
            "activation_situ_beta",
            "activation_situ_linear_beta",
            "attn_res_block_size",
            "rms_norm_eps",
            "tie_word_embeddings",
            "num_attention_heads",
            "num_key_value_heads",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "mla_use_nope",
            "mla_use_output_gate",
            "max_position_embeddings",
        ):
            value = getattr(self, key)
            if value is None and key in ("routed_expert_hidden_size", "attn_res_block_size"):
                continue  # absent in Kimi Linear's published form
            text[key] = value
        text["linear_attn_config"] = lin
        if self.published_form == "kimi_linear":
            if self.quantization_config is not None:
                text["quantization_config"] = self.quantization_config
            return text
        if self.quantization_config is not None:
            text["quantization_config"] = self.quantization_config
        return {"model_type": "kimi_k3", **self.outer_extra, "text_config": text}

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
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
        text = resources.files("k3").joinpath("presets", f"{name}.json").read_text()
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_pretrained(cls, target: str | Path) -> K3Config:
        """A preset name, a config.json path, or a directory holding config.json."""
        if isinstance(target, str) and target in PRESETS:
            return cls.preset(target)
        path = Path(target)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_json(path)
