"""Checkpoint access: read and write sharded safetensors in the published layout, locally and over HTTP.

    from k3.checkpoint import open_checkpoint, save_checkpoint, CheckpointError

    with open_checkpoint("ckpt/") as ckpt:          # or "https://host/path/to/ckpt", "hf://ORG/REPO@REV"
        for t in ckpt.tensors():                     # TensorInfo(name, dtype, shape, shard, start, end)
            ...
        w = ckpt.read("model.embed_tokens.weight")   # zero-copy over a memory map locally
        rows = ckpt.read_rows("model.embed_tokens.weight", 0, 16)

Nothing here unpickles, and nothing here knows the model: names, dtypes and shapes are data.
"""

from k3.lazy import lazy_exports

_EXPORTS = {  # public name -> the module defining it, imported on first use
    "Checkpoint": "k3.checkpoint.reader",
    "CheckpointError": "k3.checkpoint.source",
    "FetchStats": "k3.checkpoint.remote",
    "RemoteOptions": "k3.checkpoint.remote",
    "TORCH_DTYPES": "k3.checkpoint.reader",
    "TensorInfo": "k3.checkpoint.header",
    "open_checkpoint": "k3.checkpoint.reader",
    "save_checkpoint": "k3.checkpoint.writer",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
