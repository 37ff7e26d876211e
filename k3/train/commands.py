"""`k3 train ...` (train or resume a run) and `k3 train plot RUN/` (PNG plots of its log).

Register in k3/cli.py with `app.add_typer(train_app, name="train")`. Heavy imports (torch, the model,
matplotlib) happen inside the commands so that `k3 --help` stays fast.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from k3.terminal import fail
from k3.train.config import Balance, DType, EPPolicy, Optimizer, Schedule, TrainConfig, TrainError

train_app = typer.Typer(
    help="Train K3-shaped models at small scale, with quantile-balanced routing.",
    no_args_is_help=False,
    add_completion=False,
)


D = TrainConfig()  # every option's default is the field's


@train_app.callback(invoke_without_command=True)
def train(
    ctx: typer.Context,
    preset: Annotated[
        str, typer.Option(help="Model: a preset (tiny, mini, ...), a config.json or a checkpoint dir.")
    ] = D.preset,
    data: Annotated[
        str, typer.Option(help="mqar, copy, or a plain text file (tokenised with the k3 tokenizer).")
    ] = D.data,
    out: Annotated[str, typer.Option(help="Run folder; an existing run there is resumed.")] = D.out,
    steps: Annotated[
        int, typer.Option(help="Optimizer steps (more than a finished run's continue it).")
    ] = D.steps,
    batch_size: Annotated[int, typer.Option(help="Sequences per micro-batch.")] = D.batch_size,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = D.seq_len,
    accum: Annotated[
        int, typer.Option(help="Micro-batches per optimizer step (gradient accumulation).")
    ] = D.accum,
    lr: Annotated[float, typer.Option(help="Peak learning rate.")] = D.lr,
    optimizer: Annotated[
        Optimizer,
        typer.Option(help="adamw, or muon (hidden matrices; AdamW for embeddings, head and vectors)."),
    ] = D.optimizer,
    muon_fp32: Annotated[
        bool,
        typer.Option(
            help="Muon's Newton-Schulz iteration in fp32, not bf16 (then runs on 1 and N processes agree to "
            "rounding)."
        ),
    ] = D.muon_fp32,
    min_lr_ratio: Annotated[float, typer.Option(help="Final learning rate as a fraction of the peak.")] = (
        D.min_lr_ratio
    ),
    warmup: Annotated[int, typer.Option(help="Warm-up steps (clipped to --steps).")] = D.warmup,
    schedule: Annotated[Schedule, typer.Option(help="Learning rate after warm-up.")] = D.schedule,
    weight_decay: Annotated[
        float, typer.Option(help="Decoupled weight decay (matrices only).")
    ] = D.weight_decay,
    beta1: Annotated[float, typer.Option(help="AdamW's first-moment decay (Muon's momentum).")] = D.beta1,
    beta2: Annotated[float, typer.Option(help="AdamW's second-moment decay.")] = D.beta2,
    clip: Annotated[float, typer.Option(help="Max gradient norm (0: no clipping).")] = D.clip,
    dtype: Annotated[DType, typer.Option(help="fp32, or bf16 autocast.")] = D.dtype,
    seed: Annotated[
        int, typer.Option(help="Seed of the weights, the data and every random choice.")
    ] = D.seed,
    balance: Annotated[
        Balance, typer.Option(help="Routing balance: qb (quantile balancing), deepseek or none.")
    ] = D.balance,
    qb_iters: Annotated[
        int, typer.Option(help="Quantile-balancing rounds per batch (warm-started).")
    ] = D.qb_iters,
    balance_ema: Annotated[
        float, typer.Option(help="EMA of the QB bias across batches (0: the latest only).")
    ] = D.balance_ema,
    balance_refresh: Annotated[
        bool,
        typer.Option(
            help="QB: refit on the step's batch routed again by the updated model (one more forward)."
        ),
    ] = D.balance_refresh,
    gamma: Annotated[float, typer.Option(help="Step of the DeepSeek sign update.")] = D.gamma,
    checkpoint_every: Annotated[int, typer.Option(help="Steps between checkpoints.")] = D.checkpoint_every,
    keep_checkpoints: Annotated[
        int, typer.Option(help="Checkpoints kept (the newest).")
    ] = D.keep_checkpoints,
    num_kv_pairs: Annotated[int, typer.Option(help="MQAR: key-value pairs per sequence.")] = D.num_kv_pairs,
    tokenizer: Annotated[
        str | None, typer.Option(help="Tokenizer directory for text data (default: built-in).")
    ] = D.tokenizer,
    eval_every: Annotated[
        int, typer.Option(help="Steps between held-out evaluations (0: none).")
    ] = D.eval_every,
    eval_batches: Annotated[int, typer.Option(help="Held-out batches per evaluation.")] = D.eval_batches,
    export: Annotated[
        bool, typer.Option(help="Export the final model (experts MXFP4) to RUN/export.")
    ] = D.export,
    threads: Annotated[
        int, typer.Option(help="torch CPU threads (0: default; 1 is often fastest on a busy machine).")
    ] = D.threads,
    stop_after: Annotated[
        int | None, typer.Option(help="Stop after this step (rerun to resume).")
    ] = D.stop_after,
    progress: Annotated[bool, typer.Option("--progress/--quiet", help="Progress display.")] = D.progress,
    nproc: Annotated[
        int, typer.Option(help="Processes on this machine (> 1: launched through torch.distributed.run).")
    ] = D.nproc,
    expert_parallel: Annotated[
        int, typer.Option(help="Ranks the routed experts are sharded over (0: all processes).")
    ] = D.expert_parallel,
    ep_policy: Annotated[
        EPPolicy, typer.Option(help="Where the (token, expert) pairs are computed: none, eplb or moonep.")
    ] = D.ep_policy,
    ep_slots: Annotated[
        int, typer.Option(help="Replicas of other ranks' experts a rank may host.")
    ] = D.ep_slots,
    ep_replan_every: Annotated[
        int, typer.Option(help="EPLB: steps between replica placements.")
    ] = D.ep_replan_every,
    ep_timeout: Annotated[
        float, typer.Option(help="Seconds a collective waits before naming the rank that did not arrive.")
    ] = D.ep_timeout,
    ep_threshold: Annotated[
        bool, typer.Option(help="Skip replicas whose token traffic is below the weight bytes they cost.")
    ] = D.ep_threshold,
) -> None:
    """Train (or resume) a run; writes RUN/log.csv, RUN/checkpoints/ and RUN/export/."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from k3.errors import K3Error
    from k3.train.allocator import keep_freed_memory
    from k3.train.trainer import train as run_training

    keep_freed_memory()  # every step frees and reallocates the same large tensors

    tc = TrainConfig(**{f.name: ctx.params[f.name] for f in fields(TrainConfig)})
    quiet = not progress
    bar = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeRemainingColumn(),
        disable=quiet,
    )
    task = bar.add_task("train", total=tc.steps, stats="")

    def on_step(row: dict) -> None:
        stats = (
            f"loss {float(row['loss']):.4f}  max/mean load {row['max_over_mean_load']}  "
            f"{row['tokens_per_s']} tok/s"
        )
        if row.get("eval_acc"):
            stats += f"  eval acc {float(row['eval_acc']):.3f}"
        bar.update(task, completed=int(row["step"]), stats=stats)

    try:
        with bar:
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
