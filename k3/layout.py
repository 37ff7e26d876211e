"""The published tensor layout: every tensor name, shape and dtype a K3-family checkpoint holds.

One table serves everyone: the census counts it, `k3 init` writes it, the model loader checks a checkpoint
against it. Names follow docs/spec/K3.md section 3: K3 prefixes the text tower with `language_model.`;
Kimi Linear has no prefix and spells the low-rank output gate `g_a_proj` / `g_b_proj`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

from k3.config import FFN, K3Config, Mixer

# Census components, in display order.
COMPONENTS = (
    "embedding",
    "lm_head",
    "kda_attention",
    "mla_attention",
    "dense_mlp",
    "router",
    "latent_projections",
    "routed_experts",
    "shared_experts",
    "norms",
    "attn_res",
)

# The vision path's parts (a checkpoint with a `vision_config`), counted apart from the text model.
VISION_COMPONENTS = ("vision_tower", "mm_projector")

DTYPE_BYTES = {
    "BF16": 2,
    "F16": 2,
    "F32": 4,
    "F64": 8,
    "U8": 1,
    "I8": 1,
    "I16": 2,
    "I32": 4,
    "I64": 8,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}

MXFP4_BLOCK = 32


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string
    component: str
    layer: int | None = None  # None for embedding, final norm, output read, lm_head
    count: int = 1  # > 1 only for a routed-expert tensor standing for all experts of a layer (census)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def params(self) -> int:
        """Logical parameters: a packed MXFP4 byte holds 2, scale bytes hold none."""
        return parameters_of(self.name, self.dtype, self.numel) * self.count

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype] * self.count


def parameters_of(name: str, dtype: str, numel: int) -> int:
    if name.endswith(".weight_packed"):
        return 2 * numel
    if name.endswith(".weight_scale"):
        return 0
    return numel


def prefixes(cfg: K3Config) -> tuple[str, str]:
    """(model prefix, lm_head name) for the config's published form."""
    if cfg.published_form == "kimi_k3":
        return "language_model.model.", "language_model.lm_head.weight"
    return "model.", "lm_head.weight"


def kda_a_log_shape(cfg: K3Config) -> tuple[int, ...]:
    # K3 stores A_log as a flat F32 vector padded to 128 = head_dim (only the first `heads` entries are used;
    # the padding rule is unconfirmed); Kimi Linear stores it as [1, 1, heads, 1].
    if cfg.published_form == "kimi_k3":
        return (max(cfg.kda_num_heads, cfg.kda_head_dim),)
    return (1, 1, cfg.kda_num_heads, 1)


def _kda(cfg: K3Config, p: str) -> Iterator[tuple[str, tuple[int, ...], str]]:
    H, P, d, heads = cfg.hidden_size, cfg.kda_proj_size, cfg.kda_head_dim, cfg.kda_num_heads
    for x in "qkv":
        yield f"{p}{x}_proj.weight", (P, H), "BF16"
    for x in "qkv":
        yield f"{p}{x}_conv1d.weight", (P, 1, cfg.kda_short_conv_kernel_size), "F32"
    yield f"{p}f_a_proj.weight", (d, H), "BF16"
    yield f"{p}f_b_proj.weight", (P, d), "BF16"
    yield f"{p}A_log", kda_a_log_shape(cfg), "F32"
    yield f"{p}dt_bias", (P,), "F32"
    yield f"{p}b_proj.weight", (heads, H), "BF16"
    if cfg.kda_use_full_rank_gate:
        yield f"{p}g_proj.weight", (P, H), "BF16"
    else:
        yield f"{p}g_a_proj.weight", (d, H), "BF16"
        yield f"{p}g_b_proj.weight", (P, d), "BF16"
    yield f"{p}o_norm.weight", (d,), "F32"
    yield f"{p}o_proj.weight", (H, P), "BF16"


def _mla(cfg: K3Config, p: str) -> Iterator[tuple[str, tuple[int, ...], str]]:
    H, heads = cfg.hidden_size, cfg.num_attention_heads
    if cfg.q_lora_rank is None:
        yield f"{p}q_proj.weight", (heads * cfg.qk_head_dim, H), "BF16"
    else:
        yield f"{p}q_a_proj.weight", (cfg.q_lora_rank, H), "BF16"
        yield f"{p}q_a_layernorm.weight", (cfg.q_lora_rank,), "BF16"
        yield f"{p}q_b_proj.weight", (heads * cfg.qk_head_dim, cfg.q_lora_rank), "BF16"
    yield f"{p}kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H), "BF16"
    yield f"{p}kv_a_layernorm.weight", (cfg.kv_lora_rank,), "BF16"
    yield f"{p}kv_b_proj.weight", (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), "BF16"
    if cfg.mla_use_output_gate:
        yield f"{p}g_proj.weight", (heads * cfg.v_head_dim, H), "BF16"
    yield f"{p}o_proj.weight", (H, heads * cfg.v_head_dim), "BF16"


