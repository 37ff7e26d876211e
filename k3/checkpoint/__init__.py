"""Checkpoint access: read and write sharded safetensors in the published layout, locally and over HTTP.

    from k3.checkpoint import open_checkpoint, save_checkpoint, CheckpointError

    with open_checkpoint("ckpt/") as ckpt:          # or "https://host/path/to/ckpt"
        for t in ckpt.tensors():                     # TensorInfo(name, dtype, shape, shard, start, end)
            ...
        w = ckpt.read("model.embed_tokens.weight")   # zero-copy over a memory map locally
        rows = ckpt.read_rows("model.embed_tokens.weight", 0, 16)

Nothing here unpickles, and nothing here knows the model: names, dtypes and shapes are data.
"""

from k3.checkpoint.header import TensorInfo
from k3.checkpoint.reader import TORCH_DTYPES, Checkpoint, open_checkpoint
from k3.checkpoint.remote import FetchStats, RemoteOptions
from k3.checkpoint.source import CheckpointError
from k3.checkpoint.writer import save_checkpoint

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "FetchStats",
    "RemoteOptions",
    "TORCH_DTYPES",
    "TensorInfo",
    "open_checkpoint",
    "save_checkpoint",
]
