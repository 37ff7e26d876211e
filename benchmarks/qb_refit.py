"""How many tokens does quantile balancing need to balance unseen text? A sweep on a finished run.

Takes a `k3 train` run on a text file (e.g. one of benchmarks/train_balance.py's, kept with its
checkpoint), loads its final model and:

1. routes a held-out set (the trainer's held-out stream: windows at seed + 7919) with the biases as
   trained, and reports max/mean expert load per MoE layer (worst layer and mean over layers);
2. for each N in `--fit-tokens`, refits every layer's bias by quantile balancing run to its fixed point
   on the router scores of N tokens from the training stream (batches the run never used), then routes
   the same held-out set again.

Training updates the bias from one batch at a time, so its balance on new text is limited by how well one
batch stands for the text; the sweep shows how the held-out balance improves with the tokens the
quantiles are taken over, against the sampling-noise floor of the held-out set itself. Scores for all
layers come from one pass with the trained biases in place (a refit bias changes the next layer's input a
little; the held-out pass uses the refit biases everywhere).

    .venv/bin/python benchmarks/qb_refit.py RUN --text corpus.txt [--fit-tokens 2048 8192 32768]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch
from train_balance import final_model, noise_floor, route  # benchmarks/ is on the path as a script


def balance(scores: dict[int, torch.Tensor], biases: dict[int, torch.Tensor], k: int) -> dict[str, float]:
    from k3.train.routing import expert_loads, max_over_mean

    ratios = [max_over_mean(expert_loads(scores[layer], k, biases[layer])) for layer in sorted(scores)]
    return {"worst_layer": max(ratios), "layer_mean": sum(ratios) / len(ratios)}


def show(label: str, result: dict[str, float]) -> None:
    print(
        f"  {label:<26} worst layer {result['worst_layer']:.3f}, mean over layers {result['layer_mean']:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a finished k3 train run folder (train.json, checkpoints/)")
    parser.add_argument("--text", type=Path, required=True, help="the text file the run trained on")
    parser.add_argument("--fit-tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--held-out-batches", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from k3.train.routing import quantile_balance_bias
    from k3.train.trainer import make_dataset

    model, cfg, tc = final_model(args.run)
    routers = model.routers()
    tc = dataclasses.replace(tc, data=str(args.text))  # the run's own copy may be gone
    k, batch_tokens = cfg.num_experts_per_token, tc.batch_size * tc.seq_len
    held_out_data, training_data = make_dataset(tc, cfg, stream=1), make_dataset(tc, cfg, stream=0)

    trained = {layer: r.e_score_correction_bias.detach().clone() for layer, r in routers.items()}
    held_out, _ = route(model, held_out_data, 0, args.held_out_batches)
    floor = noise_floor(batch_tokens * args.held_out_batches, cfg.num_experts, k, trials=50)
    print(f"run {args.run}, last checkpoint: {batch_tokens} tokens per training batch")
    print(f"held-out: {batch_tokens * args.held_out_batches} tokens, noise floor (one layer) {floor:.3f}")
    show("bias as trained", balance(held_out, trained, k))
    first_unused = tc.steps * tc.accum + 1000
    fit, _ = route(model, training_data, first_unused, -(-max(args.fit_tokens) // batch_tokens))
    for n in sorted(args.fit_tokens):
        biases = {
            layer: quantile_balance_bias(s[:n], k, iters=100, init_bias=trained[layer])
            for layer, s in fit.items()
        }
        for layer, router in routers.items():
            router.e_score_correction_bias.copy_(biases[layer])
        rerouted, _ = route(model, held_out_data, 0, args.held_out_batches)
        show(f"QB refit on {n} tokens", balance(rerouted, biases, k))


if __name__ == "__main__":
    main()
