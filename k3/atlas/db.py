"""The atlas database: one SQLite file per checkpoint, written by the scan and read by the server.

Tables:

* `meta`: key -> JSON (the source, the index fingerprint, the config and census when there is one);
* `tensors`: the *logical* tensors of the checkpoint in file order. An MXFP4 pair (`X.weight_packed` +
  `X.weight_scale`) is one logical tensor `X.weight` of dtype `MXFP4` and its dequantized shape; `parts`
  lists the stored tensors behind it. `layer`, `expert` and `matrix` come from the name;
* `stats`: one row per scanned tensor: the scalar statistics as columns (for grids and sorting) and the full
  record (histograms, value table) as JSON;
* `similarity` / `similarity_done`: cosine similarity of expert pairs per (MoE layer, matrix).

The database runs in WAL mode with synchronous=NORMAL (a commit costs no fsync); the scan stores whole
results only (the tensors finished since its last write in one transaction, each similarity job in one), so
a scan killed at any instant leaves only whole results behind, and a rerun skips them.
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3.atlas.stats import STAT_KEYS

SCHEMA_VERSION = 2  # bump when the index or a record changes meaning

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tensors (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    dtype TEXT NOT NULL,
    shape TEXT NOT NULL,
    params INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    component TEXT NOT NULL,
    layer INTEGER,
    expert INTEGER,
    matrix TEXT,
    shard TEXT NOT NULL,
    parts TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS tensors_layer ON tensors(layer, expert);
CREATE TABLE IF NOT EXISTS stats (
    id INTEGER PRIMARY KEY REFERENCES tensors(id),
    {stat_columns},
    distinct_exact INTEGER NOT NULL,
    seconds REAL NOT NULL,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS similarity (
    layer INTEGER NOT NULL,
    matrix TEXT NOT NULL,
    a INTEGER NOT NULL,
    b INTEGER NOT NULL,
    cosine REAL,
    PRIMARY KEY (layer, matrix, a, b)
);
CREATE TABLE IF NOT EXISTS similarity_done (
    layer INTEGER NOT NULL,
    matrix TEXT NOT NULL,
    subset TEXT NOT NULL,
    PRIMARY KEY (layer, matrix)
);
""".replace("{stat_columns}", ",\n    ".join(f"{k} REAL" for k in STAT_KEYS))

# layer numbers in other families' names (GPT-2 `h.3.`, `blocks.3.`, `layer.3.`), when k3.layout finds none
_GENERIC_LAYER = re.compile(r"(?:^|\.)(?:layers?|h|blocks?)\.(\d+)\.")
# `...experts.12.w1.weight`, `...experts.3.gate_proj.weight`: routed expert matrices of any MoE checkpoint
_EXPERT = re.compile(r"\.experts\.(\d+)\.([A-Za-z0-9_]+)\.weight$")


@dataclass(frozen=True)
class LogicalTensor:
    """One tensor as the atlas shows it (an MXFP4 pair is one)."""

    id: int
    name: str
    dtype: str  # safetensors dtype, or "MXFP4"
    shape: tuple[int, ...]
    params: int
    bytes: int
    component: str
    layer: int | None
    expert: int | None
    matrix: str | None
    shard: str
    parts: tuple[str, ...]  # the stored tensors: (name,) or (packed, scale)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "params": self.params,
            "bytes": self.bytes,
            "component": self.component,
            "layer": self.layer,
            "expert": self.expert,
            "matrix": self.matrix,
            "shard": self.shard,
            "parts": list(self.parts),
        }


