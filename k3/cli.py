"""The `k3` command. Each room of the package owns its commands (`k3/<room>/commands.py`); this file only
wires them together, so `k3 --help` stays fast (heavy imports happen inside the commands)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from k3.census import Census, census_from_headers, census_of
from k3.config import PRESETS, PUBLIC_PRESETS
from k3.errors import K3Error
from k3.terminal import fail

app = typer.Typer(
    name="k3",
    help="Kimi K3, exact and readable: census, checkpoints, model, atlas, engine, training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # a docstring's paragraph is one paragraph; `code` shown as code
)
console = Console()


@app.callback()
def _root() -> None:
    """Kimi K3, exact and readable: census, checkpoints, model, atlas, engine, training."""


def _human(n: float, unit: str = "") -> str:
    for suffix in ("", " K", " M", " B", " T"):
        if abs(n) < 1000:
            return f"{n:,.2f}{suffix}{unit}" if suffix else f"{n:,.0f}{unit}"
        n /= 1000
    return f"{n:,.2f} P{unit}"


def _human_bytes(n: float) -> str:
    for suffix in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000:
            return f"{n:,.2f} {suffix}" if suffix != "B" else f"{n:,.0f} B"
        n /= 1000
    return f"{n:,.2f} PB"


def print_census(c: Census, title: str) -> None:
    j = c.to_json()
    total = j["total_params"]
    table = Table(title=f"Parameter census: {title}", title_justify="left")
    table.add_column("component")
    table.add_column("parameters", justify="right")
    table.add_column("share", justify="right")
    for name, params in j["components"].items():
        if params:
            table.add_row(name, f"{params:,}", f"{params / total:.2%}")
    table.add_row("[bold]total", f"[bold]{total:,}", "100%")
    console.print(table)
    kinds = Table(title="Layers by kind", title_justify="left")
    kinds.add_column("kind")
    kinds.add_column("layers", justify="right")
    kinds.add_column("parameters", justify="right")
    for kind, v in j["layer_kinds"].items():
        kinds.add_row(kind, str(v["layers"]), f"{v['params']:,}")
    console.print(kinds)
    console.print(
        f"total [bold]{_human(total)}[/] parameters, active per token [bold]{_human(j['active_params'])}[/] "
        f"({j['active_fraction']:.1%}); {j['layers']} layers "
        f"({j['kda_layers']} KDA + {j['mla_layers']} MLA), "
        f"{j['moe_layers']} MoE layers\n"
        f"routed experts: {j['routed_experts']:,} in all, {j['experts_per_layer']} per MoE layer "
        f"(top-{j['experts_per_token']}) + {j['shared_experts_per_layer']} shared; one expert = "
        f"{j['params_per_expert']:,} params (3 x {j['params_per_expert_matrix']:,}); experts hold "
        f"{j['expert_params'] / total:.1%} of all parameters\n"
        f"on disk: [bold]{_human_bytes(j['disk_bytes'])}[/] ("
        + ", ".join(f"{k} {_human_bytes(v)}" for k, v in sorted(j["disk_bytes_by_format"].items()))
        + ")",
        highlight=False,
    )
    if j["vision_params"]:
        parts = ", ".join(f"{k} {v:,}" for k, v in j["vision_components"].items())
        console.print(f"vision path, besides the total: {j['vision_params']:,} parameters ({parts})")
    if j["other_params"]:
        console.print(f"outside the text model and the vision path: {j['other_params']:,} parameters")
    for finding in j["findings"]:
        console.print(f"[yellow]finding:[/] {finding}", highlight=False)


@app.command()
def census(
    target: str = typer.Argument(
        ...,
        help=f"A preset ({', '.join(PRESETS + PUBLIC_PRESETS)}), a config.json, a checkpoint "
        "directory or an http(s) URL of one.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON."),
) -> None:
    """Parameter and byte census of a K3-family model, from its config or a checkpoint's headers."""
    try:
        c = census_of(target)
    except (K3Error, OSError) as e:
        fail(str(e))
    if as_json:
        print(json.dumps(c.to_json(), indent=2))
    else:
        print_census(c, target)


def _census_findings(cfg, headers, source: str) -> list[str]:
    """`k3 inspect`'s cross-check: what the census finds wrong in the headers against the config."""
    return census_from_headers(cfg, headers, source).findings


def _register_rooms() -> None:
    """Each room's commands, imported light (their heavy imports happen when a command runs)."""
    from k3.atlas.commands import atlas_app
    from k3.checkpoint.commands import download_command, inspect_command
    from k3.conform.commands import conform, golden_app
    from k3.dist.commands import generate  # the engine's `k3 generate`, plus --nproc N (expert parallel)
    from k3.distill.commands import distill_app
    from k3.engine.commands import chat, serve, tokenize
    from k3.export.commands import export_app
    from k3.model.commands import say_written, write_random_checkpoint
    from k3.ops.commands import doctor
    from k3.rl.commands import rl_app
    from k3.sandbox.commands import sandbox_app
    from k3.stream.commands import stream_app
    from k3.train.commands import train_app
    from k3.vision.commands import vision_app

    app.command("inspect")(inspect_command(cross_check=_census_findings))
    app.command("download")(download_command)
    app.command("doctor")(doctor)

    @app.command("init")
    def init(
        out: Path = typer.Argument(..., help="Directory to write the checkpoint into (created if missing)."),
        preset: str | None = typer.Option(
            None, "--preset", help=f"One of {', '.join(PRESETS + PUBLIC_PRESETS)}."
        ),
        like: str | None = typer.Option(
            None, "--like", help=f"A public checkpoint's exact layout: {', '.join(PUBLIC_PRESETS)}."
        ),
        seed: int = typer.Option(0, "--seed", help="Random seed: the same seed writes the same bytes."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace a checkpoint already in OUT."),
    ) -> None:
        """Write a random checkpoint in the published layout (shards, index, config.json, MXFP4 experts)
        and a small built-in tokenizer (tiktoken.model + tokenizer_config.json) sized to its vocabulary.
        A public checkpoint's name (`--like` or `--preset`) writes its exact layout (docs/checkpoint.md)."""
        from k3.config import K3Config
        from k3.tokenizer.build import CONFIG_FILE, TIKTOKEN_FILE, write_tokenizer

        if (preset is None) == (like is None):
            fail("give one of --preset NAME or --like NAME")
        name = str(preset or like)
        if like is not None and like not in PUBLIC_PRESETS:
            fail(f"--like: unknown public layout {like!r} (choose from {', '.join(PUBLIC_PRESETS)})")
        files = write_random_checkpoint(out, name, seed, overwrite)  # a public name: its exact layout
        write_tokenizer(out, K3Config.preset(name).vocab_size)
        say_written(name, seed, out, [*files, out / TIKTOKEN_FILE, out / CONFIG_FILE])

    for command in (tokenize, generate, chat, serve):
        app.command()(command)
    app.add_typer(atlas_app, name="atlas")
    app.add_typer(train_app, name="train")
    app.add_typer(sandbox_app, name="sandbox")
    app.add_typer(stream_app, name="stream")
    app.add_typer(export_app, name="export")
    app.add_typer(golden_app, name="golden")
    app.command("conform")(conform)
    app.add_typer(rl_app, name="rl")
    app.add_typer(distill_app, name="distill")
    app.add_typer(vision_app, name="vision")


_register_rooms()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
