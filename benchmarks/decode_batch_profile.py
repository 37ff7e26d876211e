"""Where a decode step of B sequences spends its time, component by component, against this machine's GEMM.

    .venv/bin/python benchmarks/decode_batch_profile.py --checkpoint CKPT --batch 1,8 --threads 2
    .venv/bin/python benchmarks/decode_batch_profile.py --checkpoint CKPT --int8-expert-inputs

A step of B sequences reads each weight once and multiplies it by B vectors, so where one sequence is bound
by memory, a batch of 8 is bound by arithmetic. Issue 40 asks a batch of 8 for 5x the tokens/s of one; this
script says which component holds a batch back, in the numbers that decide it: the multiply-adds each
component does for a token (every Linear's and MXFP4Linear's in x out, the router's scores; a MoE layer's
routed experts top_k of them, the others not being run), its milliseconds in a step, and so its GFLOP/s
(2 x B x multiply-adds / time) against an fp32 GEMM of 2048^3 timed in the same run (the better of a timing
before the steps and one after). Attention over the cache and KDA's state update are not counted (at the
short context used, small beside the weights); `rest` is the lm_head, the final norm, AttnRes and the
embedding.

The checkpoint loads as `k3 generate` loads it (BF16 weights tiled for the decode kernels, fp32 compute).
The fused step runs layer by layer (`set_fast_decode(True, one_call=False)`), so that benchmarks/decode.py's
ComponentClock sees each component; then the same sequences run the default one-call step, whose total is the
figure a user gets. Batch sizes take turns in rounds, each turn one warm-up step (a new batch size builds the
decode plan again) and `--steps` timed ones; medians over all rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from decode import COMPONENTS, ComponentClock, by_component, prefilled, wrap_fused  # benchmarks/ on the path

from k3.model import K3ForCausalLM
from k3.model.moe import Router
from k3.ops.roofline import machine_line, references, references_line

KINDS = [k for k, _ in COMPONENTS] + ["rest"]


def matrix_macs(module: torch.nn.Module) -> int:
    """Multiply-adds of one token through every matrix below `module`: in x out of each Linear and
    MXFP4Linear (both carry in_features / out_features, whatever the weight's layout), E x H for a router."""
    total = 0
    for sub in module.modules():
        if isinstance(sub, Router):
            total += sub.weight.numel()
        elif hasattr(sub, "in_features") and hasattr(sub, "out_features"):
            total += sub.in_features * sub.out_features
    return total


def component_macs(model: K3ForCausalLM) -> dict[str, int]:
    """Multiply-adds a token's decode step does in each component's weights (see the module's docstring)."""
    out, _ = by_component(model, matrix_macs)
    out["rest"] = matrix_macs(model.lm_head)
    return out


@torch.no_grad()
def profile_batches(
    model: K3ForCausalLM, batches: list[int], context: int, steps: int, rounds: int
) -> dict[int, dict]:
    """Per batch size: the layer-by-layer step's median ms and its components' mean ms, and the one-call
    step's median ms, the batch sizes taking turns (see the module's docstring)."""
    clock = ComponentClock(model)
    wrap_fused(clock)
    gen = torch.Generator().manual_seed(1)
    caches = {B: prefilled(model, B, context, gen) for B in batches}
    result = {
        B: {"layer_ms": [], "one_call_ms": [], "parts": dict.fromkeys(clock.seconds, 0.0)} for B in batches
    }

    def step(B: int) -> float:
        clock.reset()
        t = time.perf_counter()
        model(torch.ones(B, 1, dtype=torch.long), caches[B])
        return time.perf_counter() - t

    for one_call in (False, True):
        model.set_fast_decode(True, one_call=one_call)
        for _ in range(rounds):
            for B in batches:
                step(B)  # the decode plan built again for this batch
                for _ in range(steps):
                    seconds = step(B)
                    result[B]["one_call_ms" if one_call else "layer_ms"].append(1e3 * seconds)
                    if not one_call:
                        for k, v in clock.seconds.items():
                            result[B]["parts"][k] += 1e3 * v / (steps * rounds)
    return result


def print_profile(result: dict[int, dict], macs: dict[str, int], gemm: float) -> None:
    """A row per batch size: each component's ms and GFLOP/s, the step's, tokens/s against the least B."""
    first = min(result)  # tokens/s are compared with this batch size's
    base = first / statistics.median(result[first]["one_call_ms"])
    print(
        f"{'B':>3} {'one call ms':>11} {'tok/s':>6} {f'x B={first}':>6} | "
        + " ".join(f"{k + ' ms GF/s':>14}" for k in [*KINDS, "step"])
        + " | % of GEMM"
    )
    for B, r in sorted(result.items()):
        one_call, layer = statistics.median(r["one_call_ms"]), statistics.median(r["layer_ms"])
        ms = dict(r["parts"], rest=layer - sum(r["parts"].values()))
        rate = {k: 2e-6 * B * macs[k] / ms[k] if ms[k] > 0 else 0.0 for k in KINDS}  # GFLOP/s
        flops = 2e-6 * B * sum(macs.values())  # MFLOP a step: / ms = GFLOP/s
        print(
            f"{B:>3} {one_call:11.1f} {B * 1e3 / one_call:6.2f} {B / one_call / base:6.2f} | "
            + " ".join(f"{ms[k]:7.1f} {rate[k]:6.1f}" for k in KINDS)
            + f" {layer:7.1f} {flops / layer:6.1f} | {100 * flops / one_call / (gemm / 1e9):5.1f} %"
        )
    print(
        f"(components: the layer-by-layer step's; tok/s, x B={first} and % of GEMM: the one-call step's; "
        "multiply-adds a token: " + ", ".join(f"{k} {macs[k] / 1e6:.0f} M" for k in KINDS) + ")"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="a checkpoint directory (k3-slice: published widths)")
    ap.add_argument("--batch", default="1,8", help="batch sizes, e.g. 1,4,8")
    ap.add_argument(
        "--context", type=int, default=64, help="tokens prefilled before the steps (sequence b: 7 b fewer)"
    )
    ap.add_argument("--steps", type=int, default=3, help="timed steps in each turn")
    ap.add_argument("--rounds", type=int, default=2, help="turns of every batch size, each path")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument(
        "--int8-expert-inputs", action="store_true", help="MXFP4 experts multiply inputs rounded to int8"
    )
    args = ap.parse_args()
    batches = sorted({int(b) for b in args.batch.split(",")})
    if args.context <= 7 * (batches[-1] - 1):
        ap.error(f"--context must exceed {7 * (batches[-1] - 1)} for a batch of {batches[-1]}")
    torch.set_num_threads(args.threads)
    model = K3ForCausalLM.from_pretrained(args.checkpoint, compute_dtype=torch.float32)
    model.tile_weights()  # as `k3 generate` loads it (k3.model.tiling)
    model.set_int8_expert_inputs(args.int8_expert_inputs)
    experts = "int8 inputs" if args.int8_expert_inputs else "exact"
    print(f"{args.checkpoint}: experts {experts}, context ~{args.context}, load {os.getloadavg()[0]:.2f}")
    print(machine_line(), flush=True)
    before = references()
    result = profile_batches(model, batches, args.context, args.steps, args.rounds)
    after = references()
    print(f"before: {references_line(before)}\nafter:  {references_line(after)}")
    print_profile(result, component_macs(model), max(before["gemm_flop_per_s"], after["gemm_flop_per_s"]))
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
