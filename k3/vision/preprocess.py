"""Pixels in, patches out, with Pillow (spec section 5): the navit resize rule, bicubic resize, transparent
pixels filled with the chessboard after the resize, black padding to multiples of 28, [-1, 1], patches.

    img = open_image(Path("cat.png").read_bytes())      # validated; ImageError names what is wrong
    item = prepare([img])                               # one image (or up to 4 frames: a clip)
    item.pixels  # [t*gh*gw, 3, 14, 14] float32; item.grid (t, gh, gw); item.tokens = gh*gw/4

Bad input (not an image, a truncated or corrupt file, a format outside FORMATS, zero size, a decompression
bomb by Pillow's own limit `Image.MAX_IMAGE_PIXELS`, too many bytes or tokens) raises ImageError.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from k3.errors import K3Error

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
MAX_IMAGE_BYTES = 32 * 2**20  # 32 MiB of encoded image


class ImageError(K3Error):
    """An image k3 cannot use; the message says which and why."""


@dataclass(frozen=True)
class MediaConfig:
    """`preprocessor_config.json`'s `media_proc_cfg`, published values (spec section 2)."""

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 65536
    patch_limit_on_one_side: int = 512
    chessboard_square_size: int = 8
    chessboard_white_value: int = 255
    chessboard_gray_value: int = 180
    max_frames: int = 4  # temporal_merge_kernel_size: frames per clip

    @property
    def unit(self) -> int:
        """Padding unit in pixels: merge x patch = 28."""
        return self.merge_kernel_size * self.patch_size


@dataclass(frozen=True)
class Geometry:
    """Sizes in pixels (w, h) and the patch grid of one image under the navit rule."""

    original: tuple[int, int]
    resized: tuple[int, int]
    padded: tuple[int, int]
    grid: tuple[int, int]  # (gh, gw) patches
    tokens: int  # gh * gw / 4 merged tokens = <|media_pad|> count

    def to_json(self) -> dict:
        return {
            "original": list(self.original),
            "resized": list(self.resized),
            "padded": list(self.padded),
            "grid": list(self.grid),
            "patches": self.grid[0] * self.grid[1],
            "tokens": self.tokens,
        }


