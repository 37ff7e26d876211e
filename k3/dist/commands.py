"""`k3 generate --nproc N`: the engine's `k3 generate`, with the routed experts sharded over N processes.

    k3 generate CKPT -p "Once upon" --nproc 2     # launches torchrun: 2 ranks, each holding E/2 experts
    torchrun --standalone --nproc-per-node 2 -m k3 generate CKPT -p "Once upon"   # the same

With one process (and not under torchrun) this is the engine's command itself. Under torchrun every rank
loads the checkpoint, keeps only its home experts (k3.dist.shard), installs the expert-parallel dispatch
and drives the engine on the same prompt with the same sampling parameters (and seed), so every rank
takes the same steps in lockstep (each forward is a collective); rank 0 prints, as the engine's command
does. (k3.engine knows nothing of k3.dist: the wiring is here and in k3/cli.py.)
"""

from __future__ import annotations

import io
import resource
import sys
from pathlib import Path

import typer
from rich.console import Console

from k3.dist.group import torchrun_env
from k3.engine.commands import (
    BF16_PRODUCTS,
    IMAGES,
    INT8_EXPERTS,
    LAYERS,
    MAX_TOKENS,
    PENALTY,
    SEED,
    TEMPERATURE,
    THREADS,
    TOP_K,
    TOP_P,
    complete_to,
    load,
    rate_line,
    sampling_params,
)
from k3.engine.commands import generate as generate_on_one_process
from k3.terminal import fail

NPROC = typer.Option(1, "--nproc", help="Processes; > 1: the routed experts sharded over them (torchrun).")


def generate(
    ctx: typer.Context,
    checkpoint: str = typer.Argument(..., help="Checkpoint directory or http(s) URL (with tiktoken.model)."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="Text to continue."),
    max_tokens: int = MAX_TOKENS,
    temperature: float = TEMPERATURE,
    top_k: int = TOP_K,
    top_p: float = TOP_P,
    repetition_penalty: float = PENALTY,
    seed: int = SEED,
    layers: int = LAYERS,
    int8_expert_inputs: bool = INT8_EXPERTS,
    bf16_products: bool = BF16_PRODUCTS,
    threads: int = THREADS,
    nproc: int = NPROC,
    image: list[Path] = IMAGES,
) -> None:
    """Continue a prompt (plain completion, no chat format), streaming tokens to the terminal; with
    `--nproc N` the routed experts are sharded over N processes (`--threads`: each one's threads)."""
    sampling = (max_tokens, temperature, top_k, top_p, repetition_penalty, seed)
    if torchrun_env():
        _generate_on_ranks(checkpoint, prompt, sampling, layers, int8_expert_inputs, bf16_products, threads)
    elif nproc == 1:
        generate_on_one_process(
            checkpoint, prompt, *sampling, layers, int8_expert_inputs, bf16_products, threads, image
        )
    elif image:
        fail("--image runs on one process (without --nproc)")
    else:
        from k3.dist.launch import launch
        from k3.errors import K3Error

        try:
            launch(nproc, ["-m", "k3", "generate", *_command_line(ctx, drop="nproc")])
        except K3Error as e:
            fail(str(e))


def _command_line(ctx: typer.Context, drop: str) -> list[str]:
    """This command's parsed arguments written back as a command line, without the option `drop` and
    without options left unset: what every rank runs under torchrun."""
    args: list[str] = []
    for param in ctx.command.params:
        value = ctx.params[param.name]
        if param.name == drop or value is None or (isinstance(value, list | tuple) and not value):
            continue  # unset (an unset list option, `--image`, parses to an empty tuple)
        if isinstance(value, bool):  # a flag: named when on, absent when off
            args += [param.opts[0]] if value else []
            continue
        text = repr(value) if isinstance(value, float) else str(value)  # repr: a float's every digit
        args += [text] if param.param_type_name == "argument" else [param.opts[0], text]
    return args


def _generate_on_ranks(
    checkpoint: str,
    prompt: str,
    sampling: tuple,
    layers: int | None,
    int8_expert_inputs: bool,
    bf16_products: bool,
    threads: int | None,
) -> None:
    import torch

    from k3.dist.data_parallel import cpu_threads
    from k3.dist.group import Comm
    from k3.dist.moe import ExpertParallel
    from k3.dist.shard import shard_experts

    comm = Comm.from_env(timeout=120.0, backend="gloo")  # the model runs on the CPU
    threads = cpu_threads(comm.world) if threads is None else threads  # by default the ranks share the cores
    model, tok = load(checkpoint, layers, int8_expert_inputs, bf16_products, threads)
    shard_experts(model, comm.rank, comm.world)  # the other ranks' experts are dropped after loading
    ExpertParallel(comm).install(model)
    params = sampling_params(*sampling, {tok.special.eos})
    lead = comm.rank == 0
    with comm.guard():  # every rank takes the same steps: rank 0 prints them
        prompt_tokens, count, elapsed = complete_to(
            sys.stdout if lead else io.StringIO(), model, tok, prompt, params
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MB, this rank
    peaks = comm.all_gather(torch.tensor([peak], dtype=torch.float64))
    if lead:
        Console(stderr=True).print(
            f"[dim]{rate_line(prompt_tokens, count, elapsed)} on {comm.world} processes, "
            f"peak RSS of the largest rank {float(peaks.max()):,.0f} MB[/]"
        )
    comm.close()
