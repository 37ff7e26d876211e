"""Parse and validate one safetensors header.

The format: 8 bytes little-endian u64 `n`, then `n` bytes of JSON `{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}`, then the data section. Offsets are relative to
the data section. A valid file's tensors tile the data section exactly: sorted by offset, each begins where
the previous one ends, and the last ends at the end of the file.

Everything is checked before anything is allocated from it: a header length claiming 2^60 bytes is refused
by comparing it with the file size, not by trying to read it.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

from k3.checkpoint.source import ByteSource, CheckpointError
from k3.layout import DTYPE_BYTES

# safetensors' own limit on the JSON header (its MAX_HEADER_SIZE): large enough for any real checkpoint,
# small enough that a corrupted length cannot make us read gigabytes.
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: `start`/`end` are absolute byte offsets in the shard file."""

    name: str
    dtype: str  # safetensors dtype string: "BF16", "U8", ...
    shape: tuple[int, ...]
    shard: str  # file name of the shard (relative to the checkpoint directory or URL)
    start: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShardHeader:
    tensors: list[TensorInfo]  # in file order (by offset)
    metadata: dict[str, str]
    data_start: int  # 8 + header length


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        self.key = key


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def load_json_object(data: bytes, where: str) -> dict[str, Any]:
    """A UTF-8 JSON object with no duplicate keys at any depth (and no NaN/Infinity, which are not JSON);
    anything else is a CheckpointError."""
    try:
        obj = json.loads(
            data.decode("utf-8"), object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant
        )
    except _DuplicateKey as e:
        raise CheckpointError(f"{where}: duplicate key {e.key!r}") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{where}: malformed JSON ({e.msg} at line {e.lineno} column {e.colno})"
        ) from None
    except (ValueError, RecursionError) as e:  # too deeply nested, an integer with thousands of digits
        raise CheckpointError(f"{where}: malformed JSON ({type(e).__name__}: {str(e)[:100]})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _is_count(x: Any) -> bool:
    """A JSON integer that fits a u64, as safetensors requires (bool is an int in Python, not in JSON)."""
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**64


def _entry(name: str, entry: Any, where: str) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, validated on its own."""
    at = f"{where}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{at}: entry is {type(entry).__name__}, expected an object")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in entry:
            raise CheckpointError(f"{at}: no {key!r}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise CheckpointError(f"{at}: unknown dtype {dtype!r} (known: {', '.join(DTYPE_BYTES)})")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(f"{at}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise CheckpointError(f"{at}: data_offsets {offsets!r} is not a pair of non-negative integers")
    begin, end = offsets
    if begin > end:
        raise CheckpointError(f"{at}: data_offsets [{begin}, {end}] run backwards")
    if math.prod(d for d in shape if d) >= 2**63:  # strides a tensor cannot have, even with 0 elements
        raise CheckpointError(f"{at}: shape {shape} is too large for a tensor")
    numel = 1
    for d in shape:
        numel *= d
    if numel * DTYPE_BYTES[dtype] != end - begin:
        raise CheckpointError(
            f"{at}: shape {shape} x {dtype} ({DTYPE_BYTES[dtype]} bytes) is {numel * DTYPE_BYTES[dtype]} "
            f"bytes but data_offsets [{begin}, {end}] hold {end - begin}"
        )
    return dtype, tuple(shape), begin, end


def parse_header(source: ByteSource, shard: str) -> ShardHeader:
    """Read and validate the header of `source`; `shard` is the name recorded in each TensorInfo."""
    where = source.name
    if source.size < 8:
        raise CheckpointError(
            f"{where}: truncated: {source.size} bytes, too short for the 8-byte header length"
        )
    (n,) = struct.unpack("<Q", source.read(0, 8))
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(f"{where}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if 8 + n > source.size:
        raise CheckpointError(
            f"{where}: header length {n} runs past the end of the file ({source.size} bytes): truncated?"
        )
    raw = bytes(source.read(8, n))
    if not raw.startswith(b"{"):
        raise CheckpointError(f"{where}: header does not start with '{{' (not a safetensors file?)")
    header = load_json_object(raw, f"{where} (header)")

    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{where}: __metadata__ must be an object of strings, got {metadata!r:.200}")

    data_start = 8 + n
    data_size = source.size - data_start
    entries = sorted(
        ((name, *_entry(name, entry, where)) for name, entry in header.items()),
        key=lambda e: (e[3], e[4]),  # by (begin, end): zero-size tensors may share an offset
    )
    tensors = []
    covered = 0  # the data section is tiled up to here
    for name, dtype, shape, begin, end in entries:
        at = f"{where}: tensor {name!r}"
        if end > data_size:
            raise CheckpointError(
                f"{at}: data_offsets [{begin}, {end}] run past the end of the data section "
                f"({data_size} bytes): truncated shard or bad offsets"
            )
        if begin < covered:
            raise CheckpointError(f"{at}: data_offsets [{begin}, {end}] overlap the previous tensor")
        if begin > covered:
            raise CheckpointError(
                f"{at}: data_offsets [{begin}, {end}] leave a gap: "
                f"bytes [{covered}, {begin}) belong to no tensor"
            )
        covered = end
        tensors.append(TensorInfo(name, dtype, shape, shard, data_start + begin, data_start + end))
    if covered != data_size:
        last = f"after tensor {entries[-1][0]!r}" if entries else "with no tensors"
        raise CheckpointError(
            f"{where}: data section has {data_size} bytes but the tensors cover {covered} ({last}): "
            f"bytes [{covered}, {data_size}) belong to no tensor"
        )
    return ShardHeader(tensors, dict(metadata), data_start)
