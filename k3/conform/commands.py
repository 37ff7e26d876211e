"""`k3 golden CKPT --out DIR`, `k3 golden verify DIR`, `k3 conform --engine URL (--checkpoint | --golden)`."""

from __future__ import annotations

from pathlib import Path

import typer

from k3.errors import K3Error
from k3.terminal import fail, group_with_default

golden_app = typer.Typer(
    cls=group_with_default("write"),
    help="Golden packs: k3's exact numbers for a checkpoint, for other engines to be held against.",
    no_args_is_help=True,
)


@golden_app.command("write")
def golden_write(
    checkpoint: Path = typer.Argument(..., help="Checkpoint folder (config.json, weights, tokenizer)."),
    out: Path = typer.Option(..., "--out", help="Folder of the golden pack."),
    suite: str = typer.Option("default", "--suite", help="default (prompts + chats), chat, long."),
    continuation: int = typer.Option(8, "--continuation", help="Greedy tokens after each prompt."),
    long_tokens: int = typer.Option(2048, "--long-tokens", help="Length of the long suite's document."),
    stream: bool = typer.Option(
        None, "--stream/--in-memory", help="Through `k3 stream` (bounded memory); default: above 4 GB."
    ),
) -> None:
    """Write a golden pack of CHECKPOINT: token ids, per-position top-20 logprobs, hidden RMS, experts."""
    from k3.conform.golden import write_golden

    if continuation < 1:
        fail(f"--continuation must be >= 1, got {continuation}")
    try:
        manifest = write_golden(checkpoint, out, suite, continuation, stream, long_tokens)
    except K3Error as e:
        fail(str(e))
    typer.echo(
        f"{out}: {len(manifest['sequences'])} sequences, {manifest['computed']}, "
        f"expert format {manifest['expert_format']}"
    )


@golden_app.command("verify")
def golden_verify(
    pack: Path = typer.Argument(..., help="A golden pack folder."),
    checkpoint: Path = typer.Option(
        None, "--checkpoint", help="Recompute a sample with it (default: the manifest's source, if present)."
    ),
    sample: int = typer.Option(2, "--sample", help="Sequences recomputed."),
) -> None:
    """Check a golden pack's hashes, the checkpoint's identity, and recompute a sample."""
    from k3.conform.golden import read_manifest, verify_golden

    try:
        manifest = read_manifest(pack)
        source = checkpoint or Path(manifest["checkpoint"]["source"])
        problems = verify_golden(pack, source if source.is_dir() else None, sample)
    except K3Error as e:
        fail(str(e))
    for p in problems:
        typer.echo(f"FAIL {p}")
    if problems:
        raise typer.Exit(1)
    recomputed = f", {sample} sequences recomputed" if source.is_dir() else " (no checkpoint: hashes only)"
    typer.echo(f"{pack}: sound{recomputed}")


def conform(
    engine: str = typer.Option(..., "--engine", help="The engine's OpenAI-compatible base URL (…/v1)."),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="k3's reference: this checkpoint, in memory."),
    golden: Path = typer.Option(None, "--golden", help="k3's reference: a golden pack (k3 golden)."),
    scenarios: str = typer.Option(
        "prefix,tools,concurrent,cancel,long,repeat,tokenize,images", "--scenarios", help="Comma-separated."
    ),
    report: Path = typer.Option(None, "--report", help="Write OUT.json and OUT.md beside the table."),
    expert_format: str = typer.Option(
        "exact", "--expert-format", help="The engine's arithmetic: exact, f16-cache, q8-activations."
    ),
    threshold: float = typer.Option(None, "--threshold", help="max |dlogprob| (overrides --expert-format)."),
    max_tokens: int = typer.Option(8, "--max-tokens", help="Greedy tokens per request."),
    long_tokens: int = typer.Option(None, "--long-tokens", help="The near-limit prompt's length."),
    api_key: str = typer.Option(None, "--api-key", envvar="K3_API_KEY", help="Bearer token of the engine."),
) -> None:
    """Drive an OpenAI-compatible engine through K3's hybrid-state scenarios; every returned logprob is
    held against k3's exact value. Exits 1 when a scenario fails."""
    from k3.conform.client import EngineClient
    from k3.conform.golden import read_manifest, read_sequences
    from k3.conform.reference import CheckpointReference, GoldenReference, reference_model
    from k3.conform.report import THRESHOLDS, as_json, markdown, table
    from k3.conform.scenarios import SCENARIOS, Run, run_scenarios
    from k3.tokenizer.kimi import Tokenizer

    if (checkpoint is None) == (golden is None):
        fail("give exactly one of --checkpoint CKPT or --golden DIR")
    names = [s.strip() for s in scenarios.split(",") if s.strip()]
    if unknown := [s for s in names if s not in SCENARIOS]:
        fail(f"unknown scenarios {unknown} (known: {', '.join(SCENARIOS)})")
    if threshold is None:
        if expert_format not in THRESHOLDS:
            fail(f"--expert-format {expert_format!r}: one of {', '.join(THRESHOLDS)}")
        threshold = THRESHOLDS[expert_format]
    try:
        if checkpoint is not None:
            tokenizer = Tokenizer.from_source(checkpoint)
            reference = CheckpointReference(reference_model(checkpoint))  # with its tower, if it has one
        else:
            manifest = read_manifest(golden)
            source = Path(manifest["checkpoint"]["source"])
            tokenizer = Tokenizer.from_source(source if source.is_dir() else golden)
            reference = GoldenReference(read_sequences(golden))
            max_tokens = min(max_tokens, manifest["continuation"])
        client = EngineClient(engine, tokenizer, api_key)
        client.models()
    except (K3Error, OSError) as e:
        fail(str(e))
    except Exception as e:  # httpx: the engine is not there
        fail(f"{engine}: {type(e).__name__}: {e}")
    run = Run(client, reference, threshold, max_tokens, long_tokens=long_tokens)
    results = run_scenarios(run, names)
    client.close()
    typer.echo(table(results))
    if report is not None:
        Path(f"{report}.json").write_text(as_json(results, engine, threshold) + "\n")
        Path(f"{report}.md").write_text(markdown(results, engine, threshold))
    if not all(r.passed for r in results):
        raise typer.Exit(1)
