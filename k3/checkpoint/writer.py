"""Write a checkpoint in the published layout: safetensors shards, the index and config.json.

Tensors arrive one at a time from an iterable and leave memory at once: each is appended to a temporary
data file of the current shard, and when the shard is full its header (known only now) is written to the
shard file followed by a copy of that data. Peak memory is one tensor, whatever the checkpoint size.

Atomicity: every file is written under a temporary name (a dot-name in the output directory) and renamed
when complete; shard names carry the shard count (`model-00001-of-00003.safetensors`), known only at the
end, so all renames happen then: shards, then config.json, then the index last. A crash leaves temporary
files (removed when the error passes through here) but never a half-written file under a final name.

The file format follows the safetensors spec, checked against the official library in the tests: an 8-byte
little-endian header length, the header JSON padded with spaces to a multiple of 8, then the data.
Tensors are stored in the order given (the official writer sorts by alignment; readers here copy a
misaligned tensor once).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from k3.checkpoint.reader import CONFIG_NAME, INDEX_NAME, SINGLE_NAME, TORCH_DTYPES
from k3.checkpoint.source import CheckpointError
from k3.config import K3Config

SAFETENSORS_DTYPES = {torch_dtype: name for name, torch_dtype in TORCH_DTYPES.items()}
_COPY_CHUNK = 16 * 2**20


def _temporary(directory: Path, suffix: str, mode: str = "xb") -> tuple[Path, BinaryIO]:
    """A new file under a hidden unique name, created with the usual permissions (mkstemp's are 0600)."""
    path = directory / f".k3-{uuid.uuid4().hex}{suffix}"
    return path, open(path, mode)  # the caller closes it


def atomic_write(path: Path, data: bytes) -> None:
    tmp, f = _temporary(path.parent, f".{path.name}.tmp")
    try:
        with f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class _Shard:
    """One shard being written: tensor bytes go to a temporary data file, header entries stay in memory."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.entries: dict[str, dict[str, Any]] = {}  # name -> {"dtype", "shape", "data_offsets"}
        self.size = 0  # bytes of tensor data so far
        self._data_path, self._data = _temporary(
            directory, ".data.tmp", "x+b"
        )  # closed by finish() or discard()
        self.path: Path | None = None  # the finished shard, still under a temporary name

    def add(self, name: str, tensor: torch.Tensor) -> None:
        dtype = SAFETENSORS_DTYPES[tensor.dtype]
        flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)  # [nbytes]
        self._data.write(flat.numpy().data)
        shape = list(tensor.shape)
        self.entries[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [self.size, self.size + flat.numel()],
        }
        self.size += flat.numel()

    def finish(self, metadata: dict[str, str]) -> None:
        """Write header + data to a temporary shard file and drop the data file."""
        header = json.dumps(
            {"__metadata__": metadata, **self.entries}, separators=(",", ":"), ensure_ascii=False
        )
        raw = header.encode()
        raw += b" " * (-(8 + len(raw)) % 8)  # the data section starts 8-aligned
        self._data.flush()
        self._data.seek(0)
        self.path, out = _temporary(self.directory, ".safetensors.tmp")
        with out:
            out.write(struct.pack("<Q", len(raw)))
            out.write(raw)
            shutil.copyfileobj(self._data, out, _COPY_CHUNK)
            out.flush()
            os.fsync(out.fileno())
        self._discard_data()

    def _discard_data(self) -> None:
        self._data.close()
        self._data_path.unlink(missing_ok=True)

    def discard(self) -> None:
        self._discard_data()
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def _existing_checkpoint_files(out_dir: Path) -> list[Path]:
    return sorted(p for p in out_dir.iterdir() if p.name == INDEX_NAME or p.name.endswith(".safetensors"))


def save_checkpoint(
    tensors: Iterable[tuple[str, torch.Tensor]],
    config: K3Config | dict[str, Any] | None,
    out_dir: str | Path,
    max_shard_size: int | None = 5 * 10**9,
    metadata: dict[str, str] | None = None,
    *,
    always_index: bool = False,
    overwrite: bool = False,
) -> list[Path]:
    """Write `(name, tensor)` pairs as a checkpoint under `out_dir`; returns the files written.

    Shards hold at most `max_shard_size` bytes of tensor data (a larger tensor gets a shard of its own;
    None: no limit). More than one shard: `model-0000N-of-0000M.safetensors` + `model.safetensors.index.json`
    (with `metadata.total_size` and `weight_map`). One shard: `model.safetensors` alone, unless
    `always_index`, which writes the sharded form with M = 1. `metadata` (strings) goes into every shard's
    `__metadata__`, after `{"format": "pt"}` (which transformers expects). `config` (a K3Config or a raw
    dict) becomes config.json; None writes none. An `out_dir` that already holds a checkpoint is refused
    unless `overwrite`, which removes the old checkpoint files not written again, once the new ones are in.
    """
    if config is not None and not isinstance(config, K3Config | dict):
        raise TypeError(f"config must be a K3Config, a dict or None, not {type(config).__name__}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    existing = _existing_checkpoint_files(out_dir)
    if existing and not overwrite:
        names = ", ".join(p.name for p in existing[:3])
        raise CheckpointError(
            f"{out_dir}: already holds a checkpoint ({names}); pass overwrite=True to replace it"
        )
    shard_metadata = {"format": "pt", **(metadata or {})}
    for key, value in shard_metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise CheckpointError(f"{out_dir}: metadata must map strings to strings, got {key!r}: {value!r}")

    shards: list[_Shard] = []
    seen: set[str] = set()
    try:
        for name, tensor in tensors:
            if not isinstance(name, str) or name == "__metadata__" or name in seen:
                problem = "is a duplicate" if name in seen else "is not a usable tensor name"
                raise CheckpointError(f"{out_dir}: tensor {name!r} {problem}")
            if not isinstance(tensor, torch.Tensor) or tensor.dtype not in SAFETENSORS_DTYPES:
                what = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise CheckpointError(f"{out_dir}: tensor {name!r} has unsupported type {what}")
            seen.add(name)
            nbytes = tensor.numel() * tensor.element_size()
            full = max_shard_size is not None and shards and shards[-1].size + nbytes > max_shard_size
            if not shards or full:
                if shards:
                    shards[-1].finish(shard_metadata)
                shards.append(_Shard(out_dir))
            shards[-1].add(name, tensor)
            del tensor  # so a generator can free it before it makes the next one
        if not shards:
            shards.append(_Shard(out_dir))  # an empty checkpoint is still a valid file
        shards[-1].finish(shard_metadata)
        return _commit(shards, config, out_dir, always_index, existing)
    except BaseException:
        for shard in shards:
            shard.discard()
        raise


# What llama.cpp's convert_hf_to_gguf.py picks its converter by (`architectures`) and reads without a default.
_ARCHITECTURES = {"kimi_k3": "KimiK3ForConditionalGeneration", "kimi_linear": "KimiLinearForCausalLM"}


def with_converter_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """A published config dict with the keys llama.cpp's converter needs added where missing:
    `architectures` (outer and text for K3) and `moe_router_activation_func` (`linear_attn_config`, the
    third, is always part of `K3Config.to_dict`)."""
    raw = dict(raw)
    text = raw.get("text_config", raw)
    if "text_config" in raw:
        raw.setdefault("architectures", [_ARCHITECTURES["kimi_k3"]])
        text = raw["text_config"] = dict(text)
    text.setdefault("architectures", [_ARCHITECTURES["kimi_linear"]])
    text.setdefault("moe_router_activation_func", "sigmoid")
    return raw


def _commit(
    shards: list[_Shard],
    config: K3Config | dict[str, Any] | None,
    out_dir: Path,
    always_index: bool,
    existing: list[Path],
) -> list[Path]:
    """Rename the finished shards to their final names, then write config.json and the index."""
    count = len(shards)
    sharded = count > 1 or always_index
    names = [
        f"model-{i + 1:05d}-of-{count:05d}.safetensors" if sharded else SINGLE_NAME for i in range(count)
    ]
    written = []
    for shard, name in zip(shards, names, strict=True):
        assert shard.path is not None
        shard.path.replace(out_dir / name)
        shard.path = None
        written.append(out_dir / name)
    if config is not None:
        raw = with_converter_keys(config.to_dict()) if isinstance(config, K3Config) else config
        atomic_write(out_dir / CONFIG_NAME, (json.dumps(raw, indent=2) + "\n").encode())
        written.append(out_dir / CONFIG_NAME)
    if sharded:
        index = {
            "metadata": {"total_size": sum(s.size for s in shards)},
            "weight_map": {t: name for shard, name in zip(shards, names, strict=True) for t in shard.entries},
        }
        atomic_write(out_dir / INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode())
        written.append(out_dir / INDEX_NAME)
    for stale in existing:
        if stale not in written:
            stale.unlink(missing_ok=True)
    return written
