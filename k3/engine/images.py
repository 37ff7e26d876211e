"""Images for the engine and the server: where an image comes from (a data URL, a remote URL when allowed:
k3.engine.remote_images, a file for the CLI), its prompt ids, and the tower's output cached by the
image's content hash (a multi-turn chat re-sends the same image; it is encoded once).

    img = load_image(data, max_tokens=...)                # ImageInput: content hash + prepared pixels
    ids = image_prompt_ids(tokenizer, img)               # media tokens, "image WxH", N pads
    images = image_inputs(messages)                      # a chat's image_url parts (k3.chat places them)
    rows = ImageCache().rows(model, [img])               # [N, hidden] per image, cached by hash
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from k3.engine.remote_images import RemoteImages
from k3.errors import K3Error
from k3.vision.preprocess import MAX_IMAGE_BYTES, ImageError, Prepared, open_image, prepare
from k3.vision.prompt import MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD

_DATA_URL = re.compile(r"data:(image/[A-Za-z0-9.+-]+)?(;[^,]*)?,(.*)", re.S)


@dataclass(frozen=True)
class ImageInput:
    key: str  # sha256 of the encoded bytes
    item: Prepared

    @property
    def tokens(self) -> int:
        return self.item.tokens

    @functools.cached_property
    def pixels_key(self) -> str:
        """sha256 of what the tower reads (the prepared pixels and their grid): what the prefix cache keys
        an image's states by, so that states kept on disk are not reused by a k3 that prepares the same
        bytes otherwise. Computed once, when an engine with a prefix cache takes the image: 5 ms for a
        448x336 image, 64 ms for 1920x1080 (25 MB of pixels; EPYC Zen 3), against seconds of prefill."""
        grid = ",".join(map(str, self.item.grid)).encode()
        return hashlib.sha256(grid + self.item.pixels.contiguous().numpy().tobytes()).hexdigest()

    @property
    def original(self) -> tuple[int, int]:
        return self.item.geometry.original


def load_image(data: bytes, *, max_tokens: int | None = None, max_bytes: int = MAX_IMAGE_BYTES) -> ImageInput:
    """Validated, preprocessed image (ImageError names what is wrong)."""
    item = prepare([open_image(data, max_bytes=max_bytes)], max_tokens=max_tokens)
    return ImageInput(hashlib.sha256(data).hexdigest(), item)


def url_bytes(url: str, *, remote: RemoteImages | None = None, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The bytes of an `image_url`: a base64 data URL; http(s) only under a server's `remote` rule
    (k3.engine.remote_images: public addresses, a size cap, a timeout); file:// and every other scheme
    refused."""
    if not isinstance(url, str):
        raise ImageError("image_url.url must be a string")
    if url.startswith("data:"):
        m = _DATA_URL.fullmatch(url)
        if m is None or m.group(2) is None or "base64" not in m.group(2):
            raise ImageError("image_url: a data URL must be data:image/...;base64,...")
        if len(m.group(3)) > 4 * max_bytes // 3 + 4:
            raise ImageError(f"image_url: the data URL holds more than {max_bytes:,} bytes")
        try:
            return base64.b64decode(m.group(3), validate=True)
        except (binascii.Error, ValueError):
            raise ImageError("image_url: the data URL is not valid base64") from None
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        if remote is None:
            raise ImageError(
                "image_url: remote URLs are refused (start the server with --allow-remote-images)"
            )
        return remote.fetch(url)
    raise ImageError(f"image_url: the {scheme or 'scheme-less'} URL scheme is refused (data: URLs only)")


def image_prompt_ids(tokenizer, image: ImageInput) -> list[int]:
    """`<|media_begin|>image {w}x{h}<|media_content|>` + N `<|media_pad|>` + `<|media_end|>` as ids."""
    sp = tokenizer.special_tokens
    w, h = image.item.geometry.original
    pads = [sp[MEDIA_PAD]] * image.tokens
    return [sp[MEDIA_BEGIN], *tokenizer.encode(f"image {w}x{h}"), sp[MEDIA_CONTENT], *pads, sp[MEDIA_END]]


class ImageCache:
    """The tower's rows [N, hidden] per image, by content hash (least recently used out past `size`)."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._rows: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.encoded = 0  # images run through the tower (cache misses)

    def rows(self, model, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        if not hasattr(model, "encode_images"):
            raise K3Error("this model has no vision tower (its config has no vision_config)")
        missing = list({im.key: im for im in images if im.key not in self._rows}.values())
        if missing:
            for im, rows in zip(missing, model.encode_images([m.item for m in missing]), strict=True):
                self._rows[im.key] = rows
            self.encoded += len(missing)
        out = []
        for im in images:
            self._rows.move_to_end(im.key)
            out.append(self._rows[im.key])
        while len(self._rows) > self.size:
            self._rows.popitem(last=False)
        return out


def image_inputs(
    messages: Sequence,
    *,
    remote: RemoteImages | None = None,
    max_images: int = 8,
    max_tokens: int | None = None,
) -> list[ImageInput]:
    """The images of OpenAI chat messages' `image_url` parts, in order (ImageError names a bad part);
    http(s) URLs under `remote` (None: refused)."""
    images: list[ImageInput] = []
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            where = f"messages[{i}].content[{j}]"
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if len(images) == max_images:
                raise ImageError(f"{where}: more than {max_images} images in one request (--max-images)")
            try:
                images.append(load_image(url_bytes(url, remote=remote), max_tokens=max_tokens))
            except ImageError as e:
                raise ImageError(f"{where}: {e}") from None
    return images
