"""The tower's memory bound (k3.vision.bound, docs/vision.md "Memory"): its parameter count against the
published layout's tensors, and a forward's peak RSS, measured in a process of its own
(tests/vision/tower_memory.py), against it: a 896x896 image here, the 3584x3584 one (16,384 tokens) under
`-m slow`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3.config import K3Config
from k3.layout import vision_tensors
from k3.vision.bound import vision_memory_bound, vision_params

HERE = Path(__file__).parent


def test_parameter_count_is_the_published_layouts():
    cfg = K3Config.preset("k3")
    assert vision_params(cfg.vision_config, cfg.hidden_size) == 447_358_976
    assert vision_params(cfg.vision_config, cfg.hidden_size) == sum(
        math.prod(t.shape) for t in vision_tensors(cfg)
    )
    bound = vision_memory_bound(cfg.vision_config, 65_536, cfg.hidden_size)
    assert bound["activations"] == 4 * 65_536 * (3 * 1024 + 5 * 1536 + 2 * 4096)  # 4.97 GB, a block's MLP


def measure(side: int, layers: int, env: dict[str, str]) -> dict:
    out = subprocess.run(
        [sys.executable, str(HERE / "tower_memory.py"), str(side), str(layers)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.splitlines()[-1])


def test_a_896_image_stays_within_the_bound():
    """Freed buffers returned to the system at once (as glibc does by itself for buffers over 32 MB, i.e.
    every activation of the 3584x3584 case below): RSS then follows the live tensors."""
    r = measure(896, 1, {"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert r["tokens"] == 1024 and r["rows"] == [1024, 7168]
    print(f"896x896, 1 layer: peak {r['peak_bytes'] / 1e6:.0f} MB, bound {r['bound'] / 1e6:.0f} MB")
    assert r["peak_bytes"] <= r["bound"]
    assert r["peak_bytes"] >= 0.7 * r["bound"]  # the bound is not vacuous: the terms are what is used


@pytest.mark.slow
def test_a_3584_image_of_16384_tokens_stays_within_the_bound():
    """Published widths, one block (the activations' peak is inside one; more blocks add 59 MB of weights
    each, counted by the bound): about 30 TFLOP (the attention of 65,536 patches), 208 s on 2 cores."""
    r = measure(3584, 1, {})
    assert r["patches"] == 65_536 and r["tokens"] == 16_384
    print(f"3584x3584, 1 layer: peak {r['peak_bytes'] / 1e9:.2f} GB, bound {r['bound'] / 1e9:.2f} GB")
    assert r["peak_bytes"] <= r["bound"]
