"""Checkpoint access: read and write sharded safetensors in the published layout, locally and over HTTP.

    from k3.checkpoint import open_checkpoint, save_checkpoint, CheckpointError

    with open_checkpoint("ckpt/") as ckpt:          # or "https://host/path/to/ckpt"
        for t in ckpt.tensors():                     # TensorInfo(name, dtype, shape, shard, start, end)
            ...
        w = ckpt.read("model.embed_tokens.weight")   # zero-copy over a memory map locally
        rows = ckpt.read_rows("model.embed_tokens.weight", 0, 16)

Nothing here unpickles, and nothing here knows the model: names, dtypes and shapes are data.
"""

# Exports load on first use (PEP 562), so that `k3 --help` and `k3 census` do not pay for importing torch.
_EXPORTS = {
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


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'k3.checkpoint' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(_EXPORTS[name]), name)
