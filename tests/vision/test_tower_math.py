"""The tower's pieces against closed forms (K3-vision.md section 9.2), the naive loop reference in float64,
the pinned RMSNorm eps, isolation between images, and the bf16 mode's distance from fp32."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import k3_features, k3_modules, random_weights, rel_rms, small_config

from k3.vision import naive
from k3.vision.config import OTHER_ENGINES_EPS, TORCH_DEFAULT_RMS_EPS, VisionConfig
from k3.vision.position import resample_grid, rope_angles, rope_frequencies, time_table
from k3.vision.tower import rms_norm, tpool_merge


def ramp(h, w):
    return torch.arange(h * w, dtype=torch.float32).reshape(h, w, 1)  # value 4y + x for w = 4


def test_grid_interpolation_of_a_ramp():
    g = ramp(4, 4)
    assert resample_grid(g, 2, 2).flatten().tolist() == [2.5, 4.5, 10.5, 12.5]
    up = resample_grid(g, 8, 8).reshape(8, 8)
    assert up[0, 0] == 0 and up[7, 7] == 15 and up[0, 1] == 0.25
    assert torch.equal(resample_grid(g, 4, 4), g.flatten(0, 1))  # identity at the grid's own size
    # the naive closed form agrees on an uneven, non-ramp case
    r = torch.randn(5, 7, 3, dtype=torch.float64)
    assert torch.allclose(resample_grid(r, 3, 11).reshape(3, 11, 3), naive.bilinear(r, 3, 11), atol=1e-12)


def test_time_table_first_rows():
    t = time_table(4, 1024)
    assert torch.equal(t[0, :512], torch.zeros(512)) and torch.equal(t[0, 512:], torch.ones(512))
    assert t[1, 0] == pytest.approx(math.sin(1.0), abs=1e-7)
    assert t[1, 512] == pytest.approx(math.cos(1.0), abs=1e-7)
    assert t[2, 1] == pytest.approx(math.sin(2 / 10000 ** (1 / 512)), abs=1e-6)


def test_rope_angles_of_known_positions():
    d = 128
    f = rope_frequencies(d)
    assert f.shape == (32,) and f[0] == 1 and f[1] == pytest.approx(10000 ** (-4 / 128))
    a = rope_angles(d, [(1, 2, 3)])  # h = 2, w = 3: token 5 is y = 1, x = 2
    assert torch.equal(a[0], torch.zeros(64))
    assert torch.allclose(a[5, 0::2], 2 * f) and torch.allclose(a[5, 1::2], 1 * f)
    assert torch.equal(rope_angles(d, [(3, 2, 3)]), a.repeat(3, 1))  # frames repeat the table


def test_merger_t2_example():
    """t = 2, a 4x4 grid, value 100t + 4y + x: token 0 = [50, 51, 54, 55], token 1 = [52, 53, 56, 57]."""
    t, y, x = torch.meshgrid(torch.arange(2), torch.arange(4), torch.arange(4), indexing="ij")
    v = (100 * t + 4 * y + x).float().reshape(-1, 1)
    out = tpool_merge(v, [(2, 4, 4)])[0]
    assert out.shape == (4, 4, 1)
    assert out[0].flatten().tolist() == [50, 51, 54, 55] and out[1].flatten().tolist() == [52, 53, 56, 57]


def test_rms_norm_eps_is_torch_default():
    """nn.RMSNorm without eps (the reference's tower norms) = eps 2^-23 on this torch; 2^-7 and 1e-5 differ.
    Small inputs (mean square ~1e-6) make the eps visible."""
    x = torch.randn(64, 32) * 1e-3
    w = torch.rand(32) + 0.5
    ref = torch.nn.RMSNorm(32)
    with torch.no_grad():
        ref.weight.copy_(w)
        expected = ref(x)
    assert torch.allclose(rms_norm(x, w, TORCH_DEFAULT_RMS_EPS), expected, rtol=1e-6, atol=0)
    assert TORCH_DEFAULT_RMS_EPS == torch.finfo(torch.float32).eps == VisionConfig().vt_rms_norm_eps
    for eps in OTHER_ENGINES_EPS.values():
        assert rel_rms(rms_norm(x, w, eps), expected) > 1e-2
    assert torch.allclose(F.rms_norm(x, (32,), w, eps=None), expected)


def test_eps_is_selectable_and_round_trips():
    cfg = small_config(vt_rms_norm_eps=2.0**-7)
    assert "vt_rms_norm_eps" not in small_config().to_dict()  # not a published key: default not written
    assert VisionConfig.from_dict(cfg.to_dict()).vt_rms_norm_eps == 2.0**-7


@pytest.mark.parametrize("grid", [(1, 4, 6), (2, 2, 4), (4, 2, 2)])
def test_matches_the_naive_reference_in_float64(grid):
    cfg = small_config()
    weights = random_weights(cfg, seed=2)
    t, h, w = grid
    pixels = torch.randn(
        t * h * w, 3, 14, 14, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    fast = k3_features(*k3_modules(cfg, weights, torch.float64), pixels, [grid])[0]
    slow = naive.item_features({k: v.double() for k, v in weights.items()}, cfg, pixels, grid)
    # the fast path rotates q, k in float32 whatever the dtype (the reference's rule): ~1e-7, not 1e-15
    assert rel_rms(fast, slow) < 1e-6


def test_isolation_between_images():
    """Changing image B's pixels changes nothing of image A's features (block-diagonal attention)."""
    cfg = small_config()
    modules = k3_modules(cfg, random_weights(cfg))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(24, 3, 14, 14, generator=g), torch.randn(16, 3, 14, 14, generator=g)
    grids = [(1, 4, 6), (1, 4, 4)]
    first = k3_features(*modules, torch.cat([a, b]), grids)
    second = k3_features(*modules, torch.cat([a, b + 1]), grids)
    assert torch.equal(first[0], second[0]) and not torch.allclose(first[1], second[1])


def test_bf16_mode_distance_from_fp32():
    """BF16 weights and activations as the reference runs (RoPE, norms, softmax in fp32): close to fp32."""
    cfg = small_config()
    weights = random_weights(cfg)
    pixels = torch.randn(48, 3, 14, 14, generator=torch.Generator().manual_seed(0))
    grids = [(1, 6, 8)]
    w16 = {k: v.bfloat16().float() for k, v in weights.items()}  # the same weights, BF16-rounded
    fp32 = k3_features(*k3_modules(cfg, w16), pixels, grids)[0]
    bf16 = k3_features(*k3_modules(cfg, w16, torch.bfloat16), pixels, grids)[0]
    assert bf16.dtype == torch.bfloat16
    assert 1e-4 < rel_rms(bf16, fp32) < 3e-2
    # and close to the reference's own bf16 run (NeMo's eager tower in BF16)
    from nemo_oracle import nemo_features, nemo_modules

    theirs = nemo_features(*nemo_modules(cfg, w16, torch.bfloat16), pixels, grids)[0]
    assert rel_rms(bf16, theirs) < 1e-3  # measured 0.0: the same BF16 ops in the same order
