"""Preprocessing against Pillow and numpy as the oracle (K3-vision.md section 5): every row of the worked
table of sizes, the chessboard composite values, padding exactly -1, the patch order; bad images refused
with an ImageError that names the problem; `k3 vision preprocess`."""

from __future__ import annotations

import io
import json
import zlib

import numpy as np
import pytest
import torch
from helpers import noise_image, png_bytes
from PIL import Image
from typer.testing import CliRunner

from k3.cli import app
from k3.vision.preprocess import (
    ImageError,
    chessboard,
    fill_transparent,
    navit_geometry,
    open_image,
    prepare,
)

# (w, h) -> resized, padded, (gh, gw), tokens: the spec's worked table, row by row
TABLE = [
    ((303, 181), (303, 181), (308, 196), (14, 22), 77),
    ((30, 16), (30, 16), (56, 28), (2, 4), 2),
    ((60, 60), (60, 60), (84, 84), (6, 6), 9),
    ((100, 100), (100, 100), (112, 112), (8, 8), 16),
    ((1, 1), (1, 1), (28, 28), (2, 2), 1),
    ((896, 896), (896, 896), (896, 896), (64, 64), 1024),
    ((1024, 768), (1024, 768), (1036, 784), (56, 74), 1036),
    ((1920, 1080), (1920, 1080), (1932, 1092), (78, 138), 2691),
    ((3584, 3584), (3584, 3584), (3584, 3584), (256, 256), 16384),
    ((4000, 3000), (4000, 3000), (4004, 3024), (216, 286), 15444),
    ((8000, 8000), (3586, 3586), (3612, 3612), (258, 258), 16641),
    ((10000, 100), (7168, 71), (7168, 84), (6, 512), 768),
]


@pytest.mark.parametrize(("size", "resized", "padded", "grid", "tokens"), TABLE)
def test_the_worked_table(size, resized, padded, grid, tokens):
    g = navit_geometry(*size)
    assert (g.original, g.resized, g.padded, g.grid, g.tokens) == (size, resized, padded, grid, tokens)


def oracle_pixels(img: Image.Image, resized, padded) -> np.ndarray:
    """Pillow + numpy, written from the spec: BICUBIC resize, RGB, black pad, /255, -0.5, *2."""
    rgb = np.asarray(img.resize(resized, Image.Resampling.BICUBIC).convert("RGB"))
    out = np.zeros((padded[1], padded[0], 3), np.uint8)
    out[: rgb.shape[0], : rgb.shape[1]] = rgb
    return ((out / 255.0).astype(np.float32) - 0.5) * 2.0


