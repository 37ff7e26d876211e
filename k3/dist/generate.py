"""Greedy generation with expert-parallel MoE layers: every rank continues its share of the prompts.

    python -m k3.dist.generate --nproc 2 CKPT -p "Once upon" -p "The capital of"   # launches torchrun
    torchrun --standalone --nproc-per-node 2 -m k3.dist.generate CKPT -p ...      # the same

Prompt i goes to rank i % R. The ranks run in lockstep, one prompt per round (prefill, then one token per
forward, `max_tokens` forwards in all, stop ids or not), because every forward is a collective: a rank
without a prompt left in a round runs a one-token placeholder, so it still takes part (the model's
attention needs at least one sequence; the MoE dispatch itself takes ranks with zero tokens).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

from k3.dist.group import Comm, torchrun_env
from k3.dist.moe import ExpertParallel


def greedy(model: nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    """`max_tokens` greedy tokens after `prompt` with a cache (one process, or one rank of several)."""
    cache = model.new_cache(batch_size=1)
    logits = model(torch.tensor([prompt]), cache=cache, logits_to_keep=1)
    tokens = []
    for _ in range(max_tokens):
        tokens.append(int(logits[0, -1].argmax()))
        if len(tokens) < max_tokens:
            logits = model(torch.tensor([[tokens[-1]]]), cache=cache, logits_to_keep=1)
    return tokens


def generate(comm: Comm, model: nn.Module, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Every prompt's `max_tokens` greedy tokens, on every rank (the model's MoE layers expert-parallel)."""
    R = comm.world
    rounds = -(-len(prompts) // R)
    mine = torch.zeros(rounds, max_tokens, dtype=torch.long)
    with torch.no_grad():
        for i in range(rounds):
            index = i * R + comm.rank
            prompt = prompts[index] if index < len(prompts) else [1]  # a placeholder keeps this rank in
            mine[i] = torch.tensor(greedy(model, prompt, max_tokens))
    every = comm.all_gather(mine)  # [R, rounds, max_tokens]
    return [every[j % R, j // R].tolist() for j in range(len(prompts))]


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--nproc="):
            skip = False
            continue
        skip = arg == "--nproc"
        if not skip:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m k3.dist.generate", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("-p", "--prompt", action="append", required=True)
    parser.add_argument("-n", "--max-tokens", type=int, default=32)
    parser.add_argument("--nproc", type=int, default=1, help="processes (> 1: launched through torchrun)")
    parser.add_argument("--timeout", type=float, default=120.0)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.nproc > 1 and not torchrun_env():
        from k3.dist.launch import launch

        launch(args.nproc, ["-m", "k3.dist.generate", *_without_nproc(argv)])
        return
    from k3.model import K3ForCausalLM
    from k3.tokenizer.kimi import Tokenizer

    torch.set_num_threads(1)
    model = K3ForCausalLM.from_pretrained(args.checkpoint).eval()
    tok = Tokenizer.from_source(args.checkpoint)
    prompts = [tok.encode(p) for p in args.prompt]
    if torchrun_env():
        comm = Comm.from_env(timeout=args.timeout, backend="gloo")  # the model runs on the CPU
        ExpertParallel(comm).install(model)
        with comm.guard():
            outputs = generate(comm, model, prompts, args.max_tokens)
        if comm.rank == 0:
            for text, out in zip(args.prompt, outputs, strict=True):
                print(text + tok.decode(out), flush=True)
        comm.close()
    else:
        for text, ids in zip(args.prompt, prompts, strict=True):
            print(text + tok.decode(greedy(model, ids, args.max_tokens)), flush=True)


if __name__ == "__main__":
    main()
