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
import json
from pathlib import Path

import torch
from train_balance import noise_floor  # benchmarks/ is on the path when run as a script


def route(model, tap, data, first_batch: int, batches: int) -> dict[int, torch.Tensor]:
    """Router scores [N, E] per MoE layer for `batches` batches from `first_batch` on."""
    scores: dict[int, list[torch.Tensor]] = {}
    with torch.no_grad():
        for index in range(first_batch, first_batch + batches):
            model(data.batch(index)[0])
            for layer, s in tap.take()[0].items():
                scores.setdefault(layer, []).append(s)
    return {layer: torch.cat(s) for layer, s in scores.items()}


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

    from safetensors.torch import load_file

    from k3.engine.build_tokenizer import builtin_tokenizer
    from k3.model import K3ForCausalLM
    from k3.train.data import TextFile
    from k3.train.routing import quantile_balance_bias
    from k3.train.state import list_checkpoints
    from k3.train.trainer import RouterTap, load_model_config

    tc = json.loads((args.run / "train.json").read_text())
    cfg = load_model_config(tc["preset"])
    model = K3ForCausalLM.from_config(cfg, seed=tc["seed"], quantized_experts=False)
    step, checkpoint = list_checkpoints(args.run)[-1]
    model.load_state_dict(load_file(str(checkpoint / "model.safetensors")), strict=True)
    model.eval()
    tap = RouterTap(model)
    tap.active = True
    k, batch_tokens = cfg.num_experts_per_token, tc["batch_size"] * tc["seq_len"]
    tokenizer = builtin_tokenizer(cfg.vocab_size)

    def stream(seed: int) -> TextFile:
        return TextFile(args.text, tokenizer, tc["seq_len"], tc["batch_size"], cfg.vocab_size, seed=seed)

    trained = {layer: r.e_score_correction_bias.detach().clone() for layer, r in tap.routers.items()}
    held_out = route(model, tap, stream(tc["seed"] + 7919), 0, args.held_out_batches)
    floor = noise_floor(batch_tokens * args.held_out_batches, cfg.num_experts, k, trials=50)
    print(f"run {args.run} at step {step}: {batch_tokens} tokens per training batch")
    print(f"held-out: {batch_tokens * args.held_out_batches} tokens, noise floor (one layer) {floor:.3f}")
    show("bias as trained", balance(held_out, trained, k))
    first_unused = tc["steps"] * tc.get("accum", 1) + 1000
    fit = route(model, tap, stream(tc["seed"]), first_unused, -(-max(args.fit_tokens) // batch_tokens))
    for n in sorted(args.fit_tokens):
        biases = {
            layer: quantile_balance_bias(s[:n], k, iters=100, init_bias=trained[layer])
            for layer, s in fit.items()
        }
        for layer, router in tap.routers.items():
            router.e_score_correction_bias.copy_(biases[layer])
        rerouted = route(model, tap, stream(tc["seed"] + 7919), 0, args.held_out_batches)
        show(f"QB refit on {n} tokens", balance(rerouted, biases, k))


if __name__ == "__main__":
    main()
