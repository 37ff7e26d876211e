"""`k3 rl ...` (run or resume RL), `k3 rl sft` (a partly competent base), `k3 rl export RUN OUT`,
`k3 rl plot RUN`. Registered in k3/cli.py; heavy imports happen inside the commands."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Annotated

import typer

from k3.rl.config import RLConfig
from k3.terminal import fail

rl_app = typer.Typer(
    help="Reinforcement learning with verifiable rewards (K1.5/K2 style) on k3's own engine.",
    no_args_is_help=False,
    add_completion=False,
)


D = RLConfig()  # every option's default is the field's


def _option(help: str):  # noqa: A002 (typer's name)
    return typer.Option(help=help)


@rl_app.callback(invoke_without_command=True)
def rl(
    ctx: typer.Context,
    init: Annotated[
        str, _option("Start from: a preset, a published checkpoint or a policy folder.")
    ] = D.init,
    task: Annotated[
        str,
        _option(
            "arithmetic, sort, recall, code (graded in a sandbox) or calculator (tool calls, chat format)."
        ),
    ] = D.task,
    out: Annotated[str, _option("Run folder; an existing run there is resumed.")] = D.out,
    iterations: Annotated[int, _option("RL iterations (one policy version each).")] = D.iterations,
    prompts: Annotated[int, _option("New prompts per iteration.")] = D.prompts,
    samples: Annotated[int, _option("Samples per prompt (K).")] = D.samples,
    loss: Annotated[str, _option("k2 (Kimi's squared mirror-descent loss), grpo or rest.")] = D.loss,
    tau: Annotated[float, _option("K2: weight of the log(pi / pi_old) term.")] = D.tau,
    clip: Annotated[float, _option("GRPO: ratio clip.")] = D.clip,
    lr: Annotated[float, _option("AdamW learning rate (0 allowed: checks).")] = D.lr,
    warmup: Annotated[int, _option("Optimizer steps of linear learning-rate warm-up (0: none).")] = D.warmup,
    minibatches: Annotated[int, _option("Optimizer steps per iteration (must divide --prompts).")] = (
        D.minibatches
    ),
    reset_optimizer: Annotated[
        bool, _option("A fresh optimizer every iteration (K1.5).")
    ] = D.reset_optimizer,
    grad_clip: Annotated[float, _option("Max gradient norm (0: no clipping).")] = D.grad_clip,
    temperature: Annotated[float, _option("Sampling temperature of rollouts.")] = D.temperature,
    partial_budget: Annotated[int, _option("Tokens per trajectory per iteration (0: off).")] = (
        D.partial_budget
    ),
    partial_cap: Annotated[float, _option("Most share of a batch's samples from partial rollouts.")] = (
        D.partial_cap
    ),
    stale_versions: Annotated[int, _option("Tokens older than this many versions are stale.")] = (
        D.stale_versions
    ),
    stale: Annotated[str, _option("Stale tokens: mask, or tis (truncated importance weights).")] = D.stale,
    tis_cap: Annotated[float, _option("Cap of the truncated importance weight.")] = D.tis_cap,
    length_coef: Annotated[float, _option("Weight of K1.5's length reward.")] = D.length_coef,
    truncation_penalty: Annotated[float, _option("Reward of a sample cut by its budget: minus this.")] = (
        D.truncation_penalty
    ),
    loop_repeats: Annotated[int, _option("A tail repeated this often ends a sample (0: off).")] = (
        D.loop_repeats
    ),
    routing_replay: Annotated[
        bool, _option("Train with the rollout's experts (route_with).")
    ] = D.routing_replay,
    ptx_coef: Annotated[float, _option("Weight of the PTX (pretraining) loss (0: off).")] = (D.ptx_coef),
    ptx_data: Annotated[str, _option("PTX data: task (reference answers) or a text file.")] = D.ptx_data,
    ptx_batch: Annotated[int, _option("PTX sequences per optimizer step.")] = D.ptx_batch,
    eval_every: Annotated[int, _option("Iterations between held-out evaluations.")] = D.eval_every,
    held_out: Annotated[int, _option("Held-out problems (greedy accuracy).")] = D.held_out,
    digits: Annotated[int, _option("Arithmetic: digits per operand.")] = D.digits,
    seed: Annotated[int, _option("Seed of prompts and samples.")] = D.seed,
    max_batch: Annotated[int, _option("Engine slots (sequences generated together).")] = D.max_batch,
    checkpoint_every: Annotated[int, _option("Iterations between checkpoints.")] = D.checkpoint_every,
    threads: Annotated[int, _option("torch CPU threads (0: default).")] = D.threads,
    stop_after: Annotated[
        int | None, _option("Leave after this iteration (rerun to resume).")
    ] = D.stop_after,
    quiet: Annotated[bool, _option("No progress lines.")] = not D.progress,
) -> None:
    """Run (or resume) RL; writes RUN/log.csv and RUN/checkpoints/."""
    if ctx.invoked_subcommand is not None:
        return
    from k3.errors import K3Error
    from k3.rl.trainer import train_rl

    chosen = locals()
    rc = RLConfig(**{f.name: chosen[f.name] for f in fields(RLConfig) if f.name in chosen})
    rc.progress = not quiet

    def show(row: dict) -> None:
        if not quiet:
            figures = ("reward", "eval_acc", "kl", "logprob_diff_max", "expert_flips", "tokens_per_s")
            print(f"iteration {row['step']}: " + "  ".join(f"{k} {row[k]}" for k in figures if row.get(k)))

    try:
        train_rl(rc, on_iteration=show)
    except K3Error as e:
        fail(str(e))


@rl_app.command("sft")
def sft(
    init: str = typer.Option("tiny", help="Start from: a preset, a published checkpoint or a policy folder."),
    task: str = typer.Option("arithmetic", help="arithmetic, sort, recall or code."),
    out: Path = typer.Option(Path("runs/sft"), help="Run folder (RUN/policy/ is the result)."),
    steps: int = typer.Option(300, help="Optimizer steps."),
    batch_size: int = typer.Option(64, help="Problems per step."),
    lr: float = typer.Option(3e-3, help="Peak learning rate (warm-up, then cosine)."),
    digits: int = typer.Option(3, help="Arithmetic: digits per operand."),
    seed: int = typer.Option(0, help="Seed of weights (presets) and problems."),
    eval_every: int = typer.Option(100, help="Steps between held-out evaluations."),
    threads: int = typer.Option(0, help="torch CPU threads (0: default)."),
    held_out: int = typer.Option(100, help="Held-out problems graded at each evaluation."),
    wrong_carry: float = typer.Option(
        0.0, help="Arithmetic: share of carry problems trained on the answer with the carry dropped."
    ),
) -> None:
    """Supervised fine-tuning on the task's reference answers: a partly competent base for `k3 rl`."""
    from k3.errors import K3Error
    from k3.rl.sft import SFTConfig
    from k3.rl.sft import sft as run_sft

    sc = SFTConfig(
        init=init,
        task=task,
        out=str(out),
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        warmup=min(20, steps),
        digits=digits,
        seed=seed,
        eval_every=eval_every,
        threads=threads,
        held_out=held_out,
        wrong_carry=wrong_carry,
    )
    try:
        run = run_sft(sc, on_step=lambda row: print(row) if row.get("eval_acc") else None)
    except K3Error as e:
        fail(str(e))
    print(f"policy: {run / 'policy'}")


@rl_app.command("export")
def export(
    run: Path = typer.Argument(..., help="An RL run folder (or a policy folder)."),
    out: Path = typer.Argument(..., help="Where to write the checkpoint (published layout, MXFP4 experts)."),
) -> None:
    """Write the run's latest policy as a checkpoint in the published layout (k3 generate opens it)."""
    from k3.rl.export import export_run

    try:
        print(export_run(run, out))
    except (OSError, ValueError) as e:
        fail(str(e))


@rl_app.command("plot")
def plot(run: Path = typer.Argument(..., help="An RL run folder.")) -> None:
    """PNG plots of an RL log: reward and held-out accuracy, KL and engine/trainer mismatch."""
    from k3.rl.plot import plot_rl

    try:
        for path in plot_rl(run):
            print(path)
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
