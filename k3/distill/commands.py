"""`k3 distill ...` (run or resume a distillation), `k3 distill teachers` (specialists built with k3),
`k3 distill export RUN OUT`, `k3 distill plot RUN...`. Registered in k3/cli.py; heavy imports happen
inside the commands."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated

import typer

from k3.distill.config import DistillConfig
from k3.distill.specialists import make_teachers
from k3.terminal import fail

distill_app = typer.Typer(
    help="Multi-teacher on-policy distillation: specialist k3 teachers into one student.",
    no_args_is_help=False,
    add_completion=False,
)


D = DistillConfig()  # every option's default is the field's


@distill_app.callback(invoke_without_command=True)
def distill(
    ctx: typer.Context,
    student: Annotated[
        str, typer.Option(help="Start from: a preset, a published checkpoint or a policy folder.")
    ] = D.student,
    teacher: Annotated[
        list[str],
        typer.Option(help="NAME=CKPT[:task], repeated; a teacher without a task covers each --tasks domain"),
    ] = [],  # noqa: B006 (typer's list default; D.teachers is empty too)
    tasks: Annotated[
        str, typer.Option(help="Comma-separated domains for a teacher without a task.")
    ] = ",".join(D.tasks),
    out: Annotated[Path, typer.Option(help="Run folder; an existing run there is resumed.")] = Path(D.out),
    method: Annotated[
        str, typer.Option(help="on-policy, off-policy (SFT on teacher samples), average, rl (reward only).")
    ] = D.method,
    iterations: Annotated[int, typer.Option(help="Iterations (one policy version each).")] = D.iterations,
    prompts: Annotated[int, typer.Option(help="New prompts per domain per iteration.")] = D.prompts,
    samples: Annotated[int, typer.Option(help="Samples per prompt (K).")] = D.samples,
    lr: Annotated[float, typer.Option(help="Learning rate (0 allowed: checks).")] = D.lr,
    warmup: Annotated[
        int, typer.Option(help="Optimizer steps of linear learning-rate warm-up (0: none).")
    ] = D.warmup,
    cosine: Annotated[
        bool, typer.Option(help="After the warm-up, a cosine decay of the rate to 0 at the last iteration.")
    ] = D.cosine,
    optimizer: Annotated[str, typer.Option(help="adamw or sgd.")] = D.optimizer,
    minibatches: Annotated[int, typer.Option(help="Optimizer steps per iteration.")] = D.minibatches,
    grad_clip: Annotated[float, typer.Option(help="Max gradient norm (0: no clipping).")] = D.grad_clip,
    temperature: Annotated[
        float, typer.Option(help="Sampling temperature (teacher and student log-probs too).")
    ] = D.temperature,
    is_low: Annotated[
        float, typer.Option(help="Importance weight pi_theta / pi_behaviour truncated below at this.")
    ] = D.is_low,
    is_high: Annotated[float, typer.Option(help="... and above at this.")] = D.is_high,
    alpha_reward: Annotated[
        float, typer.Option(help="Add A x (task reward - group mean) to every advantage.")
    ] = D.alpha_reward,
    kl_discount: Annotated[
        float,
        typer.Option(help="Credit each token with the rest of its sample's reverse KL, discounted by this."),
    ] = D.kl_discount,
    kl_baseline: Annotated[
        bool, typer.Option(help="With --full-vocab --kl-discount: subtract the other samples' mean (RLOO).")
    ] = D.kl_baseline,
    kl_length_norm: Annotated[
        bool, typer.Option(help="With --kl-discount: the rest's mean KL per token, not its sum (MiniLLM).")
    ] = D.kl_length_norm,
    warm_start: Annotated[
        int, typer.Option(help="The first N iterations off-policy (SFT on teacher samples), at --warm-lr.")
    ] = D.warm_start,
    warm_lr: Annotated[
        float | None, typer.Option(help="The warm-start iterations' peak learning rate (default: --lr).")
    ] = D.warm_lr,
    full_vocab: Annotated[
        bool,
        typer.Option(
            help="Exact full-vocabulary --divergence: on-policy GKD; with --method off-policy supervised KD."
        ),
    ] = D.full_vocab,
    divergence: Annotated[
        str, typer.Option(help="With --full-vocab: reverse (GKD beta = 1) or forward KL (beta = 0).")
    ] = D.divergence,
    eval_every: Annotated[int, typer.Option(help="Iterations between held-out evaluations.")] = D.eval_every,
    held_out: Annotated[int, typer.Option(help="Held-out problems per task (greedy accuracy).")] = D.held_out,
    eval_samples: Annotated[
        int, typer.Option(help="Held-out prompts per domain for the logged reverse KL.")
    ] = D.eval_samples,
    digits: Annotated[int, typer.Option(help="Arithmetic: digits per operand.")] = D.digits,
    seed: Annotated[int, typer.Option(help="Seed of prompts and samples.")] = D.seed,
    max_batch: Annotated[int, typer.Option(help="Engine batch (sequences decoded together).")] = D.max_batch,
    checkpoint_every: Annotated[
        int, typer.Option(help="Iterations between checkpoints.")
    ] = D.checkpoint_every,
    threads: Annotated[int, typer.Option(help="torch CPU threads (0: default).")] = D.threads,
    stop_after: Annotated[
        int | None, typer.Option(help="Leave after this iteration (rerun to resume).")
    ] = D.stop_after,
    quiet: Annotated[bool, typer.Option(help="No progress lines.")] = not D.progress,
) -> None:
    """Run (or resume) a distillation; writes RUN/log.csv and RUN/checkpoints/."""
    if ctx.invoked_subcommand is not None:
        return
    from k3.distill.loop import train_distill
    from k3.errors import K3Error

    dc = DistillConfig(
        **{
            k: v
            for k, v in locals().items()
            if k in DistillConfig.__dataclass_fields__ and k not in ("out", "tasks")
        }
    )
    dc.teachers, dc.tasks = list(teacher), [t for t in tasks.split(",") if t]
    dc.out, dc.progress = str(out), not quiet

    def show(row: dict) -> None:
        if not quiet:
            figures = [k for k in row if k.startswith(("rkl_", "acc_", "eval_rkl_"))] + ["teacher_tokens"]
            print(f"iteration {row['step']}: " + "  ".join(f"{k} {row[k]}" for k in figures if row.get(k)))

    try:
        train_distill(dc, on_iteration=show)
    except K3Error as e:
        fail(str(e))


T = {k: p.default for k, p in inspect.signature(make_teachers).parameters.items()}  # its defaults


@distill_app.command("teachers")
def teachers(
    out: Annotated[Path, typer.Option(help="Folder of the specialists (`OUT/<task>/checkpoint`).")] = Path(
        "runs/teachers"
    ),
    tasks: Annotated[
        str, typer.Option(help="Comma-separated tasks (TASK or TASK@no|short|long), one specialist each.")
    ] = "arithmetic,sort,recall",
    init: Annotated[str, typer.Option(help="The preset (or checkpoint) every specialist starts from.")] = T[
        "init"
    ],
    steps: Annotated[int, typer.Option(help="SFT steps per specialist.")] = T["steps"],
    batch_size: Annotated[int, typer.Option(help="Problems per SFT step.")] = T["batch_size"],
    lr: Annotated[float, typer.Option(help="SFT peak learning rate.")] = T["lr"],
    rl_iterations: Annotated[int, typer.Option(help="k3 rl iterations after SFT (0: SFT only).")] = T[
        "rl_iterations"
    ],
    digits: Annotated[int, typer.Option(help="Arithmetic: digits per operand.")] = T["digits"],
    held_out: Annotated[int, typer.Option(help="Held-out problems per task (SFT evaluations).")] = T[
        "held_out"
    ],
    seed: Annotated[int, typer.Option(help="Seed.")] = T["seed"],
    threads: Annotated[int, typer.Option(help="torch CPU threads (0: default).")] = T["threads"],
    base_steps: Annotated[
        int, typer.Option(help="First fine-tune a base this many steps on all the tasks (OUT/base/policy).")
    ] = T["base_steps"],
) -> None:
    """Build one specialist teacher per task with k3 itself (SFT, optionally RL); prints --teacher specs."""
    from k3.errors import K3Error

    try:
        specs = make_teachers(out, [t for t in tasks.split(",") if t], init=init, steps=steps,
                              batch_size=batch_size, lr=lr, rl_iterations=rl_iterations, digits=digits,
                              held_out=held_out, seed=seed, threads=threads, base_steps=base_steps,
                              on_step=lambda row: print(row) if row.get("eval_acc") else None)  # fmt: skip
    except K3Error as e:
        fail(str(e))
    print(" ".join(f"--teacher {s}" for s in specs))


@distill_app.command("export")
def export(
    run: Path = typer.Argument(..., help="A distillation run folder."),
    out: Path = typer.Argument(..., help="Where to write the checkpoint (published layout, MXFP4 experts)."),
) -> None:
    """Write the run's latest student as a checkpoint in the published layout (as `k3 rl export`)."""
    from k3.errors import K3Error
    from k3.rl.export import export_run

    try:
        print(export_run(run, out))
    except (OSError, ValueError, K3Error) as e:
        fail(str(e))


@distill_app.command("plot")
def plot(
    runs: list[Path] = typer.Argument(..., help="One or more distillation run folders."),
    out: Path | None = typer.Option(None, help="PNG to write (default: RUN/distill.png of the first)."),
) -> None:
    """Reverse KL to each teacher and held-out accuracy per task, against teacher tokens."""
    from k3.distill.plot import plot_distill

    try:
        print(plot_distill(runs, out))
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
