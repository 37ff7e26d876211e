"""The vision tower's configuration: the published `vision_config` of a K3 `config.json`, one field list.

Spec: ../shared/spec/K3-vision.md section 1.2 (the 25 published keys). One key is k3's own:
`vt_rms_norm_eps`, the eps of every tower RMSNorm. The reference builds them as `nn.RMSNorm(1024)` without
an eps, which current PyTorch resolves to float32's machine epsilon, 2^-23 (section 4.5); other engines use
2^-7 (mlxcel, mlx-vlm) or 1e-5 (llama.cpp). It is written to config.json only when set to another value.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any

from k3.errors import K3Error

TORCH_DEFAULT_RMS_EPS = 2.0**-23  # torch.finfo(torch.float32).eps: nn.RMSNorm(eps=None) on current torch
OTHER_ENGINES_EPS = {"mlxcel": 2.0**-7, "mlx-vlm": 2.0**-7, "llama.cpp": 1e-5}
# The <|media_*|> tokens sit at these offsets after the BPE ranks (K3: 163584 + 18 = 163602 ...).
MEDIA_BEGIN_OFFSET, MEDIA_CONTENT_OFFSET, MEDIA_END_OFFSET, MEDIA_PAD_OFFSET = 18, 19, 20, 21


class VisionConfigError(K3Error):
    """A vision_config k3 cannot run; the message names the key."""


_K3_ONLY = {"published": False}


@dataclass(kw_only=True)
class VisionConfig:
    """MoonViT3d + sd2_tpool + patchmergerv2: one field per published key, in the published order."""

    patch_size: int = 14
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4
    pos_emb_type: str = "divided_fixed"
    pos_emb_interpolation_mode: str = "bilinear"
    vt_hidden_size: int = 1024
    vt_num_attention_heads: int = 12
    qkv_hidden_size: int = 1536
    vt_num_hidden_layers: int = 27
    vt_intermediate_size: int = 4096
    norm_type: str = "rmsnorm"
    mlp_type: str = "mlp2"
    activation_func: str = "gelu_pytorch_tanh"
    attn_bias: bool = False
    linear_bias: bool = False
    patch_embed_proj_bias: bool = False
    merge_kernel_size: list[int] = field(default_factory=lambda: [2, 2])
    merge_type: str = "sd2_tpool"
    mm_projector_type: str = "patchmergerv2"
    mm_hidden_size: int = 1024
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    text_hidden_size: int = 7168
    _attn_implementation: str = "flash_attention_2"
    # k3's own, not published: the tower RMSNorm eps (module docstring)
    vt_rms_norm_eps: float = field(default=TORCH_DEFAULT_RMS_EPS, metadata=_K3_ONLY)
    extra: dict[str, Any] = field(default_factory=dict, repr=False, metadata={"kept": True})

    def __post_init__(self) -> None:
        self.validate()

    # ---- derived -----------------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def merge_area(self) -> int:
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @property
    def projector_in(self) -> int:
        """Width of one merged token entering the projector: 4 sub-tokens of mm_hidden_size."""
        return self.mm_hidden_size * self.merge_area

    def validate(self) -> None:
        def fail(key: str, problem: str) -> None:
            raise VisionConfigError(f"vision_config.{key}: {problem}")

        for key in (
            "patch_size",
            "init_pos_emb_height",
            "init_pos_emb_width",
            "init_pos_emb_time",
            "vt_hidden_size",
            "vt_num_attention_heads",
            "qkv_hidden_size",
            "vt_num_hidden_layers",
            "vt_intermediate_size",
            "mm_hidden_size",
            "text_hidden_size",
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                fail(key, f"must be a positive integer, got {value!r}")
        if self.qkv_hidden_size % self.vt_num_attention_heads or self.head_dim % 4:
            fail(
                "qkv_hidden_size",
                f"{self.qkv_hidden_size} / {self.vt_num_attention_heads} heads must be a "
                "multiple of 4 (the 2D RoPE's head_dim)",
            )
        if self.mm_hidden_size != self.vt_hidden_size:
            fail("mm_hidden_size", f"{self.mm_hidden_size} differs from vt_hidden_size {self.vt_hidden_size}")
        if list(self.merge_kernel_size) != [2, 2]:
            fail("merge_kernel_size", f"only [2, 2] is supported, got {self.merge_kernel_size!r}")
        supported = {
            "pos_emb_type": "divided_fixed",
            "pos_emb_interpolation_mode": "bilinear",
            "norm_type": "rmsnorm",
            "mlp_type": "mlp2",
            "activation_func": "gelu_pytorch_tanh",
            "merge_type": "sd2_tpool",
            "mm_projector_type": "patchmergerv2",
            "projector_hidden_act": "gelu",
        }
        for key, only in supported.items():
            if getattr(self, key) != only:
                fail(key, f"only {only!r} (Kimi K3) is supported, got {getattr(self, key)!r}")
        for key in ("attn_bias", "linear_bias", "patch_embed_proj_bias"):
            if getattr(self, key) is not False:
                fail(key, f"only false (Kimi K3 has no biases) is supported, got {getattr(self, key)!r}")
        for key in ("projector_ln_eps", "vt_rms_norm_eps"):
            value = getattr(self, key)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                fail(key, f"must be a positive number, got {value!r}")

    # ---- published form ------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> VisionConfig:
        if not isinstance(raw, dict):
            raise VisionConfigError(f"vision_config: expected a JSON object, got {type(raw).__name__}")
        raw = copy.deepcopy(raw)
        values = {f.name: raw.pop(f.name) for f in _fields() if f.name in raw}
        if "merge_kernel_size" in values and not isinstance(values["merge_kernel_size"], list):
            values["merge_kernel_size"] = list(values["merge_kernel_size"])
        values.setdefault("mm_hidden_size", values.get("vt_hidden_size", 1024))
        return cls(**values, extra=raw)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in _fields():
            value = getattr(self, f.name)
            if not f.metadata.get("published", True) and value == f.default:
                continue
            out[f.name] = list(value) if isinstance(value, list) else value
        return {**out, **self.extra}


def _fields() -> list:
    return [f for f in fields(VisionConfig) if not f.metadata.get("kept")]


def media_token_ids(vocab_size: int) -> dict[str, int]:
    """The four media token ids of a vocabulary of `vocab_size` ids (256 specials after the BPE ranks)."""
    n_ranks = vocab_size - 256
    return {
        "begin": n_ranks + MEDIA_BEGIN_OFFSET,
        "content": n_ranks + MEDIA_CONTENT_OFFSET,
        "end": n_ranks + MEDIA_END_OFFSET,
        "pad": n_ranks + MEDIA_PAD_OFFSET,
    }