@pytest.mark.parametrize("size", [(61, 45), (1, 1), (300, 20), (10000, 30)])
def test_pixels_and_patch_order_equal_the_oracle(size):
    img = noise_image(*size, seed=1)
    item = prepare([img])
    g = item.geometry
    ref = oracle_pixels(img, g.resized, g.padded)  # [H, W, 3]
    gh, gw = g.grid
    assert item.pixels.shape == (gh * gw, 3, 14, 14) and item.grid == (1, gh, gw)
    for n in (0, gw - 1, gh * gw - 1, (gh // 2) * gw + gw // 2):  # patch n is row n // gw, column n % gw
        py, px = divmod(n, gw)
        block = ref[14 * py : 14 * py + 14, 14 * px : 14 * px + 14].transpose(2, 0, 1)  # [3, 14, 14]
        assert torch.equal(item.pixels[n], torch.from_numpy(np.ascontiguousarray(block)))
    # padding is exactly -1: columns right of the resized width, rows below its height
    full = item.pixels.reshape(gh, gw, 3, 14, 14).permute(0, 3, 1, 4, 2).reshape(gh * 14, gw * 14, 3)
    assert torch.all(full[:, g.resized[0] :] == -1) and torch.all(full[g.resized[1] :] == -1)


def test_patch_order_red_blue():
    """30x16, left half red, right half blue -> 56x28: patch 2 (columns 28..41) has blue at x = 28, 29
    (image columns 28, 29), then -1 (padding)."""
    a = np.zeros((16, 30, 3), np.uint8)
    a[:, :15, 0] = 255
    a[:, 15:, 2] = 255
    item = prepare([open_image(png_bytes(a))])
    p = item.pixels[2]  # [3, 14, 14], row 0 of patches, third column
    assert torch.equal(p[:, 0, 0], torch.tensor([-1.0, -1.0, 1.0])) and torch.equal(p[:, 0, 1], p[:, 0, 0])
    assert torch.all(p[:, :, 2:] == -1) and torch.all(p[:, 2 * 8 :, :] == -1)


def test_chessboard_composite_values():
    """(40, 40, 40, alpha 128) over white -> 147, over gray -> 109 (ML example); board squares of 8 px."""
    board = chessboard(32, 16)
    assert board[0, 0, 0] == 255 and board[0, 8, 0] == 180 and board[8, 0, 0] == 180 and board[8, 8, 0] == 255
    img = Image.new("RGBA", (16, 16), (40, 40, 40, 128))
    out = fill_transparent(img)
    assert out[0, 0].tolist() == [147] * 3 and out[0, 8].tolist() == [109] * 3
    assert fill_transparent(Image.new("RGBA", (4, 4), (1, 2, 3, 255)))[0, 0].tolist() == [1, 2, 3]


def test_transparent_image_fills_after_resize():
    """An RGBA image: resized in RGBA, then composited on a chessboard of the resized size."""
    img = noise_image(20, 10, mode="RGBA")
    item = prepare([img])
    rgba = np.asarray(img.resize((20, 10), Image.Resampling.BICUBIC)).astype(np.float32)
    a = rgba[:, :, 3:] / 255.0
    expected = (a * rgba[:, :, :3] + (1 - a) * chessboard(20, 10).astype(np.float32)).astype(np.uint8)
    got = item.pixels.reshape(2, 2, 3, 14, 14).permute(0, 3, 1, 4, 2).reshape(28, 28, 3)[:10, :20]
    assert torch.equal(got, torch.from_numpy(((expected / 255.0).astype(np.float32) - 0.5) * 2.0))


def test_a_clip_of_frames():
    frames = [noise_image(40, 30, seed=s) for s in range(3)]
    item = prepare(frames)
    assert item.grid == (3, 4, 4) and item.pixels.shape == (48, 3, 14, 14) and item.tokens == 4
    assert torch.equal(item.pixels[16:32], prepare([frames[1]]).pixels)
    with pytest.raises(ImageError, match="differ in size"):
        prepare([noise_image(40, 30), noise_image(41, 30)])
    with pytest.raises(ImageError, match="5 frames"):
        prepare([noise_image(28, 28)] * 5)


def _png_with_size(w: int, h: int) -> bytes:
    """A PNG whose header claims w x h (a real 1x1 image's chunks otherwise)."""
    data = bytearray(png_bytes(np.zeros((1, 1, 3), np.uint8)))
    ihdr = data[12:29]
    ihdr[4:12] = w.to_bytes(4, "big") + h.to_bytes(4, "big")
    data[12:29] = ihdr
    data[29:33] = zlib.crc32(bytes(ihdr)).to_bytes(4, "big")
    return bytes(data)


def test_bad_images_are_refused_by_name(monkeypatch):
    good = png_bytes(np.zeros((30, 40, 3), np.uint8))
    cases = {
        "empty image file": b"",
        "unknown or corrupt": b"GIF89a not really" * 3,
        "truncated or corrupt": good[: len(good) // 2],
        "zero-size": _png_with_size(0, 5),
        "unsupported image format PPM": b"P6\n2 2\n255\n" + bytes(12),
    }
    for problem, data in cases.items():
        with pytest.raises(ImageError, match=problem):
            open_image(data)
    with pytest.raises(ImageError, match=f"an image of {len(good):,} bytes, over the limit of 20"):
        open_image(good, max_bytes=20)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)  # Pillow's own limit: warn above, refuse above 2x
    for w, h in ((30, 20), (40, 30)):
        with pytest.raises(ImageError, match="decompression bomb"):
            open_image(png_bytes(np.zeros((h, w, 3), np.uint8)))
    with pytest.raises(ImageError, match="needs 16 tokens after resizing, over the limit of 10"):
        prepare([noise_image(100, 100)], max_tokens=10)


def test_cli_preprocess(tmp_path):
    path = tmp_path / "a.png"
    Image.new("RGBA", (303, 181), (40, 40, 40, 128)).save(path)
    out = CliRunner().invoke(app, ["vision", "preprocess", str(path), "--json"])
    assert out.exit_code == 0, out.output
    j = json.loads(out.stdout)
    assert (j["original"], j["padded"], j["grid"], j["tokens"]) == ([303, 181], [308, 196], [14, 22], 77)
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"nope")
    out = CliRunner().invoke(app, ["vision", "preprocess", str(bad)])
    assert out.exit_code == 1 and "bad.png: not an image" in out.output and "Traceback" not in out.output


def test_gif_and_palette_images():
    buf = io.BytesIO()
    Image.new("P", (30, 20), 3).save(buf, "GIF", transparency=3)
    item = prepare([open_image(buf.getvalue())])
    assert item.grid == (1, 2, 4)
    # fully transparent pixels show the chessboard: the first row starts with 8 white, then 8 gray pixels
    row = item.pixels.reshape(2, 4, 3, 14, 14).permute(0, 3, 1, 4, 2).reshape(28, 56, 3)[0, :16, 0]
    assert row[:8].tolist() == [1.0] * 8 and row[8:].tolist() == [pytest.approx(180 / 255 * 2 - 1)] * 8
