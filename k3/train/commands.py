"""`k3 train ...` (train or resume a run) and `k3 train plot RUN/` (PNG plots of its log).

Register in k3/cli.py with `app.add_typer(train_app, name="train")`. Heavy imports (torch, the model,
matplotlib) happen inside the commands so that `k3 --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from k3.terminal import fail

train_app = typer.Typer(
    help="Train K3-shaped models at small scale, with quantile-balanced routing.",
    no_args_is_help=False,
    add_completion=False,
)


@train_app.callback(invoke_without_command=True)
def train(
    ctx: typer.Context,
    preset: str = typer.Option(
        "tiny", help="Model: a preset (tiny, mini, ...), a config.json or a checkpoint dir."
    ),
    data: str = typer.Option(
        "mqar", help="mqar, copy, or a plain text file (tokenised with the k3 tokenizer)."
    ),
    steps: int = typer.Option(200, help="Optimizer steps."),
    out: Path = typer.Option(Path("runs/train"), help="Run folder; an existing run there is resumed."),
    batch_size: int = typer.Option(8, help="Sequences per micro-batch."),
    seq_len: int = typer.Option(64, help="Tokens per sequence."),
    accum: int = typer.Option(1, help="Micro-batches per optimizer step (gradient accumulation)."),
    lr: float = typer.Option(1e-3, help="Peak learning rate."),
    optimizer: str = typer.Option(
        "adamw", help="adamw, or muon (hidden matrices; AdamW for embeddings, head and vectors)."
    ),
    warmup: int = typer.Option(20, help="Warm-up steps."),
    schedule: str = typer.Option("cosine", help="cosine, wsd or constant after warm-up."),
    min_lr_ratio: float = typer.Option(0.1, help="Final learning rate as a fraction of the peak."),
    weight_decay: float = typer.Option(0.1, help="Decoupled weight decay (matrices only)."),
    clip: float = typer.Option(1.0, help="Max gradient norm (0: no clipping)."),
    dtype: str = typer.Option("fp32", help="fp32, or bf16 autocast."),
    seed: int = typer.Option(0, help="Seed of the weights, the data and every random choice."),
    balance: str = typer.Option("qb", help="Routing balance: qb (quantile balancing), deepseek or none."),
    qb_iters: int = typer.Option(1, help="Quantile-balancing rounds per batch (warm-started)."),
    balance_ema: float = typer.Option(0.0, help="EMA of the QB bias across batches (0: the latest only)."),
    balance_refresh: bool = typer.Option(
        False, help="QB: refit on the step's batch routed again by the updated model (one more forward)."
    ),
    gamma: float = typer.Option(1e-3, help="Step of the DeepSeek sign update."),
    num_kv_pairs: int = typer.Option(8, help="MQAR: key-value pairs per sequence."),
    tokenizer: Path | None = typer.Option(
        None, help="Tokenizer directory for text data (default: built-in)."
    ),
    checkpoint_every: int = typer.Option(50, help="Steps between checkpoints."),
    eval_every: int = typer.Option(0, help="Steps between held-out evaluations (0: none)."),
    stop_after: int | None = typer.Option(None, help="Stop after this step (rerun to resume)."),
    export: bool = typer.Option(True, help="Export the final model (experts MXFP4) to RUN/export."),
    threads: int = typer.Option(
        0, help="torch CPU threads (0: default; 1 is often fastest on a busy machine)."
    ),
    quiet: bool = typer.Option(False, help="No progress display."),
) -> None:
    """Train (or resume) a run; writes RUN/log.csv, RUN/checkpoints/ and RUN/export/."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from k3.errors import K3Error
    from k3.train.allocator import keep_freed_memory
    from k3.train.trainer import TrainConfig, TrainError
    from k3.train.trainer import train as run_training

    keep_freed_memory()  # every step frees and reallocates the same large tensors

    tc = TrainConfig(
        preset=preset,
        data=data,
        out=str(out),
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        accum=accum,
        lr=lr,
        min_lr_ratio=min_lr_ratio,
        warmup=warmup,
        schedule=schedule,
        weight_decay=weight_decay,
        clip=clip,
        dtype=dtype,
        seed=seed,
        balance=balance,
        optimizer=optimizer,
        qb_iters=qb_iters,
        balance_ema=balance_ema,
        balance_refresh=balance_refresh,
        gamma=gamma,
        checkpoint_every=checkpoint_every,
        num_kv_pairs=num_kv_pairs,
        tokenizer=None if tokenizer is None else str(tokenizer),
        eval_every=eval_every,
        export=export,
        stop_after=stop_after,
        threads=threads,
        progress=not quiet,
    )
    progress = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeRemainingColumn(),
        disable=quiet,
    )
    task = progress.add_task("train", total=steps, stats="")

    def on_step(row: dict) -> None:
        stats = (
            f"loss {float(row['loss']):.4f}  max/mean load {row['max_over_mean_load']}  "
            f"{row['tokens_per_s']} tok/s"
        )
        if row.get("eval_acc"):
            stats += f"  eval acc {float(row['eval_acc']):.3f}"
        progress.update(task, completed=int(row["step"]), stats=stats)

    try:
        with progress:
            run = run_training(tc, on_step=on_step)
    except (TrainError, K3Error, FileNotFoundError) as e:
        fail(str(e))
    if not quiet:
        Console().print(f"run folder: {run}")


@train_app.command("plot")
def plot(run: Path = typer.Argument(..., help="A run folder holding log.csv.")) -> None:
    """Write PNG plots of a run's log (loss, expert load balance) into the run folder."""
    from k3.train.plot import plot_run

    try:
        written = plot_run(run)
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
    for path in written:
        print(path)


if __name__ == "__main__":  # python -m k3.train.commands ... (the benchmarks use this)
    train_app()
