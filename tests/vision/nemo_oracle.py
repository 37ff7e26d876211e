"""NeMo Automodel 0.7.0's copy of the reference tower and projector (nemo_automodel.components.models.
kimi_k3.vision, near-verbatim from the checkpoint's modeling_kimi_k3.py), built from a k3 VisionConfig and
loaded with the same weights. Its math is not touched: only its attention choice is set to "eager" (no
flash-attn on CPU) and torch.compile is off (TORCHDYNAMO_DISABLE=1: its position-grid helper is compiled).
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
from nemo_automodel.components.models.kimi_k3 import vision as nemo_vision  # noqa: E402
from nemo_automodel.components.models.kimi_k3.config import KimiK3VisionConfig  # noqa: E402
from nemo_automodel.components.models.kimi_k3.multimodal import (  # noqa: E402
    KimiK3ForConditionalGeneration,
    _projector_config,
    _vision_tower_config,
)

from k3.vision.config import VisionConfig  # noqa: E402


class _Top:
    """The two attributes of NeMo's KimiK3Config that its helpers read."""

    def __init__(self, vision_config, text_hidden: int) -> None:
        self.vision_config = vision_config
        self.text_config = type("T", (), {"hidden_size": text_hidden})()


def nemo_modules(cfg: VisionConfig, weights: dict[str, torch.Tensor], dtype=torch.float32):
    """(tower, projector) of NeMo with `weights` ({published name: tensor}) loaded strictly."""
    raw = {k: v for k, v in cfg.to_dict().items() if k != "vt_rms_norm_eps"}
    raw["_attn_implementation"] = "eager"
    vcfg = KimiK3VisionConfig(**raw)
    top = _Top(vcfg, cfg.text_hidden_size)
    tower = nemo_vision.MoonViT3dPretrainedModel(_vision_tower_config(top))
    projector = nemo_vision.PatchMergerMLPV2(_projector_config(top))
    for module, prefix in ((tower, "vision_tower."), (projector, "mm_projector.")):
        state = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
        module.load_state_dict(state, strict=True)
        module.to(dtype).eval()
    return tower, projector


def nemo_features(tower, projector, pixels: torch.Tensor, grids: list[tuple[int, int, int]]):
    """NeMo's `_extract_image_features`: projector(tower(pixels)) per item."""
    grid_thws = torch.tensor(grids, dtype=torch.int64)
    with torch.no_grad():
        return list(projector(tower(pixels.to(tower.patch_embed.proj.weight.dtype), grid_thws)))


def nemo_merge(features, embeds, input_ids, pad_id: int, text_pad_id: int = -1):
    """NeMo's `_merge_input_ids_with_image_features` (one pad per image, expanded in the model)."""
    holder = type("M", (), {})()
    holder.config = type(
        "C", (), {"media_placeholder_token_id": pad_id, "pad_token_id": text_pad_id, "ignore_index": -100}
    )()
    out, _, _, _ = KimiK3ForConditionalGeneration._merge_input_ids_with_image_features(
        holder, features, embeds, input_ids, torch.ones_like(input_ids)
    )
    return out
