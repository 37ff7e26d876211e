"""Sequence states as plain tensors: cut from a `ModelCache`, joined back into one, written to disk.

A state is what k3's cache holds for one sequence (see `k3.model.cache`): per KDA layer the three
short-conv tails and the fp32 recurrent state (constant size), per MLA layer the latent and `k_rope` rows
of every position. AttnRes keeps nothing across tokens (its block summaries live inside one forward), so
there is nothing else to save.

Tensor names (batch dimension dropped):

* `kda.{i}.conv_q|conv_k|conv_v` [ks-1, P] (or [P, ks-1], as the cache holds them) and
  `kda.{i}.recurrent` [H, K, V] fp32, layer i a KDA layer: the state after the last position;
* `mla.{i}.latent` [n, kv_lora] and `mla.{i}.k_rope` [n, rope], layer i an MLA layer: rows of positions
  `start..start+n` (a prefix-cache block holds its own rows only, a whole sequence state all of them);
* `experts` [n, n_moe, k] int16 (optional): the routed experts at those positions;
* `tokens` [n] int32: the ids of those positions.

Files are safetensors written atomically (a temporary file, then `os.replace`) with, in the metadata, the
format version, the checkpoint's identity (`checkpoint_identity`) and a SHA-256 of the tensor data; a file
whose format, identity or checksum does not match, or that safetensors cannot read (truncated), is
refused with `StateFileError`, never used.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3.errors import K3Error
from k3.model.cache import KDAState, MLAState, ModelCache

FORMAT = "k3-state-1"  # bump when the tensors or their meaning change: older files are then refused
Tensors = dict[str, torch.Tensor]


@dataclass
class SequenceState:
    """One sequence's state: `cache` (batch 1) holds positions 0..len(tokens) of `tokens`."""

    tokens: list[int]
    cache: ModelCache


class StateFileError(K3Error):
    """A state file that cannot be used (another checkpoint, another format, corrupt or truncated)."""


def checkpoint_identity(model: torch.nn.Module, version: int = 0) -> str:
    """A short hash naming these weights: the config, every tensor's name, shape and dtype, the first
    values of every dense tensor (routed experts by shape only: reading them may fetch them), and the
    engine's policy version. Two checkpoints that differ anywhere a random init or training touches differ
    here."""
    h = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    h.update(f"version={version}".encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        if ".experts." not in name and t.numel() and t.device.type != "meta":
            h.update(_bytes(t.detach().flatten()[:64]))
    return h.hexdigest()[:32]


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()


def checksum(tensors: Tensors) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(_bytes(tensors[name]))
    return h.hexdigest()


def cut(cache: ModelCache, row: int, start: int, end: int) -> Tensors:
    """The state of `row` of `cache`: KDA states as they are now, MLA rows of positions start..end
    (copies: the cache goes on changing)."""
    out: Tensors = {}
    for i, state in enumerate(cache.layers):
        if isinstance(state, KDAState):
            for name, t in zip(("conv_q", "conv_k", "conv_v", "recurrent"), state._tensors(), strict=True):
                if t is None:
                    raise K3Error(f"layer {i}: no KDA state yet (nothing was prefilled)")
                out[f"kda.{i}.{name}"] = t[row].clone()
        elif isinstance(state, MLAState):
            if state.latent is None or state.k_rope is None:
                raise K3Error(f"layer {i}: no MLA rows yet (nothing was prefilled)")
            out[f"mla.{i}.latent"] = state.latent[row, start:end].clone()
            out[f"mla.{i}.k_rope"] = state.k_rope[row, start:end].clone()
    return out


def join(empty: ModelCache, parts: list[Tensors], end: int) -> ModelCache:
    """Fill `empty` (a fresh batch-1 cache of the model) with the state after `end` positions: KDA states of
    the last part, MLA rows of all parts in order (which must cover positions 0..end)."""
    last = parts[-1]
    for i, state in enumerate(empty.layers):
        if isinstance(state, KDAState):
            state.conv_q, state.conv_k, state.conv_v, state.recurrent = (
                last[f"kda.{i}.{name}"][None].clone() for name in ("conv_q", "conv_k", "conv_v", "recurrent")
            )
        else:
            state.latent = torch.cat([p[f"mla.{i}.latent"] for p in parts])[None]  # [1, end, kv_lora]
            state.k_rope = torch.cat([p[f"mla.{i}.k_rope"] for p in parts])[None]  # [1, end, rope]
            if state.latent.shape[1] != end:
                raise K3Error(f"layer {i}: the saved rows cover {state.latent.shape[1]} positions, not {end}")
            state.lengths = torch.tensor([end])
    empty.tokens = torch.tensor([end])
    return empty


def write(path: Path, tensors: Tensors, identity: str, meta: dict[str, str]) -> None:
    """Write tensors + metadata to `path` atomically (readers see the old file or the whole new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    metadata = {**meta, "format": FORMAT, "identity": identity, "sha256": checksum(tensors)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def read(path: Path, identity: str) -> tuple[Tensors, dict[str, str]]:
    """Tensors and metadata of a state file written for `identity`; StateFileError if it is not one."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
    except Exception as e:  # safetensors raises several kinds for truncated or garbled files
        raise StateFileError(f"{path.name}: not a readable safetensors file ({type(e).__name__}: {e})") from e
    if meta.get("format") != FORMAT:
        raise StateFileError(f"{path.name}: format {meta.get('format')!r}, this k3 reads {FORMAT!r}")
    if meta.get("identity") != identity:
        raise StateFileError(
            f"{path.name}: written for checkpoint {meta.get('identity')!r}, this one is {identity!r}"
        )
    if meta.get("sha256") != checksum(tensors):
        raise StateFileError(f"{path.name}: the tensor data does not match its checksum (corrupt)")
    return tensors, meta


def save_sequence(path: Path, state: SequenceState, identity: str) -> None:
    """One sequence's whole state (all its MLA rows) as a state file."""
    n = len(state.tokens)
    tensors = cut(state.cache, 0, 0, n)
    tensors["tokens"] = torch.tensor(state.tokens, dtype=torch.int32)
    write(path, tensors, identity, {"kind": "sequence", "end": str(n)})


def load_sequence(path: Path, identity: str, empty: ModelCache) -> SequenceState:
    """A state written by `save_sequence` for `identity`, into `empty` (a fresh batch-1 cache)."""
    tensors, meta = read(path, identity)
    tokens = tensors["tokens"].tolist()
    if meta.get("kind") != "sequence" or meta.get("end") != str(len(tokens)):
        raise StateFileError(f"{path.name}: not a sequence state")
    return SequenceState(tokens, join(empty, [tensors], len(tokens)))
