"""`k3 atlas ...`: scan a checkpoint, print its statistics, serve or export its atlas.

The lead registers `atlas_app` in k3/cli.py: `app.add_typer(atlas_app, name="atlas")`. Heavy imports
happen inside the commands so `k3 --help` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from k3.terminal import fail

atlas_app = typer.Typer(
    name="atlas",
    help="The atlas: scan a checkpoint and show what is inside it, in the browser.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

SOURCE_HELP = "A checkpoint directory, a .safetensors file, an http(s) URL of one, or hf://ORG/REPO[@REV]."
SERVE_SOURCE_HELP = SOURCE_HELP + " A preset name or a config.json shows the config-only view (no weights)."
KEY = typer.Option(
    None,
    "--key",
    envvar="K3_ATLAS_KEY",
    help="Every request needs this key: the browser asks for it (any user name, the key as password). "
    "Required on an address other machines reach.",
)


def _listen(host: str, port: int, key: str | None, tries: int = 1):
    """The atlas server's socket (a one-line error for a bad or taken port), refused without a key where other
    machines could reach it."""
    from k3.errors import K3Error
    from k3.listen import listening_socket, require_key_beyond_this_machine

    how = "give a key with --key KEY (or K3_ATLAS_KEY), or write a static site to host with `k3 atlas build`"
    try:
        sock = listening_socket(host, port, tries)
        require_key_beyond_this_machine(sock, host, key, how)
    except K3Error as e:
        fail(str(e))
    return sock


def run_scan(
    source: str, out: Path | None, workers: int | None, similarity: bool = True, quiet: bool = False
) -> Path:
    """Scan with a rich progress bar (bytes, tensors, ETA); returns the database path."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from k3.atlas.scan import resolve_db_path, scan

    db_path = resolve_db_path(source, out)
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(bar_width=24),
        TaskProgressColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TextColumn("{task.fields[tensors]}"),
        TextColumn("ETA"),
        TimeRemainingColumn(compact=True),
    )
    with Progress(*columns, disable=quiet, transient=False) as bar:
        task = bar.add_task("scanning", total=None, tensors="")

        def on_progress(p) -> None:
            similarity_note = (
                f", similarity {p.similarity_done}/{p.similarity_total}" if p.similarity_total else ""
            )
            bar.update(
                task,
                total=p.bytes_total,
                completed=p.bytes_done,
                tensors=f"{p.tensors_done:,}/{p.tensors_total:,} tensors{similarity_note}",
            )

        scan(source, db_path, workers=workers, similarity=similarity, on_progress=on_progress)
    return db_path


@atlas_app.command("scan")
def scan_command(
    source: str = typer.Argument(..., help=SOURCE_HELP),
    out: Path | None = typer.Option(None, "--out", help="Directory for atlas.sqlite (default: a cache dir)."),
    workers: int | None = typer.Option(None, "--workers", min=1, help="Parallel readers (default: <= 4)."),
    similarity: bool = typer.Option(True, "--similarity/--no-similarity", help="Expert cosine similarity."),
) -> None:
    """Read every tensor once and store its statistics (resumable: rerun after an interruption)."""
    from k3.errors import K3Error

    try:
        db_path = run_scan(source, out, workers, similarity)
    except (K3Error, OSError) as e:
        fail(str(e))
    print(f"atlas database: {db_path}")


