"""The atlas: scan a checkpoint and show what is inside it, in the browser.

Modules, one concept each: `stats` (per-tensor statistics, streaming), `reading` (bounded reads, fast MXFP4
decode), `db` (the SQLite schema and queries), `scan` (the parallel, resumable scan), `similarity` (expert
cosine similarity), `tiles` (weight-viewer tiles on the diverging scale), `view` (the JSON documents the
page shows), `routing` (tokens and router choices, running the model), `server` (FastAPI app), `site`
(static export), `commands` (`k3 atlas scan/stats/serve/build/demo`). The page lives in `static/`, its
texts in `i18n/{es,en}.json`.
"""
