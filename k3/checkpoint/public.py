"""The public K3 checkpoints engine authors test with, as layouts k3 writes exactly (random weights):
config.json byte for byte, tensor names, shapes, dtypes, file names and index as published
(../shared/spec/checkpoints.md sections 2, 3, 6).

    layout = PUBLIC_LAYOUTS["kimi-k3-0.40b-mxfp4"]
    for spec in public_tensors(layout):       # TensorSpec: text model, then the vision tower + projector
        ...

    kimi-k3-0.40b        inference-optimization/Kimi-K3-0.40B        model.safetensors   F32
    kimi-k3-0.40b-mxfp4  inference-optimization/Kimi-K3-0.40B-MXFP4  model.safetensors   F32 + U8 (routed,
                                                     latent and shared experts packed: 203 weights)
    kimi-k3-4layer       eatang/Kimi-K3-4layer       shards + index      BF16 + F32 (no packing)

What is exact and what is reconstructed: the 0.40B config.json is the published file (4,004 B, sha256
503bd5d1…); the MXFP4 one adds a quantization_config whose published JSON is unknown (k3 writes the
release's, its ignore list less shared_experts, in text_config); the 4-layer one is the release's config.json
(7,006 B as published) cut as its card says. The 0.40B-MXFP4's packed set comes from its converter log.
`Kimi-K3-4.6B-A4.5B-small` is not here: its config (layers, experts, widths) is not public.

The vision tower and projector come from the config's vision_config through k3.layout.vision_tensors
(the 0.40B family's: a 2-block tower, 256 wide), in the checkpoint's dtypes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from k3.config import K3Config
from k3.layout import TensorSpec, checkpoint_tensors


@dataclass(frozen=True)
class PublicLayout:
    name: str  # the preset (k3/presets/NAME.json holds its config.json as published)
    repo: str  # the Hub repository
    revision: str | None  # a commit public projects pinned
    single_file: bool  # one model.safetensors without an index (else shards + index)
    all_f32: bool  # every floating tensor F32 (the 0.40B family); else the release's BF16 + F32

    def config(self) -> K3Config:
        return K3Config.preset(self.name)


PUBLIC_LAYOUTS = {
    layout.name: layout
    for layout in (
        PublicLayout(
            "kimi-k3-0.40b",
            "inference-optimization/Kimi-K3-0.40B",
            "d853649387ffe8f48ce0198a29ac1a44205031f7",
            single_file=True,
            all_f32=True,
        ),
        PublicLayout(
            "kimi-k3-0.40b-mxfp4",
            "inference-optimization/Kimi-K3-0.40B-MXFP4",
            "ef3902c318fb8e13c3507e26055656e687fdfe38",
            single_file=True,
            all_f32=True,
        ),
        PublicLayout("kimi-k3-4layer", "eatang/Kimi-K3-4layer", None, single_file=False, all_f32=False),
    )
}


# ---- the whole layout ----------------------------------------------------------------------------------
def public_tensors(layout: PublicLayout) -> Iterator[TensorSpec]:
    """Every tensor of the published checkpoint, in the published dtypes: the text model (packed weights
    U8 as the checkpoint packs them), then the vision tower and projector."""
    cfg = layout.config()
    for spec in checkpoint_tensors(cfg):  # the vision path from the config's vision_config (k3.layout)
        if layout.all_f32 and spec.dtype != "U8":
            spec = TensorSpec(spec.name, spec.shape, "F32", spec.component, spec.layer, spec.count)
        yield spec
