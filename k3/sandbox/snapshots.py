"""Where snapshots live: `<root>/snapshots/<id>/` with meta.json (the `Snapshot`), workspace/ (the files)
and, for "memory+fs", image/ (runsc's checkpoint). meta.json is written last and atomically, so a snapshot
without it is incomplete and is never loaded."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from k3.sandbox.types import SandboxError, Snapshot
from k3.sandbox.workspace import tree_bytes


def directory(root: Path, sid: str) -> Path:
    path = Path(root) / "snapshots" / sid
    if path.exists():
        raise SandboxError(f"snapshot {sid} already exists in {path.parent}")
    (path / "workspace").mkdir(parents=True)
    return path


def image_bytes(path: Path) -> int:
    return tree_bytes(path / "image") if (path / "image").exists() else 0


def save(snap: Snapshot) -> None:
    meta = Path(snap.path) / "meta.json"
    tmp = meta.with_suffix(".tmp")
    tmp.write_text(json.dumps(snap.to_json()))
    os.replace(tmp, meta)


def load(root: Path, snapshot: Snapshot | str) -> Snapshot:
    if isinstance(snapshot, Snapshot):
        return snapshot
    meta = Path(root) / "snapshots" / snapshot / "meta.json"
    if not meta.exists():
        raise SandboxError(f"no snapshot or paused sandbox {snapshot!r} under {Path(root) / 'snapshots'}")
    return Snapshot.from_json(json.loads(meta.read_text()))


def delete(snap: Snapshot) -> None:
    remove_directory(Path(snap.path))


def remove_directory(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
