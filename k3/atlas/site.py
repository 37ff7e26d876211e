"""The static export: the atlas as plain files that any web server can host.

The site mirrors the server's URLs: `index.html`, `static/...`, `i18n/{es,en}.json`, and under `api/` every
GET document (`summary.json`, `layers.json`, `layer/N.json`, `tensors/other.json`, `tensor/ID.json`,
`grid/STAT.json`, `similarity/N.json`) plus the weight tiles of levels 0..`max_tile_level` of every tensor
(the viewer enlarges the finest exported level beyond that). What needs a live server (single values under
the cursor, running the model) says so on the page.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from k3.atlas.server import I18N_DIR, STATIC_DIR
from k3.atlas.stats import STAT_KEYS
from k3.atlas.tiles import MODES, TILE
from k3.atlas.view import Atlas


def build_site(atlas: Atlas, out: str | Path, *, max_tile_level: int = 3) -> int:
    """Write the site into `out` (created; existing files overwritten). Returns the number of files."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    count = 0

    def write(rel: str, data: bytes) -> None:
        nonlocal count
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        count += 1

    def write_json(rel: str, doc: Any) -> None:
        write(rel, json.dumps(doc, separators=(",", ":"), allow_nan=False).encode())

    shutil.copytree(STATIC_DIR, out / "static", dirs_exist_ok=True)
    count += sum(1 for p in (out / "static").rglob("*") if p.is_file())
    write("index.html", (STATIC_DIR / "index.html").read_bytes())
    for lang in I18N_DIR.glob("*.json"):
        write(f"i18n/{lang.name}", lang.read_bytes())

    summary = atlas.summary()
    summary.update(
        static=True,
        tile_levels=max_tile_level,
        routing={"available": False, "code": "static", "reason": "static export"},
    )
    write_json("api/summary.json", summary)
    write_json("api/layers.json", atlas.layers())
    if not atlas.is_checkpoint:
        return count

    for index in atlas.layer_indices():
        write_json(f"api/layer/{index}.json", atlas.layer(index))
    write_json("api/tensors/other.json", atlas.other_tensors())
    for stat in STAT_KEYS:
        write_json(f"api/grid/{stat}.json", atlas.grid(stat))
    for layer in atlas.moe_layers():
        write_json(f"api/similarity/{layer}.json", atlas.similarity(layer))

    from k3.atlas.reading import TensorReader
    from k3.atlas.tiles import TileRenderer

    renderer = TileRenderer(TensorReader(atlas.checkpoint(), atlas.source), cache_size=0)
    for t in atlas.tensors():
        doc = atlas.tensor_doc(t.id)
        write_json(f"api/tensor/{t.id}.json", doc)
        geo = doc["tiles"]
        for z in range(min(geo["max_level"], max_tile_level) + 1):
            span = TILE * 2 ** (geo["max_level"] - z)
            for y in range(-(-geo["rows"] // span)):
                for x in range(-(-geo["cols"] // span)):
                    for mode in MODES:
                        write(
                            f"api/tiles/{t.id}/{mode}/{z}/{x}/{y}.png",
                            renderer.tile(t, doc["stats"], mode, z, x, y),
                        )
    return count