def logical_tensors(infos: Sequence[Any], cfg: Any = None) -> list[LogicalTensor]:
    """Group a checkpoint's TensorInfos (file order) into logical tensors, pairing MXFP4 packed/scale."""
    from k3.layout import VISION_COMPONENTS, classify

    by_name = {t.name: t for t in infos}
    out: list[LogicalTensor] = []
    for t in infos:
        parts: tuple[str, ...] = (t.name,)
        name, dtype, shape, nbytes = t.name, t.dtype, tuple(t.shape), t.nbytes
        if t.name.endswith(".weight_scale") and t.name[: -len("_scale")] + "_packed" in by_name:
            continue  # folded into its packed sibling
        if t.name.endswith(".weight_packed"):
            scale = by_name.get(t.name[: -len("_packed")] + "_scale")
            if scale is not None and t.dtype == "U8" and scale.dtype == "U8" and len(t.shape) >= 1:
                name = t.name[: -len("_packed")]
                dtype = "MXFP4"
                shape = (*t.shape[:-1], 2 * t.shape[-1])
                parts = (t.name, scale.name)
                nbytes = t.nbytes + scale.nbytes
        params = 1
        for d in shape:
            params *= d
        component, layer = classify(name, cfg)
        if layer is None and component not in VISION_COMPONENTS and (g := _GENERIC_LAYER.search(name)):
            layer = int(g.group(1))
        m = _EXPERT.search(name)
        expert, matrix = (int(m.group(1)), m.group(2)) if m else (None, None)
        out.append(
            LogicalTensor(
                len(out), name, dtype, shape, params, nbytes, component, layer, expert, matrix, t.shard, parts
            )
        )
    return out


def fingerprint(infos: Iterable[Any]) -> str:
    """Identifies a checkpoint's index: names, dtypes, shapes and byte ranges of every stored tensor (and
    the version of the atlas's own index, so a database written by an older atlas is rebuilt)."""
    h = hashlib.sha256(f"k3-atlas-index-{SCHEMA_VERSION}\n".encode())
    for t in infos:
        h.update(f"{t.name}|{t.dtype}|{list(t.shape)}|{t.shard}|{t.start}|{t.end}\n".encode())
    return h.hexdigest()


