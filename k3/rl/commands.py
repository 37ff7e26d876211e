"""`k3 rl ...` (run or resume RL), `k3 rl sft` (a partly competent base), `k3 rl export RUN OUT`,
`k3 rl plot RUN`. Registered in k3/cli.py; heavy imports happen inside the commands."""

from __future__ import annotations

from pathlib import Path

import typer

from k3.terminal import fail

rl_app = typer.Typer(
    help="Reinforcement learning with verifiable rewards (K1.5/K2 style) on k3's own engine.",
    no_args_is_help=False,
    add_completion=False,
)


@rl_app.callback(invoke_without_command=True)
def rl(
    ctx: typer.Context,
    init: str = typer.Option("tiny", help="Start from: a preset, a published checkpoint or a policy folder."),
    task: str = typer.Option("arithmetic", help="arithmetic, sort, recall or code (graded in a sandbox)."),
    out: Path = typer.Option(Path("runs/rl"), help="Run folder; an existing run there is resumed."),
    iterations: int = typer.Option(20, help="RL iterations (one policy version each)."),
    prompts: int = typer.Option(16, help="New prompts per iteration."),
    samples: int = typer.Option(8, help="Samples per prompt (K)."),
    loss: str = typer.Option("k2", help="k2 (Kimi's squared mirror-descent loss), grpo or rest."),
    tau: float = typer.Option(0.1, help="K2: weight of the log(pi / pi_old) term."),
    clip: float = typer.Option(0.2, help="GRPO: ratio clip."),
    lr: float = typer.Option(1e-3, help="AdamW learning rate (0 allowed: checks)."),
    minibatches: int = typer.Option(2, help="Optimizer steps per iteration (must divide --prompts)."),
    reset_optimizer: bool = typer.Option(False, help="A fresh optimizer every iteration (K1.5)."),
    temperature: float = typer.Option(1.0, help="Sampling temperature of rollouts."),
    partial_budget: int = typer.Option(
        0, help="Tokens per trajectory per iteration (0: no partial rollouts)."
    ),
    partial_cap: float = typer.Option(0.5, help="Most share of a batch's samples from partial rollouts."),
    stale_versions: int = typer.Option(2, help="Tokens older than this many versions are stale."),
    stale: str = typer.Option("mask", help="Stale tokens: mask, or tis (truncated importance weights)."),
    tis_cap: float = typer.Option(2.0, help="Cap of the truncated importance weight."),
    length_coef: float = typer.Option(0.0, help="Weight of K1.5's length reward."),
    truncation_penalty: float = typer.Option(
        0.0, help="Reward of a sample cut by its token budget: minus this."
    ),
    loop_repeats: int = typer.Option(
        0, help="A tail block repeated this often ends a sample as a loop (0: off)."
    ),
    routing_replay: bool = typer.Option(False, help="Train with the rollout's experts (route_with)."),
    eval_every: int = typer.Option(5, help="Iterations between held-out evaluations."),
    held_out: int = typer.Option(100, help="Held-out problems (greedy accuracy)."),
    digits: int = typer.Option(3, help="Arithmetic: digits per operand."),
    seed: int = typer.Option(0, help="Seed of prompts and samples."),
    threads: int = typer.Option(0, help="torch CPU threads (0: default)."),
    stop_after: int | None = typer.Option(None, help="Leave after this iteration (rerun to resume)."),
    quiet: bool = typer.Option(False, help="No progress lines."),
) -> None:
    """Run (or resume) RL; writes RUN/log.csv and RUN/checkpoints/."""
    if ctx.invoked_subcommand is not None:
        return
    from k3.errors import K3Error
    from k3.rl.trainer import RLConfig, train_rl

    rc = RLConfig(**{k: v for k, v in locals().items() if k in RLConfig.__dataclass_fields__ and k != "out"})
    rc.out, rc.progress = str(out), not quiet

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
) -> None:
    """Supervised fine-tuning on the task's reference answers: a partly competent base for `k3 rl`."""
    from k3.errors import K3Error
    from k3.rl.sft import SFTConfig
    from k3.rl.sft import sft as run_sft

    sc = SFTConfig(
        init, task, str(out), steps, batch_size, lr, min(20, steps), digits, seed, eval_every, threads
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
