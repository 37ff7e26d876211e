"""Resumable training checkpoints: atomic, safetensors for every tensor, JSON for the rest; no pickle.

A checkpoint is a directory `RUN/checkpoints/step-00000123/` holding

* `model.safetensors`: the model's state dict (parameters and buffers, routing biases included);
* `optimizer.safetensors`: every optimizer state tensor as `state.{parameter name}.{key}` (AdamW: `step`,
  `exp_avg`, `exp_avg_sq`; Muon: `momentum_buffer`) and the torch RNG state as `rng.torch` (uint8);
* `state.json`: the step, the optimizer's param groups' settings (learning rate, betas, ...) and
  anything else the trainer wants back.

Written by R expert-parallel ranks (`writers`), the two files are R shards each (`model-00001-of-00002.
safetensors`, ...: rank r's experts, rank 0's also everything replicated) with the published
`model.safetensors.index.json`; either form loads into a model on any number of ranks.

It is written under a temporary name (`.tmp-step-...`) and renamed into place, so a process killed at any
moment leaves either the complete checkpoint or none; older checkpoints are deleted only after the new
one is in place. Data needs no state: batches are pure functions of (seed, batch index).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

CHECKPOINTS = "checkpoints"
_PREFIX = "step-"


def _step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"{_PREFIX}{step:08d}"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first, as (step, directory)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if path.name.startswith(_PREFIX) and path.name[len(_PREFIX) :].isdigit():
            found.append((int(path.name[len(_PREFIX) :]), path))
    return sorted(found)


@dataclass(frozen=True)
class Writers:
    """Several processes writing one checkpoint together (expert parallelism): this one's rank, their
    number, a barrier over all of them, and which tensors every rank holds alike (rank 0 writes those)."""

    rank: int
    world: int
    barrier: Callable[[], None]
    replicated: Callable[[str], bool]


def _files(stem: str, writers: Writers | None) -> str:
    if writers is None or writers.world == 1:
        return f"{stem}.safetensors"
    return f"{stem}-{writers.rank + 1:05d}-of-{writers.world:05d}.safetensors"


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of every parameter in the optimizer's numbering (its groups in order, as torch counts)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _optimizer_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Every optimizer state tensor as `state.{parameter name}.{key}`, and the param groups' settings."""
    state = optimizer.state_dict()
    names = _param_names(model, optimizer)
    tensors = {}
    for index, entries in state["state"].items():
        for key, value in entries.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {index}.{key} is a {type(value).__name__}, not a tensor")
            tensors[f"state.{names[index]}.{key}"] = value.detach().clone().contiguous()
    groups = [{k: v for k, v in group.items() if k != "params"} for group in state["param_groups"]]
    return tensors, groups


def _write(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, str(path))
    with open(path, "rb") as f:  # data on disk before the rename makes the checkpoint visible
        os.fsync(f.fileno())