@atlas_app.command("stats")
def stats_command(
    source: str = typer.Argument(..., help=SOURCE_HELP),
    names: list[str] = typer.Argument(None, help="Tensor names (default: every tensor)."),
    out: Path | None = typer.Option(None, "--out", help="Directory of atlas.sqlite (default: a cache dir)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (a list of records)."),
) -> None:
    """Print the stored statistics of tensors, scanning first if needed."""
    from k3.atlas.db import AtlasDB
    from k3.atlas.scan import resolve_db_path
    from k3.errors import K3Error

    db_path = resolve_db_path(source, out)
    try:
        if not db_path.exists() or not AtlasDB(db_path).get_meta("complete"):
            run_scan(source, out, None, quiet=as_json)
    except (K3Error, OSError) as e:
        fail(str(e))
    db = AtlasDB(db_path)
    tensors = db.tensors() if not names else [db.tensor_by_name(n) for n in names]
    unknown = [n for n, t in zip(names or [], tensors, strict=False) if t is None]
    if unknown:
        fail(f"no tensor named {', '.join(unknown)} in {source}")
    records = []
    for t in tensors:
        record = db.stats(t.id) or {}
        record = (
            {k: v for k, v in record.items() if k not in ("magnitude_histogram", "values")}
            if not names
            else record
        )
        records.append(
            {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "params": t.params, **record}
        )
    if as_json:
        print(json.dumps(records, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Tensor statistics: {source}", title_justify="left")
    for col in ("name", "dtype", "shape", "min", "max", "mean", "rms", "zeros", "distinct"):
        table.add_column(col, justify="left" if col in ("name", "dtype") else "right")

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.4g}"

    for r in records:
        distinct = f"{r.get('distinct_values', '-'):,}" + ("" if r.get("distinct_exact", True) else "+")
        table.add_row(
            r["name"],
            r["dtype"],
            "x".join(map(str, r["shape"])),
            num(r.get("min")),
            num(r.get("max")),
            num(r.get("mean")),
            num(r.get("rms")),
            f"{r.get('zero_fraction', 0):.2%}",
            distinct,
        )
    Console().print(table)


def _make_app(source: str, out: Path | None, scan_first: bool, key: str | None):
    from k3.atlas.server import create_app
    from k3.atlas.view import Atlas

    atlas = Atlas.open(source, out)
    if scan_first and atlas.is_checkpoint and not atlas.scan_complete:
        run_scan(source, out, None)
        atlas = Atlas.open(source, out)
    return create_app(atlas, key)


@atlas_app.command("serve")
def serve_command(
    source: str = typer.Argument(..., help=SERVE_SOURCE_HELP),
    port: int = typer.Option(8000, "--port", help="0: any free port."),
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address (127.0.0.1: this machine only)."),
    out: Path | None = typer.Option(None, "--out", help="Directory of atlas.sqlite (default: a cache dir)."),
    scan_first: bool = typer.Option(True, "--scan/--no-scan", help="Scan first if the scan is incomplete."),
    key: str = KEY,
) -> None:
    """Serve the atlas of a checkpoint (or of a config alone) on http://HOST:PORT/."""
    from k3.errors import K3Error
    from k3.listen import run_app, url_of

    sock = _listen(host, port, key)
    try:
        app = _make_app(source, out, scan_first, key)
    except (K3Error, OSError) as e:
        fail(str(e))
    print(f"atlas of {source}: {url_of(sock)}", flush=True)
    run_app(app, sock, "warning")


@atlas_app.command("build")
def build_command(
    source: str = typer.Argument(..., help=SERVE_SOURCE_HELP),
    site: Path = typer.Option(..., "--out", help="Directory to write the static site into."),
    db_dir: Path | None = typer.Option(
        None, "--db", help="Directory of atlas.sqlite (default: a cache dir)."
    ),
    max_tile_level: int = typer.Option(3, "--tile-levels", min=0, max=8, help="Zoom levels pre-rendered."),
) -> None:
    """Export the atlas as a static site (JSON + pre-rendered tiles + the page) anyone can host."""
    from k3.atlas.site import build_site
    from k3.atlas.view import Atlas
    from k3.errors import K3Error

    try:
        atlas = Atlas.open(source, db_dir)
        if atlas.is_checkpoint and not atlas.scan_complete:
            run_scan(source, db_dir, None)
            atlas = Atlas.open(source, db_dir)
        n = build_site(atlas, site, max_tile_level=max_tile_level)
    except (K3Error, OSError) as e:
        fail(str(e))
    print(f"static atlas: {n} files in {site} (open {site / 'index.html'} through any web server)")


@atlas_app.command("demo")
def demo_command(
    directory: Path = typer.Option(
        Path("checkpoints/mini"), "--dir", help="Where the mini checkpoint lives."
    ),
    port: int = typer.Option(8000, "--port", help="0: any free port."),
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address (127.0.0.1: this machine only)."),
    key: str = KEY,
) -> None:
    """Create the `mini` checkpoint if absent (k3 init --preset mini), scan it, serve its atlas (on the next
    free port if PORT is taken: the URL printed is the one bound)."""
    from k3.config import K3Config
    from k3.listen import run_app, url_of

    sock = _listen(host, port, key, tries=20)
    cfg = K3Config.preset("mini")
    if not (directory / "config.json").exists():
        from k3.model.init import init_checkpoint

        print(f"creating the mini checkpoint in {directory} ...", flush=True)
        init_checkpoint(cfg, directory, seed=0)
    if not (directory / "tiktoken.model").exists():  # the routing panel needs a tokenizer
        from k3.tokenizer.build import write_tokenizer

        write_tokenizer(directory, cfg.vocab_size)
    app = _make_app(str(directory), None, True, key)
    taken = "" if sock.getsockname()[1] == port else f" (port {port} is taken)"
    print(f"atlas of {directory}: {url_of(sock)}{taken}", flush=True)
    run_app(app, sock, "warning")
