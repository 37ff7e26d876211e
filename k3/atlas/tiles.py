"""Weight-viewer tiles: PNG images of a matrix at every zoom level, drawn with the diverging scale.

Geometry (what Leaflet's `CRS.Simple` expects): a tensor is viewed as a matrix [rows, cols] (a vector as one
row, higher ranks flattened after the first dimension). Tiles are `TILE` x `TILE` pixels. At the finest
level `max_level` one pixel is one weight; each level above halves the resolution, so at level z a pixel
stands for a block of f x f weights, f = 2^(max_level - z), and level 0 fits the whole matrix in one tile.
The page zooms past `max_level` by enlarging pixels, down to single weights drawn as squares.

A pixel's value is the mean of its block (`mean`) or its value of largest magnitude (`maxabs`). Colour: the
sign picks the hue (positive amber, negative red), the magnitude the brightness, from the background
colour at zero to full colour at the scale's end, `vmax`. `vmax` is the tensor's 99th percentile of |w|
(from the scan), divided by f for block means: the mean of f x f independent weights is about f times
smaller, so each level keeps a visible contrast; the page's legend shows the scale of the current level.

Blocks of very large matrices are row-sampled at coarse levels (the first rows of each block, so that one
tile never reads more than `READ_BUDGET` bytes); the geometry says from which level on.
"""

from __future__ import annotations

import io
import math
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from k3.atlas.db import LogicalTensor

TILE = 256
MODES = ("mean", "maxabs")
READ_BUDGET = 64 * 2**20  # stored bytes one tile may read
GAMMA = 0.5  # brightness = (|v| / vmax) ** GAMMA: small weights stay visible

# the diverging scale, RGB; the page's CSS uses the same colours
BACKGROUND = (14, 16, 22)
POSITIVE = (255, 183, 3)  # amber
NEGATIVE = (239, 55, 64)  # red


def matrix_shape(t: LogicalTensor) -> tuple[int, int]:
    if len(t.shape) == 0:
        return 1, 1
    if len(t.shape) == 1:
        return 1, t.shape[0]
    return t.shape[0], math.prod(t.shape[1:])


def tile_geometry(t: LogicalTensor, stats: dict[str, Any] | None) -> dict[str, Any]:
    rows, cols = matrix_shape(t)
    max_level = max(0, math.ceil(math.log2(max(rows, cols) / TILE))) if max(rows, cols) > TILE else 0
    vmax = None
    if stats:
        vmax = stats.get("abs_p99") or stats.get("abs_max") or None
    row_bytes = t.bytes / max(rows, 1)
    sampled_from = None
    for z in range(max_level + 1):
        f = 2 ** (max_level - z)
        if rows_per_pixel(f, row_bytes) < f:
            sampled_from = z  # levels <= z are row-sampled
    return {
        "rows": rows,
        "cols": cols,
        "tile": TILE,
        "max_level": max_level,
        "vmax": vmax,
        "gamma": GAMMA,
        "modes": list(MODES),
        "row_sampled_up_to_level": sampled_from,
        "colors": {"background": BACKGROUND, "positive": POSITIVE, "negative": NEGATIVE},
    }