def save_training_state(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    keep: int = 2,
    writers: Writers | None = None,
) -> Path:
    """Write the checkpoint for `step` atomically; keep the newest `keep` checkpoints.

    With `writers` every rank calls this: each writes its own tensors (rank 0 the replicated ones too) to
    `model-0000r-of-0000R.safetensors` and `optimizer-0000r-of-0000R.safetensors`, and rank 0 writes
    `model.safetensors.index.json`, `state.json` and renames the folder into place."""
    run_dir = Path(run_dir)
    final = _step_dir(run_dir, step)
    tmp = final.with_name(f".tmp-{final.name}")
    lead = writers is None or writers.rank == 0
    if lead:
        if tmp.exists():
            shutil.rmtree(tmp)  # a leftover of a process killed mid-write
        tmp.mkdir(parents=True)
    if writers is not None:
        writers.barrier()
    model_tensors = {
        name: t.detach().clone().contiguous()
        for name, t in model.state_dict().items()
        if lead or not writers.replicated(name)
    }
    _write(model_tensors, tmp / _files("model", writers))
    opt_tensors, param_groups = _optimizer_tensors(model, optimizer)
    if not lead:
        opt_tensors = {k: v for k, v in opt_tensors.items() if not writers.replicated(k.split(".", 1)[1])}
    else:
        opt_tensors["rng.torch"] = torch.get_rng_state()
    _write(opt_tensors, tmp / _files("optimizer", writers))
    if writers is not None:
        writers.barrier()  # every rank's files are on disk
    if lead:
        if writers is not None and writers.world > 1:
            weight_map = {}
            for path in sorted(tmp.glob("model-*.safetensors")):
                with safe_open(str(path), "pt") as f:
                    weight_map.update(dict.fromkeys(f.keys(), path.name))
            index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
        meta = {"step": step, "param_groups": param_groups, **extra}
        (tmp / "state.json").write_text(json.dumps(meta, indent=1) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old_step, old in list_checkpoints(run_dir)[:-keep]:
            if old_step != step:
                shutil.rmtree(old, ignore_errors=True)
    if writers is not None:
        writers.barrier()  # the checkpoint is in place for everyone
    return final


class CheckpointTensors(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors by name (`stem.safetensors` or its shards `stem-*-of-*.safetensors`), each
    read from disk when asked for, so a whole model's passes through one tensor at a time."""

    def __init__(self, checkpoint: str | Path, stem: str = "model") -> None:
        self.where: dict[str, Path] = {}
        for path in sorted(Path(checkpoint).glob(f"{stem}*.safetensors")):
            with safe_open(str(path), "pt") as f:
                self.where.update(dict.fromkeys(f.keys(), path))

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(str(self.where[name]), "pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


def load_model_state(
    checkpoint: str | Path, model: nn.Module, elsewhere: Callable[[str], bool] | None = None
) -> None:
    """Load a checkpoint's parameters and buffers (routing biases included) into `model`, strictly, from
    one file or the shards that several ranks wrote. `elsewhere(name)`: tensors of the checkpoint that
    this model does not hold (another rank's experts); any other name missing on either side is an error."""
    held = set(model.state_dict())
    tensors = CheckpointTensors(checkpoint)
    extra = sorted(k for k in tensors if k not in held and (elsewhere is None or not elsewhere(k)))
    if extra:
        raise KeyError(f"{checkpoint}: tensors the model does not have: {', '.join(extra[:5])}")
    model.load_state_dict({k: tensors[k] for k in tensors if k in held}, strict=True)


def load_training_state(
    checkpoint: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    elsewhere: Callable[[str], bool] | None = None,
) -> dict:
    """Restore model, optimizer and RNG from a checkpoint directory; returns its `state.json`.

    Optimizer state is keyed by parameter name, so a checkpoint written by any number of ranks restores
    into any other (each rank takes the state of the parameters it holds)."""
    checkpoint = Path(checkpoint)
    meta = json.loads((checkpoint / "state.json").read_text())
    load_model_state(checkpoint, model, elsewhere)
    names = _param_names(model, optimizer)
    index = {name: i for i, name in enumerate(names)}
    saved = CheckpointTensors(checkpoint, "optimizer")
    torch.set_rng_state(saved["rng.torch"])
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key in saved:
        if key == "rng.torch":
            continue
        name, entry = key.removeprefix("state.").rsplit(".", 1)  # state.{parameter name}.{entry}
        if name in index:
            state.setdefault(index[name], {})[entry] = saved[key]
        elif elsewhere is None or not elsewhere(name):  # nothing is dropped silently
            raise KeyError(f"{checkpoint}: optimizer state {key} belongs to no parameter of this model")
    current = optimizer.state_dict()["param_groups"]
    if len(current) != len(meta["param_groups"]):
        raise ValueError(
            f"{checkpoint}: {len(meta['param_groups'])} optimizer groups, this optimizer has {len(current)}"
        )
    groups = [
        {**saved, "params": now["params"]} for saved, now in zip(meta["param_groups"], current, strict=True)
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return meta


def write_run_config(config: Any, path: Path, resumable: set[str], error: type[Exception]) -> None:
    """Write a run's config (a dataclass) as JSON at `path`, atomically, or raise `error` if `path` holds
    a run with other settings (fields in `resumable` may change between a run and its resumption)."""
    mine = {k: v for k, v in asdict(config).items() if k not in resumable}
    if path.is_file():
        theirs = {k: v for k, v in json.loads(path.read_text()).items() if k not in resumable}
        changed = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        if changed:
            raise error(
                f"{path.parent} holds a run with other settings ({', '.join(changed)}); choose another --out"
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(config), indent=1) + "\n")
    tmp.replace(path)


def cut_log(path: Path, columns: list[str], step: int) -> None:
    """Keep only a CSV log's complete rows up to `step` (rows written after the checkpoint, or a
    half-written line, are dropped), so the resumed run writes them again."""
    rows = []
    if path.is_file():
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                if None in row.values() or row.get("step") in (None, ""):
                    break  # a torn last line
                if int(row["step"]) <= step:
                    rows.append(row)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)