class AtlasDB:
    """A connection to one atlas database. Not shared between threads: the scan writes from one thread."""

    def __init__(self, path: str | Path, *, readonly: bool = False):
        self.path = Path(path)
        if readonly:
            if not self.path.exists():
                raise FileNotFoundError(f"no atlas database at {self.path}")
            self.conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.conn = sqlite3.connect(self.path, check_same_thread=False)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self.conn.executescript(_SCHEMA)
            if self.get_meta("schema_version") is None:
                self.set_meta("schema_version", SCHEMA_VERSION)
        self.conn.row_factory = sqlite3.Row

    def close(self) -> None:
        self.conn.close()

    # ---- meta -----------------------------------------------------------------------------------------
    def get_meta(self, key: str) -> Any:
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def set_meta(self, key: str, value: Any) -> None:
        with self.conn:
            self.conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, json.dumps(value)))

    # ---- the index ------------------------------------------------------------------------------------
    def write_index(self, tensors: Sequence[LogicalTensor], fp: str) -> None:
        """Store the tensor index. A different fingerprint (another checkpoint) clears every result."""
        if self.get_meta("fingerprint") == fp:
            return
        with self.conn:
            for table in ("stats", "similarity", "similarity_done", "tensors"):
                self.conn.execute(f"DELETE FROM {table}")
            self.conn.executemany(
                "INSERT INTO tensors VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                [
                    (
                        t.id,
                        t.name,
                        t.dtype,
                        json.dumps(list(t.shape)),
                        t.params,
                        t.bytes,
                        t.component,
                        t.layer,
                        t.expert,
                        t.matrix,
                        t.shard,
                        json.dumps(list(t.parts)),
                    )
                    for t in tensors
                ],
            )
            self.conn.execute("INSERT OR REPLACE INTO meta VALUES ('fingerprint', ?)", (json.dumps(fp),))

    def tensors(self) -> list[LogicalTensor]:
        rows = self.conn.execute("SELECT * FROM tensors ORDER BY id").fetchall()
        return [_tensor(r) for r in rows]

    def tensor_by_name(self, name: str) -> LogicalTensor | None:
        """Looks up a logical name or the name of one of its stored parts."""
        row = self.conn.execute("SELECT * FROM tensors WHERE name = ?", (name,)).fetchone()
        if row is None and name.endswith((".weight_packed", ".weight_scale")):
            row = self.conn.execute(
                "SELECT * FROM tensors WHERE name = ?", (name.rsplit("_", 1)[0],)
            ).fetchone()
        return None if row is None else _tensor(row)

    # ---- statistics -----------------------------------------------------------------------------------
    def done_ids(self) -> set[int]:
        return {r[0] for r in self.conn.execute("SELECT id FROM stats")}

    def write_stats_rows(self, rows: Sequence[tuple[Any, ...]]) -> None:
        """Rows of `stats_row`, in one transaction: each tensor's statistics appear whole or not at all."""
        with self.conn:
            self.conn.executemany(
                f"INSERT OR REPLACE INTO stats VALUES (?, {', '.join('?' * len(STAT_KEYS))}, ?, ?, ?)", rows
            )

    def stats(self, tid: int) -> dict[str, Any] | None:
        row = self.conn.execute("SELECT record FROM stats WHERE id = ?", (tid,)).fetchone()
        return None if row is None else json.loads(row[0])

    def stat_table(self, columns: Sequence[str]) -> list[sqlite3.Row]:
        """Rows of tensors joined with chosen scalar statistics (NULL where not scanned)."""
        bad = [c for c in columns if c not in STAT_KEYS]
        if bad:
            raise ValueError(f"unknown statistic(s): {bad}")
        cols = "".join(f", s.{c} AS {c}" for c in columns)
        return self.conn.execute(
            f"SELECT t.id, t.name, t.dtype, t.layer, t.expert, t.matrix, t.component, t.params, t.bytes,"
            f" s.distinct_exact{cols} FROM tensors t LEFT JOIN stats s ON s.id = t.id ORDER BY t.id"
        ).fetchall()

    # ---- expert similarity ----------------------------------------------------------------------------
    def similarity_done(self) -> set[tuple[int, str]]:
        return {(r[0], r[1]) for r in self.conn.execute("SELECT layer, matrix FROM similarity_done")}

    def write_similarity(
        self, layer: int, matrix: str, cosines: dict[tuple[int, int], float], subset: list[int]
    ) -> None:
        with self.conn:
            self.conn.execute("DELETE FROM similarity WHERE layer = ? AND matrix = ?", (layer, matrix))
            self.conn.executemany(
                "INSERT INTO similarity VALUES (?,?,?,?,?)",
                [(layer, matrix, a, b, c) for (a, b), c in sorted(cosines.items())],
            )
            self.conn.execute(
                "INSERT OR REPLACE INTO similarity_done VALUES (?,?,?)", (layer, matrix, json.dumps(subset))
            )

    def similarity(self, layer: int) -> dict[str, dict[str, Any]]:
        """{matrix: {"subset": [...], "pairs": [[a, b, cosine], ...]}} for one layer."""
        out: dict[str, dict[str, Any]] = {}
        for m, subset in self.conn.execute(
            "SELECT matrix, subset FROM similarity_done WHERE layer = ? ORDER BY matrix", (layer,)
        ):
            pairs = self.conn.execute(
                "SELECT a, b, cosine FROM similarity WHERE layer = ? AND matrix = ? ORDER BY a, b", (layer, m)
            ).fetchall()
            out[m] = {"subset": json.loads(subset), "pairs": [list(p) for p in pairs]}
        return out


def stats_row(tid: int, record: dict[str, Any], seconds: float) -> tuple[Any, ...]:
    """The `stats` table row of one tensor, its record encoded as JSON. The scan's workers build rows (the
    encoding of large value tables is a good part of a small tensor's cost) and the writer stores them."""
    columns = [record.get(k) for k in STAT_KEYS]
    return (tid, *columns, int(bool(record["distinct_exact"])), seconds, json.dumps(record))


def _tensor(r: sqlite3.Row) -> LogicalTensor:
    return LogicalTensor(
        r["id"],
        r["name"],
        r["dtype"],
        tuple(json.loads(r["shape"])),
        r["params"],
        r["bytes"],
        r["component"],
        r["layer"],
        r["expert"],
        r["matrix"],
        r["shard"],
        tuple(json.loads(r["parts"])),
    )
