"""Resumable training checkpoints: atomic, safetensors for every tensor, JSON for the rest; no pickle.

A checkpoint is a directory `RUN/checkpoints/step-00000123/` holding

* `model.safetensors`: the model's state dict (parameters and buffers, routing biases included);
* `optimizer.safetensors`: every optimizer state tensor as `state.{param index}.{key}` (AdamW: `step`,
  `exp_avg`, `exp_avg_sq`) and the torch RNG state as `rng.torch` (a uint8 tensor);
* `state.json`: the step, the optimizer's param groups (learning rate, betas, ...) and anything else
  the trainer wants back.

It is written under a temporary name (`.tmp-step-...`) and renamed into place, so a process killed at any
moment leaves either the complete checkpoint or none; older checkpoints are deleted only after the new
one is in place. Data needs no state: batches are pure functions of (seed, batch index).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
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


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    state = optimizer.state_dict()
    tensors = {}
    for index, entries in state["state"].items():
        for key, value in entries.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {index}.{key} is a {type(value).__name__}, not a tensor")
            tensors[f"state.{index}.{key}"] = value.detach().clone().contiguous()
    return tensors, state["param_groups"]


def save_training_state(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write the checkpoint for `step` atomically; keep the newest `keep` checkpoints."""
    run_dir = Path(run_dir)
    final = _step_dir(run_dir, step)
    tmp = final.with_name(f".tmp-{final.name}")
    if tmp.exists():
        shutil.rmtree(tmp)  # a leftover of a process killed mid-write
    tmp.mkdir(parents=True)
    model_tensors = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
    save_file(model_tensors, str(tmp / "model.safetensors"))
    opt_tensors, param_groups = _optimizer_tensors(optimizer)
    opt_tensors["rng.torch"] = torch.get_rng_state()
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    meta = {"step": step, "param_groups": param_groups, **extra}
    (tmp / "state.json").write_text(json.dumps(meta, indent=1) + "\n")
    for path in tmp.iterdir():  # data on disk before the rename makes the checkpoint visible
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old_step, old in list_checkpoints(run_dir)[:-keep]:
        if old_step != step:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_model_state(checkpoint: str | Path, model: nn.Module) -> None:
    """Load a checkpoint's parameters and buffers (routing biases included) into `model`, strictly."""
    model.load_state_dict(load_file(str(Path(checkpoint) / "model.safetensors")), strict=True)


def load_training_state(checkpoint: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Restore model, optimizer and RNG from a checkpoint directory; returns its `state.json`."""
    checkpoint = Path(checkpoint)
    meta = json.loads((checkpoint / "state.json").read_text())
    load_model_state(checkpoint, model)
    tensors = load_file(str(checkpoint / "optimizer.safetensors"))
    torch.set_rng_state(tensors.pop("rng.torch"))
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
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
