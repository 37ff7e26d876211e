"""Peak memory of one fp32 tower + projector forward at the published widths, in a process of its own:

    python tests/vision/tower_memory.py SIDE LAYERS   ->   one JSON line

A SIDE x SIDE noise image, the published vision config with LAYERS of its 27 blocks (the activations' peak
is inside one block; the weights term counts the layers built), random weights. `peak_bytes` is the
process's peak RSS minus its RSS once the image is prepared (the runtime and the pixels); `bound` is
k3.vision.bound's total without the pixels (already in that baseline).
"""

from __future__ import annotations

import json
import resource
import sys
import time

import numpy as np
import torch
from PIL import Image

from k3.config import K3Config
from k3.vision.bound import vision_memory_bound
from k3.vision.preprocess import prepare
from k3.vision.projector import Projector
from k3.vision.tower import VisionTower


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss() -> int:
    """VmHWM: this address space's peak RSS (ru_maxrss is not used: Linux carries it across execve, so a
    child of a large pytest process would start from the parent's peak)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def main(side: int, layers: int) -> dict:
    cfg = K3Config.preset("k3")
    vision = cfg.vision_config
    vision.vt_num_hidden_layers = layers
    pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    item = prepare([Image.fromarray(pixels)])
    del pixels
    baseline = rss()
    torch.manual_seed(0)
    tower, projector = VisionTower(vision), Projector(vision, cfg.hidden_size)
    with torch.no_grad():
        for p in [*tower.parameters(), *projector.parameters()]:
            p.normal_(0, 0.02)  # every page written (zeros may stay unmapped)
        start = time.perf_counter()
        rows = projector(tower(item.pixels, [item.grid]))
    seconds = time.perf_counter() - start
    peak = peak_rss() - baseline
    bound = vision_memory_bound(vision, item.pixels.shape[0], cfg.hidden_size)
    return {
        "side": side,
        "layers": layers,
        "patches": item.pixels.shape[0],
        "tokens": item.tokens,
        "rows": list(rows[0].shape),
        "peak_bytes": peak,
        "bound": bound["total"] - bound["pixels"],
        "terms": bound,
        "seconds": seconds,
        "threads": torch.get_num_threads(),
    }


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]))))
