"""K3 with its eyes: the text model plus the vision tower and projector, whose rows replace the
`<|media_pad|>` placeholders' embeddings (spec K3-vision.md section 4.8). Everything else is K3ForCausalLM
unchanged: a text-only forward, the cache, the fused decode step.

    model = K3ForConditionalGeneration.from_pretrained("checkpoints/mini")
    item = prepare([open_image(data)])                  # k3.vision.preprocess
    ids = ...  # the prompt with item.tokens pads (or one pad: expand_placeholders)
    logits = model(ids[None], images=[item])

The tower runs in `vision_dtype` (fp32 by default; torch.bfloat16 runs as the reference does, BF16
weights with RoPE, norms and softmax in fp32); its rows enter the text model in its compute dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from k3.config import K3Config
from k3.errors import K3Error
from k3.model.cache import ModelCache
from k3.model.model import K3ForCausalLM
from k3.vision.preprocess import Prepared
from k3.vision.projector import Projector
from k3.vision.prompt import PromptError
from k3.vision.tower import VisionTower


class K3ForConditionalGeneration(K3ForCausalLM):
    loads_vision = True

    def __init__(
        self,
        cfg: K3Config,
        *,
        num_layers: int | None = None,
        quantized_experts: bool | None = None,
        compute_dtype: torch.dtype = torch.float32,
        vision_dtype: torch.dtype = torch.float32,
    ) -> None:
        if cfg.vision_config is None:
            raise K3Error("this config has no vision_config: a text-only model (use K3ForCausalLM)")
        super().__init__(
            cfg, num_layers=num_layers, quantized_experts=quantized_experts, compute_dtype=compute_dtype
        )
        self.vision_tower = VisionTower(cfg.vision_config)
        self.mm_projector = Projector(cfg.vision_config, cfg.hidden_size)
        self.vision_dtype = vision_dtype

    @property
    def media_pad_id(self) -> int:
        return int(self.config.media_placeholder_token_id)

    def image_features(
        self, pixels: torch.Tensor, grids: Sequence[tuple[int, int, int]]
    ) -> list[torch.Tensor]:
        """Patches [N, 3, P, P] of several images or clips -> per item [tokens, hidden] (compute dtype)."""
        if self.vision_tower.patch_embed.proj.weight.dtype != self.vision_dtype:
            self.vision_tower.to(self.vision_dtype)  # once: e.g. BF16 checkpoint weights for an fp32 tower
            self.mm_projector.to(self.vision_dtype)
        with torch.no_grad():
            rows = self.mm_projector(self.vision_tower(pixels.to(self.vision_dtype), list(grids)))
        return [r.to(self.compute_dtype) for r in rows]

    def encode_images(self, images: Sequence[Prepared]) -> list[torch.Tensor]:
        if not images:
            return []
        return self.image_features(torch.cat([im.pixels for im in images]), [im.grid for im in images])

    def embed(self, input_ids: torch.Tensor, features: Sequence[torch.Tensor]) -> torch.Tensor:
        """input_ids [B, T] (expanded form) -> [B, T, H]: token embeddings, the pads' rows replaced by the
        images' rows in order (row-major over the batch); the counts must agree exactly."""
        embeds = self.model.embed_tokens(input_ids).to(self.compute_dtype)
        mask = input_ids == self.media_pad_id
        rows = sum(f.shape[0] for f in features)
        if int(mask.sum()) != rows:
            raise PromptError(
                f"the prompt has {int(mask.sum())} <|media_pad|> placeholders, "
                f"its {len(features)} images {rows} rows"
            )
        if rows:
            embeds[mask] = torch.cat(list(features)).to(embeds.dtype)
        return embeds

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: ModelCache | None = None,
        *,
        lengths: torch.Tensor | list[int] | None = None,
        logits_to_keep: int = 0,
        images: Sequence[Prepared] | None = None,
        features: Sequence[torch.Tensor] | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As K3ForCausalLM, plus `images` (prepared items whose rows fill this chunk's pads, in order) or
        their `features` (image_features' output, e.g. cached). Without either: text only, unchanged."""
        if images is not None or features is not None:
            if features is None:
                features = self.encode_images(images or [])
            inputs_embeds = self.embed(input_ids, features)
        return super().forward(
            input_ids, cache, lengths=lengths, logits_to_keep=logits_to_keep, inputs_embeds=inputs_embeds
        )

    @classmethod
    def from_pretrained(cls, source: str | Path, **kwargs) -> K3ForConditionalGeneration:
        """K3ForCausalLM.from_pretrained plus the tower (`vision_tower.*`, `mm_projector.*`), checked by name,
        shape and dtype; `vision_dtype` as in the constructor."""
        vision_dtype = kwargs.pop("vision_dtype", torch.float32)
        model = super().from_pretrained(source, **kwargs)
        model.vision_dtype = vision_dtype
        return model
