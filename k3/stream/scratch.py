"""The run's state on disk: what lets a killed run continue, and what holds state beyond the budget.

After every finished layer the runner writes, atomically (a temporary file, fsync, rename):

* `cache.{layer}.{pass}.safetensors`: that layer's cache states of every prompt, when generating (a KDA
  state, or an MLA layer's latents), written once per layer and pass;
* `state.safetensors`: the residual streams of every prompt after that layer, with the progress in its
  metadata (pass, layer, tokens generated so far, a fingerprint of the job). Renaming it into place is the
  commit: a run killed at any moment resumes from the last layer whose state file was renamed.

`hidden.{layer}.safetensors` and `outputs.safetensors` (the first pass's logits) are written once.
Tensors read back are zero-copy views of the files' memory maps: clean page-cache pages that the kernel
can drop and read again, not anonymous memory. That is how state beyond `--memory-budget` leaves RAM.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from k3.checkpoint import open_checkpoint
from k3.model.attn_res import ResidualStream
from k3.model.cache import KDAState, MLAState

LayerState = KDAState | MLAState
STATE = "state.safetensors"
_KDA_FIELDS = ("conv_q", "conv_k", "conv_v", "recurrent")
_MLA_FIELDS = ("lengths", "latent", "k_rope")


@dataclass
class Progress:
    """Where a run stands: pass `pass_index` has finished layers up to `layer` (-1: none yet)."""

    pass_index: int
    layer: int
    generated: list[list[int]]


def stream_tensors(streams: list[ResidualStream]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for p, s in enumerate(streams):
        for j, block in enumerate(s.blocks):
            out[f"p{p}.block.{j}"] = block
        if s.partial is not None:
            out[f"p{p}.partial"] = s.partial
    return out


def streams_from(
    tensors: dict[str, torch.Tensor], prompts: int, block_size: int | None
) -> list[ResidualStream]:
    streams = []
    for p in range(prompts):
        s = ResidualStream(tensors.get(f"p{p}.partial"), block_size)  # type: ignore[arg-type]
        j = 0
        while f"p{p}.block.{j}" in tensors:
            s.blocks.append(tensors[f"p{p}.block.{j}"])
            j += 1
        streams.append(s)
    return streams


def state_tensors(states: list[LayerState]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for p, state in enumerate(states):
        fields = _KDA_FIELDS if isinstance(state, KDAState) else _MLA_FIELDS
        for name in fields:
            t = getattr(state, name)
            if t is not None:
                out[f"p{p}.{name}"] = t
    return out


def states_from(tensors: dict[str, torch.Tensor], like: list[LayerState]) -> list[LayerState]:
    out: list[LayerState] = []
    for p, state in enumerate(like):
        if isinstance(state, KDAState):
            out.append(KDAState(*(tensors.get(f"p{p}.{f}") for f in _KDA_FIELDS)))
        else:
            out.append(MLAState(*(tensors.get(f"p{p}.{f}") for f in _MLA_FIELDS)))  # type: ignore[arg-type]
    return out


class Scratch:
    """A folder of per-layer state files for one job (`fingerprint`: what must match to resume)."""

    def __init__(self, directory: Path, fingerprint: str) -> None:
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.bytes_written = 0
        self.directory.mkdir(parents=True, exist_ok=True)

    # ---- writing --------------------------------------------------------------------------------------
    def write(
        self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
    ) -> None:
        """`name` written atomically (tensors contiguous copies only where they are not already)."""
        path, tmp = self.directory / name, self.directory / f".{name}.tmp"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self.bytes_written += path.stat().st_size

    def commit(self, progress: Progress, streams: list[ResidualStream]) -> None:
        meta = {
            "fingerprint": self.fingerprint,
            "pass": str(progress.pass_index),
            "layer": str(progress.layer),
            "generated": json.dumps(progress.generated),
        }
        self.write(STATE, stream_tensors(streams), meta)

    def write_cache(self, layer: int, pass_index: int, states: list[LayerState]) -> None:
        self.write(f"cache.{layer}.{pass_index}.safetensors", state_tensors(states))

    def drop_cache(self, layer: int, pass_index: int) -> None:
        (self.directory / f"cache.{layer}.{pass_index}.safetensors").unlink(missing_ok=True)

    # ---- reading --------------------------------------------------------------------------------------
    def read(self, name: str) -> dict[str, torch.Tensor]:
        """Every tensor of `name`, as views of its memory map."""
        with open_checkpoint(self.directory / name) as f:
            return {t.name: f.read(t.name) for t in f.tensors()}

    def progress(self) -> Progress | None:
        """The last commit of this job, or None (nothing committed, or another job's state)."""
        path = self.directory / STATE
        if not path.is_file():
            return None
        with open_checkpoint(path) as f:
            meta = f.metadata[STATE]
        if meta.get("fingerprint") != self.fingerprint:
            return None
        return Progress(int(meta["pass"]), int(meta["layer"]), json.loads(meta["generated"]))

    def has(self, name: str) -> bool:
        return (self.directory / name).is_file()

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
