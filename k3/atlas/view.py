"""What the page shows: the JSON documents of the atlas, built from the config, the census and the scan.

`Atlas.open(source)` takes a checkpoint (directory, file, URL) or, for the config-only view, a preset name or
a config.json. The server and the static export both serve exactly these documents, so a static site is
the live one frozen. Every figure on the page comes from here; the page's texts hold none.
"""

from __future__ import annotations

import statistics
import threading
from pathlib import Path
from typing import Any

from k3.atlas.db import AtlasDB, LogicalTensor
from k3.atlas.stats import STAT_KEYS
from k3.config import FFN, PRESETS, PUBLIC_PRESETS, K3Config, no_such_source
from k3.layout import VISION_COMPONENTS

GRID_MATRICES_MAX = 4  # matrix kinds shown in the expert grid


class AtlasError(ValueError):
    """A request for something the atlas does not have (the server answers 404)."""


class Atlas:
    def __init__(
        self,
        source: str,
        config: K3Config | None,
        tensors: list[LogicalTensor],
        db: AtlasDB | None,
        db_path: Path | None,
    ):
        self.source = source
        self.config = config
        self.db = db
        self.db_path = db_path
        self.lock = threading.Lock()  # one sqlite connection, shared by the server's threads
        self._tensors = tensors
        self._by_name = {t.name: t for t in self._tensors}
        self._checkpoint = None
        self._census: dict[str, Any] | None = None

    @classmethod
    def open(cls, source: str, db_dir: str | Path | None = None) -> Atlas:
        """A preset or config.json: config only. Anything else: a checkpoint, with its database if scanned.

        A checkpoint's tensor index and census come from its headers alone (remotely: a few kB per shard),
        so an unscanned checkpoint already shows its layer map, census and tensor list; a database left by
        a scan of other files (a different index fingerprint) is ignored."""
        if source in PRESETS + PUBLIC_PRESETS:
            return cls(source, K3Config.preset(source), [], None, None)
        path = Path(source)
        if path.is_file() and path.suffix == ".json":
            return cls(source, K3Config.from_json(path), [], None, None)
        if "://" not in source and not path.exists():
            raise no_such_source(source)
        from k3.atlas.db import fingerprint, logical_tensors
        from k3.atlas.scan import resolve_db_path
        from k3.checkpoint import open_checkpoint

        with open_checkpoint(source) as ckpt:  # validates the source now, with a clear error
            infos = list(ckpt.tensors())
            config = ckpt.config
        db_path = resolve_db_path(source, db_dir)
        db = AtlasDB(db_path) if db_path.exists() else None
        if db is not None and db.get_meta("fingerprint") != fingerprint(infos):
            db.close()
            db = None
        return cls(source, config, logical_tensors(infos, config), db, db_path)

    # ---- state ----------------------------------------------------------------------------------------
    @property
    def is_checkpoint(self) -> bool:
        return self.db_path is not None

    @property
    def scan_complete(self) -> bool:
        return self.db is not None and self.db.get_meta("complete") is not None

    def checkpoint(self):
        """The open checkpoint (for tiles, values and routing), opened on first use."""
        if not self.is_checkpoint:
            raise AtlasError("this atlas shows a config only: there are no weights to read")
        with self.lock:
            if self._checkpoint is None:
                from k3.checkpoint import open_checkpoint

                self._checkpoint = open_checkpoint(self.source)
            return self._checkpoint

    def tensors(self) -> list[LogicalTensor]:
        return list(self._tensors)

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes for t in self._tensors)

    def tensor(self, tid: int) -> LogicalTensor:
        if not 0 <= tid < len(self._tensors):
            raise AtlasError(f"no tensor with id {tid}")
        return self._tensors[tid]

    def tensor_named(self, name: str) -> LogicalTensor:
        t = self._by_name.get(name)
        if t is None:
            raise AtlasError(f"no tensor named {name!r}")
        return t

    def stats(self, tid: int) -> dict[str, Any] | None:
        if self.db is None:
            return None
        with self.lock:
            return self.db.stats(tid)

    # ---- documents ------------------------------------------------------------------------------------
    def census(self) -> dict[str, Any] | None:
        """The census of the checkpoint's headers (or of the config alone), computed once."""
        if self.config is None:
            return None
        if self._census is None:
            from k3.census import census_from_config, census_from_headers

            if self._tensors and self.is_checkpoint:
                headers = self._stored_headers()
                self._census = census_from_headers(self.config, headers, self.source).to_json()
            else:
                self._census = census_from_config(self.config).to_json()
        return self._census

    def _stored_headers(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of the stored tensors, MXFP4 pairs split back into packed + scale."""
        out = []
        for t in self._tensors:
            if t.dtype == "MXFP4":
                *rows, cols = t.shape
                out.append((t.parts[0], "U8", (*rows, cols // 2)))
                out.append((t.parts[1], "U8", (*rows, cols // 32)))
            else:
                out.append((t.name, t.dtype, t.shape))
        return out

    def summary(self) -> dict[str, Any]:
        cfg = self.config
        doc: dict[str, Any] = {
            "source": Path(self.source).name if not self.source.startswith("http") else self.source,
            "kind": "checkpoint" if self.is_checkpoint else "config",
            "family": (cfg.published_form if cfg else None),
            "census": self.census(),
            "config": _config_figures(cfg) if cfg else None,
            "tensors": len(self._tensors),
            "scanned": 0,
            "scan_complete": self.scan_complete,
            "bytes": sum(t.bytes for t in self._tensors),
            "params": sum(t.params for t in self._tensors if not t.name.endswith(".weight_scale")),
            "dtypes": _count_by(self._tensors, lambda t: t.dtype),
            "has_experts": any(t.expert is not None for t in self._tensors)
            or bool(cfg and cfg.num_experts and not self.is_checkpoint),
            "stat_keys": list(STAT_KEYS),
            "measured": self.measured(),
        }
        if self.db is not None:
            with self.lock:
                doc["scanned"] = len(self.db.done_ids())
        return doc

    def measured(self) -> dict[str, Any]:
        """Figures the guide quotes that only a scan can give (the seed's 21 values, cosines near 0)."""
        if self.db is None:
            return {}
        with self.lock:
            rows = self.db.stat_table(["distinct_values", "zero_fraction", "mean_abs"])
            layers = sorted({r["layer"] for r in rows if r["expert"] is not None and r["layer"] is not None})
            cos = [
                c
                for layer in layers
                for m in self.db.similarity(layer).values()
                for a, b, c in m["pairs"]
                if b == a + 1 and c is not None
            ]
        experts = [r for r in rows if r["expert"] is not None and r["distinct_values"] is not None]
        out: dict[str, Any] = {}
        if experts:
            distinct = [int(r["distinct_values"]) for r in experts]
            out["expert_distinct_median"] = statistics.median(distinct)
            out["expert_distinct_min"] = min(distinct)
            out["expert_distinct_max"] = max(distinct)
            out["expert_matrices"] = len(experts)
            means = [r["mean_abs"] for r in experts if r["mean_abs"]]
            if means:
                out["expert_mean_abs_spread"] = (max(means) - min(means)) / statistics.mean(means)
        if cos:
            out["neighbour_cosine_min"] = min(cos)
            out["neighbour_cosine_max"] = max(cos)
            out["neighbour_cosine_mean_abs"] = statistics.mean(abs(c) for c in cos)
            out["neighbour_pairs"] = len(cos)
        return out

    def layers(self) -> dict[str, Any]:
        """The layer map: from the config (every layer, its kind, its parameters by part) or, for a
        checkpoint without a K3 config, from the tensor names alone."""
        if self.config is not None:
            return _layer_map_from_config(self.config)
        params: dict[int, int] = {}
        for t in self._tensors:
            if t.layer is not None:
                params[t.layer] = params.get(t.layer, 0) + t.params
        return {
            "from": "tensors",
            "layers": [
                {"index": i, "mixer": None, "ffn": None, "params": p, "parts": {}, "attn_res_block": None}
                for i, p in sorted(params.items())
            ],
            "attn_res_blocks": [],
        }

    def layer(self, index: int) -> dict[str, Any]:
        """One layer: its tensors with their main statistics (experts included)."""
        tensors = [t for t in self._tensors if t.layer == index]
        if not tensors and not (self.config and 0 <= index < self.config.num_hidden_layers):
            raise AtlasError(f"no layer {index}")
        return {"index": index, "tensors": self._tensor_rows(tensors)}

    def other_tensors(self) -> dict[str, Any]:
        """Tensors outside the layers; `parts`: the vision tower's and the projector's, each a part."""
        rows = self._tensor_rows([t for t in self._tensors if t.layer is None])
        parts = {p: [r for r in rows if r["component"] == p] for p in VISION_COMPONENTS}
        return {"tensors": rows, "parts": {p: r for p, r in parts.items() if r}}

    def _tensor_rows(self, tensors: list[LogicalTensor]) -> list[dict[str, Any]]:
        if self.db is None:
            return [t.to_json() for t in tensors]
        keys = ["min", "max", "mean", "mean_abs", "rms", "zero_fraction", "distinct_values"]
        with self.lock:
            rows = {r["id"]: r for r in self.db.stat_table(keys)}
        out = []
        for t in tensors:
            row = t.to_json()
            r = rows[t.id]
            row["stats"] = None if r["distinct_values"] is None else {k: r[k] for k in keys}
            if row["stats"] is not None:
                row["stats"]["distinct_exact"] = bool(r["distinct_exact"])
            out.append(row)
        return out

    def tensor_doc(self, tid: int) -> dict[str, Any]:
        from k3.atlas.tiles import tile_geometry

        t = self.tensor(tid)
        doc = t.to_json()
        doc["stats"] = self.stats(tid)
        doc["tiles"] = tile_geometry(t, doc["stats"])
        return doc

    def grid(self, stat: str) -> dict[str, Any]:
        """Layers x experts of one statistic, per matrix kind: the expert grid."""
        if stat not in STAT_KEYS:
            raise AtlasError(f"unknown statistic {stat!r}; one of {', '.join(STAT_KEYS)}")
        if self.db is None:
            return {"stat": stat, "matrices": {}, "layers": [], "experts": 0}
        with self.lock:
            rows = [
                r for r in self.db.stat_table([stat]) if r["expert"] is not None and r["layer"] is not None
            ]
        layers = sorted({r["layer"] for r in rows})
        experts = 1 + max((r["expert"] for r in rows), default=-1)
        matrices = sorted({r["matrix"] for r in rows})[:GRID_MATRICES_MAX]
        values = {m: [[None] * experts for _ in layers] for m in matrices}
        ids = {m: [[None] * experts for _ in layers] for m in matrices}
        row_of = {layer: i for i, layer in enumerate(layers)}
        for r in rows:
            if r["matrix"] in values:
                values[r["matrix"]][row_of[r["layer"]]][r["expert"]] = r[stat]
                ids[r["matrix"]][row_of[r["layer"]]][r["expert"]] = r["id"]
        spread = {m: [_spread([v for v in row if v is not None]) for row in values[m]] for m in matrices}
        return {
            "stat": stat,
            "layers": layers,
            "experts": experts,
            "matrices": values,
            "ids": ids,
            "spread": spread,
        }

    def similarity(self, layer: int) -> dict[str, Any]:
        if self.db is None:
            return {"layer": layer, "matrices": {}}
        with self.lock:
            return {"layer": layer, "matrices": self.db.similarity(layer)}

    def moe_layers(self) -> list[int]:
        return sorted({t.layer for t in self._tensors if t.expert is not None and t.layer is not None})

    def layer_indices(self) -> list[int]:
        if self.config is not None:
            return list(range(self.config.num_hidden_layers))
        return sorted({t.layer for t in self._tensors if t.layer is not None})


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    mean = statistics.fmean(values)
    return {
        "min": min(values),
        "max": max(values),
        "mean": mean,
        "std": statistics.pstdev(values),
        "relative_range": (max(values) - min(values)) / abs(mean) if mean else None,
    }


def _count_by(items, key) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[key(x)] = out.get(key(x), 0) + 1
    return out


def _config_figures(cfg: K3Config) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_experts": cfg.num_experts,
        "num_experts_per_token": cfg.num_experts_per_token,
        "num_shared_experts": cfg.num_shared_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "expert_input_size": cfg.expert_input_size,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "attn_res_block_size": cfg.attn_res_block_size,
        "kda_num_heads": cfg.kda_num_heads,
        "kda_head_dim": cfg.kda_head_dim,
        "num_attention_heads": cfg.num_attention_heads,
        "kv_lora_rank": cfg.kv_lora_rank,
        "max_position_embeddings": cfg.max_position_embeddings,
        "experts_mxfp4": cfg.experts_mxfp4,
    }


# layer parts drawn in the layer map, in order: census components grouped for display
_PARTS = {
    "kda_attention": "attention",
    "mla_attention": "attention",
    "dense_mlp": "dense_mlp",
    "router": "router",
    "latent_projections": "latent",
    "routed_experts": "routed_experts",
    "shared_experts": "shared_experts",
    "norms": "norms",
    "attn_res": "attn_res",
}


def _layer_map_from_config(cfg: K3Config) -> dict[str, Any]:
    from k3.layout import layer_tensors

    blocks = cfg.attn_res_blocks if cfg.uses_attn_res else []
    block_of = {i: b for b, layers in enumerate(blocks) for i in layers}
    out = []
    for plan in cfg.layer_plan:
        parts: dict[str, int] = {}
        for t in layer_tensors(cfg, plan.index, expand_experts=False):
            part = _PARTS.get(t.component, "other")
            parts[part] = parts.get(part, 0) + t.params
        out.append(
            {
                "index": plan.index,
                "mixer": plan.mixer.value,
                "ffn": plan.ffn.value,
                "params": sum(parts.values()),
                "parts": parts,
                "attn_res_block": block_of.get(plan.index),
                "experts": cfg.num_experts if plan.ffn is FFN.MOE else 0,
            }
        )
    return {
        "from": "config",
        "layers": out,
        "attn_res_blocks": [[b[0], b[-1]] for b in blocks],
    }
