"""k3's tower + projector against NeMo Automodel 0.7.0's copy of the reference (tests/vision/nemo_oracle.py)
on the same random weights: features within 1e-5 relative RMS in fp32, for images through k3's
preprocessing (square, wide, tall, 1x1, sides not multiples of 28), a batch of different sizes, and 2- and
4-frame clips; at small widths, at the published widths (2 layers), and the whole published tower (slow).
The merged input embeddings equal NeMo's `_merge_input_ids_with_image_features`."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    PUBLISHED_2_LAYERS,
    k3_features,
    k3_modules,
    noise_image,
    random_weights,
    rel_rms,
    small_config,
)
from nemo_oracle import nemo_features, nemo_merge, nemo_modules

from k3.config import K3Config
from k3.model import K3ForConditionalGeneration
from k3.vision.config import VisionConfig
from k3.vision.preprocess import prepare
from k3.vision.prompt import expand_placeholders

TOL = 1e-5
SIZES = {"square": (56, 56), "wide": (150, 40), "tall": (30, 100), "1x1": (1, 1), "odd": (61, 45)}


def items(sizes, frames=1, seed=0):
    return [
        prepare([noise_image(w, h, seed + i + k) for k in range(frames)]) for i, (w, h) in enumerate(sizes)
    ]


def check(cfg: VisionConfig, prepared, seed=0):
    weights = random_weights(cfg, seed)
    pixels = torch.cat([p.pixels for p in prepared])
    grids = [p.grid for p in prepared]
    ours = k3_features(*k3_modules(cfg, weights), pixels, grids)
    theirs = nemo_features(*nemo_modules(cfg, weights), pixels, grids)
    assert len(ours) == len(theirs) == len(prepared)
    for p, a, b in zip(prepared, ours, theirs, strict=True):
        assert a.shape == b.shape == (p.tokens, cfg.text_hidden_size)
        assert rel_rms(a, b) <= TOL, (p.grid, rel_rms(a, b))
    return ours


@pytest.mark.parametrize("name", sorted(SIZES))
def test_single_images_small_widths(name):
    check(small_config(), items([SIZES[name]]))


def test_a_batch_of_different_sizes_small_widths():
    check(small_config(), items(list(SIZES.values())))


@pytest.mark.parametrize("frames", [2, 4])
def test_clips_small_widths(frames):
    check(small_config(), items([(70, 42), (28, 56)], frames=frames))


def test_published_widths_two_layers():
    cfg = VisionConfig(**PUBLISHED_2_LAYERS)
    assert (cfg.vt_hidden_size, cfg.head_dim, cfg.text_hidden_size) == (1024, 128, 7168)
    check(cfg, items([(61, 45), (28, 84)]) + items([(56, 28)], frames=2))


@pytest.mark.slow
def test_published_tower_whole():
    """All 27 layers at the published widths (447 M parameters, twice in fp32: ~4 GB)."""
    check(VisionConfig(), items([(130, 90)]) + items([(56, 28)], frames=3))


def test_merged_embeddings_equal_nemo():
    """Two prompts in a batch, one image each in the reference's one-pad form: NeMo expands and scatters in
    the model (left-padding the shorter row with zeros); k3 expands the ids (expand_placeholders) and
    K3ForConditionalGeneration.embed scatters the rows into the pads."""
    cfg = K3Config.preset("tiny")
    model = K3ForConditionalGeneration.from_config(cfg, seed=1)
    prepared = items([(61, 45), (30, 100)])
    feats = model.encode_images(prepared)
    pad = model.media_pad_id
    rows = [[1, 2, pad, 3], [4, pad, 5, 6]]
    with torch.no_grad():
        ids = torch.tensor(rows)
        theirs = nemo_merge(feats, model.model.embed_tokens(ids), ids, pad)
        for b, (row, p) in enumerate(zip(rows, prepared, strict=True)):
            expanded = torch.tensor([expand_placeholders(row, pad, [p.tokens])])
            ours = model.embed(expanded, [feats[b]])[0]
            assert torch.equal(ours, theirs[b, -ours.shape[0] :])  # NeMo left-pads the shorter row