def linear_tensors(
    name: str, out: int, inp: int, dtype: str, packed: bool
) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """A Linear weight `name` (`....weight`) [out, inp]: plain, or MXFP4-packed as compressed-tensors writes
    it (`weight_packed` U8 [out, inp/2] + `weight_scale` U8 [out, inp/32], one E8M0 byte per 32)."""
    if packed:
        yield f"{name}_packed", (out, inp // 2), "U8"
        yield f"{name}_scale", (out, inp // MXFP4_BLOCK), "U8"
    else:
        yield name, (out, inp), dtype


def routed_expert_tensors(cfg: K3Config, prefix: str) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """The tensors of one routed expert; `prefix` ends in `experts.{e}.`."""
    m, L = cfg.moe_intermediate_size, cfg.expert_input_size
    for w, (out, inp) in (("w1", (m, L)), ("w3", (m, L)), ("w2", (L, m))):
        if cfg.experts_mxfp4:
            yield f"{prefix}{w}.weight_packed", (out, inp // 2), "U8"
            yield f"{prefix}{w}.weight_scale", (out, inp // MXFP4_BLOCK), "U8"
        else:
            yield f"{prefix}{w}.weight", (out, inp), "BF16"


def layer_tensors(cfg: K3Config, i: int, *, expand_experts: bool = True) -> Iterator[TensorSpec]:
    """Tensors of layer i. With expand_experts=False, routed experts appear once with count=E."""
    model_prefix, _ = prefixes(cfg)
    p = f"{model_prefix}layers.{i}."
    H = cfg.hidden_size
    plan = cfg.layer_plan[i]

    def spec(name: str, shape: tuple[int, ...], dtype: str, component: str, count: int = 1) -> TensorSpec:
        return TensorSpec(name, shape, dtype, component, layer=i, count=count)

    yield spec(f"{p}input_layernorm.weight", (H,), "BF16", "norms")
    yield spec(f"{p}post_attention_layernorm.weight", (H,), "BF16", "norms")
    if cfg.uses_attn_res:
        for site in ("self_attention", "mlp"):
            yield spec(f"{p}{site}_res_norm.weight", (H,), "BF16", "attn_res")
            yield spec(f"{p}{site}_res_proj.weight", (1, H), "BF16", "attn_res")
    if plan.mixer is Mixer.KDA:
        for name, shape, dtype in _kda(cfg, f"{p}self_attn."):
            yield spec(name, shape, dtype, "kda_attention")
    else:
        for name, shape, dtype in _mla(cfg, f"{p}self_attn."):
            yield spec(name, shape, dtype, "mla_attention")
    if plan.ffn is FFN.DENSE:
        I = cfg.intermediate_size  # noqa: E741
        yield spec(f"{p}mlp.gate_proj.weight", (I, H), "BF16", "dense_mlp")
        yield spec(f"{p}mlp.up_proj.weight", (I, H), "BF16", "dense_mlp")
        yield spec(f"{p}mlp.down_proj.weight", (H, I), "BF16", "dense_mlp")
        return
    m, E = cfg.moe_intermediate_size, cfg.num_experts
    q = f"{p}block_sparse_moe."
    yield spec(f"{q}gate.weight", (E, H), "BF16", "router")
    yield spec(f"{q}gate.e_score_correction_bias", (E,), "F32", "router")
    if cfg.is_latent_moe:
        L, packed = cfg.expert_input_size, "latent_projections" in cfg.packed_components
        for name, shape, dtype in linear_tensors(f"{q}routed_expert_down_proj.weight", L, H, "BF16", packed):
            yield spec(name, shape, dtype, "latent_projections")
        if cfg.latent_moe_use_norm:
            yield spec(f"{q}routed_expert_norm.weight", (L,), "BF16", "norms")
        for name, shape, dtype in linear_tensors(f"{q}routed_expert_up_proj.weight", H, L, "BF16", packed):
            yield spec(name, shape, dtype, "latent_projections")
    if expand_experts:
        for e in range(E):
            for name, shape, dtype in routed_expert_tensors(cfg, f"{q}experts.{e}."):
                yield spec(name, shape, dtype, "routed_experts")
    else:
        for name, shape, dtype in routed_expert_tensors(cfg, f"{q}experts.*."):
            yield spec(name, shape, dtype, "routed_experts", count=E)
    if cfg.num_shared_experts:
        S, packed = cfg.num_shared_experts * m, "shared_experts" in cfg.packed_components
        for proj, out, inp in (("gate_proj", S, H), ("up_proj", S, H), ("down_proj", H, S)):
            for name, shape, dtype in linear_tensors(
                f"{q}shared_experts.{proj}.weight", out, inp, "BF16", packed
            ):
                yield spec(name, shape, dtype, "shared_experts")


def published_tensors(
    cfg: K3Config, *, layers: int | None = None, expand_experts: bool = True
) -> Iterator[TensorSpec]:
    """Every tensor of the text model in the published layout (`layers=N`: only the first N layers)."""
    model_prefix, lm_head = prefixes(cfg)
    H, V = cfg.hidden_size, cfg.vocab_size
    yield TensorSpec(f"{model_prefix}embed_tokens.weight", (V, H), "BF16", "embedding")
    n = cfg.num_hidden_layers if layers is None else min(layers, cfg.num_hidden_layers)
    for i in range(n):
        yield from layer_tensors(cfg, i, expand_experts=expand_experts)
    if cfg.uses_attn_res:
        yield TensorSpec(f"{model_prefix}output_attn_res_norm.weight", (H,), "BF16", "attn_res")
        yield TensorSpec(f"{model_prefix}output_attn_res_proj.weight", (1, H), "BF16", "attn_res")
    yield TensorSpec(f"{model_prefix}norm.weight", (H,), "BF16", "norms")
    if not cfg.tie_word_embeddings:
        yield TensorSpec(lm_head, (V, H), "BF16", "lm_head")


def vision_tensors(cfg: K3Config) -> Iterator[TensorSpec]:
    """The vision tower's and projector's tensors (none without a vision_config), all BF16, no biases
    (../shared/spec/K3-vision.md section 3)."""
    v = cfg.vision_config
    if v is None:
        return
    D, Q, P, M = v.vt_hidden_size, v.qkv_hidden_size, v.patch_size, v.projector_in

    def tower(name: str, shape: tuple[int, ...]) -> TensorSpec:
        return TensorSpec(f"vision_tower.{name}", shape, "BF16", "vision_tower")

    yield tower("patch_embed.proj.weight", (D, 3, P, P))
    yield tower("patch_embed.pos_emb.weight", (v.init_pos_emb_height, v.init_pos_emb_width, D))
    for i in range(v.vt_num_hidden_layers):
        b = f"encoder.blocks.{i}."
        yield tower(f"{b}norm0.weight", (D,))
        yield tower(f"{b}norm1.weight", (D,))
        yield tower(f"{b}wqkv.weight", (3 * Q, D))
        yield tower(f"{b}wo.weight", (D, Q))
        yield tower(f"{b}mlp.fc0.weight", (v.vt_intermediate_size, D))
        yield tower(f"{b}mlp.fc1.weight", (D, v.vt_intermediate_size))
    yield tower("encoder.final_layernorm.weight", (D,))
    yield TensorSpec("mm_projector.proj.0.weight", (M, M), "BF16", "mm_projector")
    # the projector writes rows of the text model's width (as NeMo and vLLM: text_config.hidden_size)
    yield TensorSpec("mm_projector.proj.2.weight", (cfg.hidden_size, M), "BF16", "mm_projector")
    yield TensorSpec("mm_projector.post_norm.weight", (cfg.hidden_size,), "BF16", "mm_projector")


def checkpoint_tensors(cfg: K3Config, *, layers: int | None = None) -> Iterator[TensorSpec]:
    """Everything a checkpoint of `cfg` holds: the text model, then the vision path (the last shards)."""
    yield from published_tensors(cfg, layers=layers)
    yield from vision_tensors(cfg)


# ---- classifying names found in a checkpoint ---------------------------------------------------------
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"embed_tokens\."), "embedding"),
    (re.compile(r"(^|\.)lm_head\."), "lm_head"),
    (re.compile(r"_res_(norm|proj)\."), "attn_res"),
    (re.compile(r"\.experts\.\d+\."), "routed_experts"),
    (re.compile(r"\.shared_experts\."), "shared_experts"),
    (re.compile(r"\.gate\.(weight|e_score_correction_bias)$"), "router"),
    (re.compile(r"routed_expert_(down|up)_proj\."), "latent_projections"),
    (re.compile(r"(layernorm|routed_expert_norm|(^|\.)norm)\.weight$"), "norms"),
    (re.compile(r"\.mlp\."), "dense_mlp"),
]


def classify(name: str, cfg: K3Config | None = None) -> tuple[str, int | None]:
    """(component, layer) of a tensor name; attention is split by the layer plan when a config is given.

    The vision path's names come back as ("vision_tower", None) or ("mm_projector", None); names that
    belong to no K3 component as ("other", layer).
    """
    if name.startswith(("vision_tower.", "mm_projector.")):
        return name.split(".", 1)[0], None
    m = _LAYER.search(name)
    layer = int(m.group(1)) if m else None
    if ".self_attn." in name:
        if cfg is not None and layer is not None and layer < cfg.num_hidden_layers:
            return ("kda_attention" if cfg.layer_plan[layer].mixer is Mixer.KDA else "mla_attention"), layer
        kda_only = ("conv1d", "f_a_proj", "f_b_proj", "A_log", "dt_bias", "b_proj", "o_norm", "g_a_proj")
        return ("kda_attention" if any(k in name for k in kda_only) else "mla_attention"), layer
    for pattern, component in _RULES:
        if pattern.search(name):
            return component, layer
    return "other", layer
