"""Small vision configs, random weights under the published names, and k3's modules loaded with them."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from k3.config import K3Config
from k3.layout import vision_tensors
from k3.vision.config import VisionConfig
from k3.vision.projector import Projector
from k3.vision.tower import VisionTower

SMALL = dict(
    vt_hidden_size=32,
    vt_num_attention_heads=2,
    qkv_hidden_size=48,  # head_dim 24 != hidden / heads, as in K3 (128 vs 1024 / 12)
    vt_num_hidden_layers=2,
    vt_intermediate_size=64,
    mm_hidden_size=32,
    text_hidden_size=40,
    init_pos_emb_height=8,
    init_pos_emb_width=8,
)
# the published widths (1024, 12 heads of 128, 4096, 64 x 64 grid, 7168), 2 of the 27 layers
PUBLISHED_2_LAYERS = dict(vt_num_hidden_layers=2)


def small_config(**over) -> VisionConfig:
    return VisionConfig(**{**SMALL, **over})


def random_weights(cfg: VisionConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """{published name: fp32 tensor}: matrices normal(0, 1/sqrt(fan-in)), grid normal(0, 1), norm weights
    1 + normal(0, 0.2) (not ones, so that a norm's weight matters)."""
    text = K3Config.preset("tiny")
    text.vision_config, text.media_placeholder_token_id = cfg, 0
    text.hidden_size = cfg.text_hidden_size  # the projector writes rows of the text model's width
    g = torch.Generator().manual_seed(seed)
    out = {}
    for spec in vision_tensors(text):
        shape = spec.shape
        if len(shape) == 1:
            t = 1 + 0.2 * torch.randn(shape, generator=g)
        elif spec.name.endswith("pos_emb.weight"):
            t = torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / np.sqrt(np.prod(shape[1:]))
        out[spec.name] = t
    return out


def k3_modules(cfg: VisionConfig, weights: dict[str, torch.Tensor], dtype=torch.float32):
    tower, projector = VisionTower(cfg), Projector(cfg)
    for module, prefix in ((tower, "vision_tower."), (projector, "mm_projector.")):
        state = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
        module.load_state_dict(state, strict=True)
        module.to(dtype).eval()
    return tower, projector


def k3_features(tower, projector, pixels, grids):
    with torch.no_grad():
        return projector(tower(pixels.to(tower.patch_embed.proj.weight.dtype), grids))


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def png_bytes(array: np.ndarray, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, fmt)
    return buf.getvalue()


def noise_image(w: int, h: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    return Image.fromarray(rng.integers(0, 256, (h, w, channels), dtype=np.uint8), mode)
