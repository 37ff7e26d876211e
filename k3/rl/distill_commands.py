"""`k3 distill ...` (run or resume a distillation), `k3 distill teachers` (specialists built with k3),
`k3 distill export RUN OUT`, `k3 distill plot RUN...`. Registered in k3/cli.py; heavy imports happen
inside the commands."""

from __future__ import annotations

from pathlib import Path

import typer

from k3.terminal import fail

distill_app = typer.Typer(
    help="Multi-teacher on-policy distillation: specialist k3 teachers into one student.",
    no_args_is_help=False,
    add_completion=False,
)


@distill_app.callback(invoke_without_command=True)
def distill(
    ctx: typer.Context,
    student: str = typer.Option(
        "tiny", help="Start from: a preset, a published checkpoint or a policy folder."
    ),
    teacher: list[str] = typer.Option(
        [], help="NAME=CKPT[:task], repeated; a teacher without a task covers every --tasks domain."
    ),
    tasks: str = typer.Option("", help="Comma-separated domains for a teacher without a task."),
    out: Path = typer.Option(Path("runs/distill"), help="Run folder; an existing run there is resumed."),
    method: str = typer.Option("on-policy", help="on-policy, off-policy (SFT on teacher samples), average."),
    iterations: int = typer.Option(20, help="Iterations (one policy version each)."),
    prompts: int = typer.Option(8, help="New prompts per domain per iteration."),
    samples: int = typer.Option(4, help="Samples per prompt (K)."),
    lr: float = typer.Option(1e-3, help="Learning rate (0 allowed: checks)."),
    optimizer: str = typer.Option("adamw", help="adamw or sgd."),
    minibatches: int = typer.Option(1, help="Optimizer steps per iteration."),
    temperature: float = typer.Option(1.0, help="Sampling temperature (teacher and student log-probs too)."),
    is_low: float = typer.Option(
        0.0, help="Importance weight pi_theta / pi_behaviour truncated below at this."
    ),
    is_high: float = typer.Option(2.0, help="... and above at this."),
    alpha_reward: float = typer.Option(0.0, help="Add A x (task reward - group mean) to every advantage."),
    full_vocab: bool = typer.Option(False, help="Exact full-vocabulary reverse KL (GKD beta = 1)."),
    eval_every: int = typer.Option(5, help="Iterations between held-out evaluations."),
    held_out: int = typer.Option(100, help="Held-out problems per task (greedy accuracy)."),
    eval_samples: int = typer.Option(16, help="Held-out prompts per domain for the logged reverse KL."),
    digits: int = typer.Option(3, help="Arithmetic: digits per operand."),
    seed: int = typer.Option(0, help="Seed of prompts and samples."),
    threads: int = typer.Option(0, help="torch CPU threads (0: default)."),
    stop_after: int | None = typer.Option(None, help="Leave after this iteration (rerun to resume)."),
    quiet: bool = typer.Option(False, help="No progress lines."),
) -> None:
    """Run (or resume) a distillation; writes RUN/log.csv and RUN/checkpoints/."""
    if ctx.invoked_subcommand is not None:
        return
    from k3.errors import K3Error
    from k3.rl.distill_loop import DistillConfig, train_distill

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


@distill_app.command("teachers")
def teachers(
    out: Path = typer.Option(
        Path("runs/teachers"), help="Folder of the specialists (OUT/<task>/checkpoint)."
    ),
    tasks: str = typer.Option("arithmetic,sort,recall", help="Comma-separated tasks, one specialist each."),
    init: str = typer.Option("tiny", help="The preset (or checkpoint) every specialist starts from."),
    steps: int = typer.Option(300, help="SFT steps per specialist."),
    batch_size: int = typer.Option(64, help="Problems per SFT step."),
    lr: float = typer.Option(3e-3, help="SFT peak learning rate."),
    rl_iterations: int = typer.Option(0, help="k3 rl iterations after SFT (0: SFT only)."),
    digits: int = typer.Option(3, help="Arithmetic: digits per operand."),
    seed: int = typer.Option(0, help="Seed."),
    threads: int = typer.Option(0, help="torch CPU threads (0: default)."),
) -> None:
    """Build one specialist teacher per task with k3 itself (SFT, optionally RL); prints --teacher specs."""
    from k3.errors import K3Error
    from k3.rl.distill_teachers import make_teachers

    try:
        specs = make_teachers(out, [t for t in tasks.split(",") if t], init=init, steps=steps,
                              batch_size=batch_size, lr=lr, rl_iterations=rl_iterations, digits=digits,
                              seed=seed, threads=threads,
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
    from k3.rl.distill_plot import plot_distill

    try:
        print(plot_distill(runs, out))
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