def rows_per_pixel(f: int, row_bytes: float) -> int:
    """Rows read per block of f rows: all of them unless a tile (TILE blocks high) would exceed the budget."""
    if TILE * f * row_bytes <= READ_BUDGET:
        return f
    return max(1, int(READ_BUDGET // (TILE * row_bytes)))


def colorize(values: np.ndarray, vmax: float, valid: np.ndarray | None = None) -> np.ndarray:
    """float [h, w] -> RGBA uint8 [h, w, 4] on the diverging scale; pixels outside `valid` transparent."""
    v = np.nan_to_num(values.astype(np.float64), nan=0.0)
    t = np.clip(np.abs(v) / vmax, 0.0, 1.0) ** GAMMA if vmax > 0 else np.zeros_like(v)
    bg = np.array(BACKGROUND, dtype=np.float64)
    hue = np.where(
        (v >= 0)[..., None], np.array(POSITIVE, dtype=np.float64), np.array(NEGATIVE, dtype=np.float64)
    )
    rgb = bg + t[..., None] * (hue - bg)
    alpha = np.full(v.shape + (1,), 255.0) if valid is None else np.where(valid[..., None], 255.0, 0.0)
    return np.concatenate([rgb, alpha], axis=-1).round().astype(np.uint8)


def encode_png(rgba: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rgba, mode="RGBA").save(buf, format="PNG", optimize=False, compress_level=6)
    return buf.getvalue()


class TileRenderer:
    """Renders tiles of the tensors of one atlas from its checkpoint, keeping the last `cache_size`."""

    def __init__(self, reader, cache_size: int = 512):
        self.reader = reader
        self.cache: OrderedDict[tuple, bytes] = OrderedDict()
        self.cache_size = cache_size
        self._lock = threading.Lock()  # the server renders tiles on several threads

    def load_rows(self, t: LogicalTensor, start: int, stop: int) -> torch.Tensor:
        """float32 [stop-start, cols] of the matrix view of t."""
        if len(t.shape) <= 1:
            flat = torch.cat([c.reshape(-1).to(torch.float32) for c in self.reader.flat_chunks(t.parts[0])])
            return flat.reshape(1, -1)[start:stop]
        return self.reader.logical_rows(t, start, stop)

    def values(self, t: LogicalTensor, r: int, c: int, h: int, w: int) -> list[list[float]]:
        rows, cols = matrix_shape(t)
        if not (0 <= r < rows and 0 <= c < cols):
            raise ValueError(f"({r}, {c}) is outside the {rows} x {cols} matrix")
        block = self.load_rows(t, r, min(rows, r + h))[:, c : min(cols, c + w)]
        return block.tolist()

    def tile(
        self, t: LogicalTensor, stats: dict[str, Any] | None, mode: str, z: int, x: int, y: int
    ) -> bytes:
        key = (t.id, mode, z, x, y)
        with self._lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
        png = encode_png(self.render(t, stats, mode, z, x, y))
        with self._lock:
            self.cache[key] = png
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return png

    def pixel_values(
        self, t: LogicalTensor, stats: dict[str, Any] | None, mode: str, z: int, x: int, y: int
    ) -> tuple[np.ndarray, int]:
        """(values [ph, pw] of the pixels of tile (x, y) at level z that lie on the matrix, f = weights per
        pixel side). ValueError for a tile or mode that does not exist."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        geo = tile_geometry(t, stats)
        rows, cols, top = geo["rows"], geo["cols"], geo["max_level"]
        if not 0 <= z <= top:
            raise ValueError(f"level {z} is outside 0..{top}")
        f = 2 ** (top - z)
        span = TILE * f  # weights per tile side
        if not (0 <= x < math.ceil(cols / span) and 0 <= y < math.ceil(rows / span)):
            raise ValueError(f"tile ({x}, {y}) is outside level {z}")
        r0, r1 = y * span, min(rows, (y + 1) * span)
        c0, c1 = x * span, min(cols, (x + 1) * span)
        ph, pw = math.ceil((r1 - r0) / f), math.ceil((c1 - c0) / f)
        row_bytes = t.bytes / max(rows, 1)
        take = rows_per_pixel(f, row_bytes)
        pixels = np.zeros((ph, pw), dtype=np.float64)
        if take == f:  # every row: pixel rows in groups whose rows fit the budget
            group = max(1, int(READ_BUDGET // max(1.0, f * row_bytes)))
            for p0 in range(0, ph, group):
                p1 = min(ph, p0 + group)
                block = self.load_rows(t, r0 + p0 * f, min(r1, r0 + p1 * f))[:, c0:c1]
                pixels[p0:p1] = _reduce(block, f, mode)
        else:  # the first `take` rows of each block of f
            for p in range(ph):
                rb = r0 + p * f
                block = self.load_rows(t, rb, min(r1, rb + take))[:, c0:c1]
                pixels[p] = _reduce(block, f, mode, row_block=block.shape[0])[0]
        return pixels, f

    def render(
        self, t: LogicalTensor, stats: dict[str, Any] | None, mode: str, z: int, x: int, y: int
    ) -> np.ndarray:
        """RGBA [TILE, TILE, 4] of tile (x, y) at level z; ValueError for a tile that does not exist."""
        pixels, f = self.pixel_values(t, stats, mode, z, x, y)
        vmax = float((tile_geometry(t, stats)["vmax"]) or np.abs(pixels).max() or 1.0)
        if mode == "mean":
            vmax /= f
        canvas = np.zeros((TILE, TILE), dtype=np.float64)
        valid = np.zeros((TILE, TILE), dtype=bool)
        ph, pw = pixels.shape
        canvas[:ph, :pw] = pixels
        valid[:ph, :pw] = True
        return colorize(canvas, vmax, valid)


def _reduce(block: torch.Tensor, f: int, mode: str, row_block: int | None = None) -> np.ndarray:
    """float32 [r, c] -> [ceil(r/fr), ceil(c/f)]: block means or signed max-magnitudes (fr = row_block)."""
    fr = row_block or f
    r, c = block.shape
    pr, pc = math.ceil(r / fr), math.ceil(c / f)
    padded = torch.zeros(pr * fr, pc * f, dtype=torch.float32)
    padded[:r, :c] = block
    blocks = padded.reshape(pr, fr, pc, f).permute(0, 2, 1, 3).reshape(pr, pc, fr * f)  # [pr, pc, fr*f]
    if mode == "mean":
        counts = torch.zeros(pr * fr, pc * f)
        counts[:r, :c] = 1
        n = counts.reshape(pr, fr, pc, f).sum(dim=(1, 3))
        return (blocks.double().sum(-1) / n.double()).numpy()
    idx = blocks.abs().argmax(-1, keepdim=True)
    return blocks.gather(-1, idx).squeeze(-1).double().numpy()