def navit_geometry(w: int, h: int, cfg: MediaConfig = MediaConfig()) -> Geometry:
    """The navit rule in the reference's float64 arithmetic: scale to a budget of `in_patch_limit` patches
    and at most `patch_limit_on_one_side` patches a side, never up; pad each side to a multiple of 28."""
    if w < 1 or h < 1:
        raise ImageError(f"a zero-size image ({w}x{h})")
    P, side = cfg.patch_size, cfg.patch_limit_on_one_side * cfg.patch_size
    s1 = math.sqrt(cfg.in_patch_limit / (max(1, w // P) * max(1, h // P)))
    s = min(1.0, s1, side / w, side / h)
    new_w, new_h = min(max(1, int(w * s)), side), min(max(1, int(h * s)), side)
    u = cfg.unit
    pad_w, pad_h = (u - new_w % u) % u, (u - new_h % u) % u
    token_w, token_h = (new_w + pad_w) // u, (new_h + pad_h) // u
    m = cfg.merge_kernel_size
    return Geometry(
        original=(w, h),
        resized=(new_w, new_h),
        padded=(new_w + pad_w, new_h + pad_h),
        grid=(m * token_h, m * token_w),
        tokens=token_h * token_w,
    )


def header_size(data: bytes) -> tuple[int, int] | None:
    """(w, h) a PNG or GIF header states (Pillow refuses a zero side as an unknown format), else None."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) >= 24:
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        return int.from_bytes(data[6:8], "little"), int.from_bytes(data[8:10], "little")
    return None


def open_image(data: bytes, *, max_bytes: int = MAX_IMAGE_BYTES) -> Image.Image:
    """Decode and fully load an image from its bytes, or raise ImageError naming the problem."""
    if len(data) == 0:
        raise ImageError("an empty image file (0 bytes)")
    if len(data) > max_bytes:
        raise ImageError(f"an image of {len(data):,} bytes, over the limit of {max_bytes:,}")
    if (size := header_size(data)) is not None and min(size) == 0:
        raise ImageError(f"a zero-size image ({size[0]}x{size[1]})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            if img.format not in FORMATS:
                raise ImageError(f"unsupported image format {img.format} (supported: {', '.join(FORMATS)})")
            if img.width < 1 or img.height < 1:
                raise ImageError(f"a zero-size image ({img.width}x{img.height})")
            img.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"a decompression bomb: {e}") from None
    except UnidentifiedImageError:
        raise ImageError("not an image Pillow can read (unknown or corrupt format)") from None
    except (OSError, SyntaxError, ValueError) as e:
        if isinstance(e, ImageError):
            raise
        raise ImageError(f"a truncated or corrupt image ({e})") from None
    return img


def chessboard(w: int, h: int, cfg: MediaConfig = MediaConfig()) -> np.ndarray:
    """[h, w, 3] uint8: squares of `chessboard_square_size` px, white at the top left, gray where
    (row square + column square) is odd."""
    s = cfg.chessboard_square_size
    odd = ((np.arange(h)[:, None] // s) + (np.arange(w)[None, :] // s)) % 2 == 1
    board = np.where(odd, cfg.chessboard_gray_value, cfg.chessboard_white_value).astype(np.uint8)
    return np.repeat(board[:, :, None], 3, axis=2)


def fill_transparent(img: Image.Image, cfg: MediaConfig = MediaConfig()) -> np.ndarray:
    """[h, w, 3] uint8 RGB: an image with alpha (or a `transparency` colour) composited on the chessboard,
    out = trunc(a * rgb + (1 - a) * board) with a = alpha / 255 in float32; others converted to RGB."""
    if img.mode == "RGB":
        return np.asarray(img)
    if "A" not in img.getbands() and "transparency" not in img.info:
        return np.asarray(img.convert("RGB"))
    rgba = np.asarray(img.convert("RGBA"))
    a = rgba[:, :, 3:4].astype(np.float32) / 255.0
    board = chessboard(img.width, img.height, cfg).astype(np.float32)
    return (a * rgba[:, :, :3].astype(np.float32) + (1 - a) * board).astype(np.uint8)


def frame_pixels(img: Image.Image, geo: Geometry, cfg: MediaConfig = MediaConfig()) -> np.ndarray:
    """One frame: bicubic resize (in the image's own mode), alpha fill, black padding at the right and
    bottom, normalised to [-1, 1] -> [H_pad, W_pad, 3] float32 (padding exactly -1)."""
    try:
        resized = img.resize(geo.resized, Image.Resampling.BICUBIC)
    except ValueError:  # a mode Pillow cannot resize bicubically (e.g. I;16): as RGB
        resized = img.convert("RGB").resize(geo.resized, Image.Resampling.BICUBIC)
    rgb = fill_transparent(resized, cfg)
    W, H = geo.padded
    padded = np.zeros((H, W, 3), dtype=np.uint8)
    padded[: rgb.shape[0], : rgb.shape[1]] = rgb
    x = (padded / 255.0).astype(np.float32)
    x -= 0.5
    x *= 2.0
    return x


@dataclass
class Prepared:
    """One image or clip, ready for the tower."""

    pixels: torch.Tensor  # [t*gh*gw, 3, P, P] float32, frame then row-major patches
    grid: tuple[int, int, int]  # (t, gh, gw)
    geometry: Geometry

    @property
    def tokens(self) -> int:
        return self.geometry.tokens


def patchify(frames: np.ndarray, patch: int) -> torch.Tensor:
    """[T, H, W, 3] -> [T*(H/P)*(W/P), 3, P, P]: frame, then patch rows, then patch columns; inside a
    patch channel, row, column."""
    T, H, W, _ = frames.shape
    x = frames.reshape(T, H // patch, patch, W // patch, patch, 3).transpose(0, 1, 3, 5, 2, 4)
    return torch.from_numpy(np.ascontiguousarray(x)).reshape(-1, 3, patch, patch)


def prepare(
    images: list[Image.Image], cfg: MediaConfig = MediaConfig(), max_tokens: int | None = None
) -> Prepared:
    """One image (a list of one) or a clip of up to `max_frames` frames of one size -> Prepared."""
    if not 1 <= len(images) <= cfg.max_frames:
        raise ImageError(f"a clip of {len(images)} frames; 1..{cfg.max_frames} are allowed")
    sizes = {img.size for img in images}
    if len(sizes) > 1:
        raise ImageError(f"the frames of a clip differ in size: {sorted(sizes)}")
    geo = navit_geometry(*images[0].size, cfg)
    if max_tokens is not None and geo.tokens > max_tokens:
        raise ImageError(
            f"an image of {geo.original[0]}x{geo.original[1]} needs {geo.tokens} tokens after resizing, "
            f"over the limit of {max_tokens}"
        )
    frames = np.stack([frame_pixels(img, geo, cfg) for img in images])  # [T, H_pad, W_pad, 3]
    pixels = patchify(frames, cfg.patch_size)
    return Prepared(pixels, (len(images), *geo.grid), geo)
