"""Decode on a shared machine: ms/token at each thread count, alone and beside processes that keep cores busy.

    .venv/bin/python benchmarks/shared_machine.py                              # mini (random weights)
    .venv/bin/python benchmarks/shared_machine.py --checkpoint CKPT --steps 4  # a checkpoint as k3 loads it

One model is loaded (a preset with random weights, seed 0, or a checkpoint with its BF16 weights tiled, as
`k3 generate` loads it), one sequence is prefilled with `--context` random tokens, and decode steps are timed
in rounds that alternate the thread counts (`torch.set_num_threads`), so every count sees the same moments of
the machine. Then the same with `--busy` other processes, each spinning on the CPU (`python -c "while True:
pass"`), and again. Before each phase `k3 doctor`'s reading of the CPUs other processes keep busy
(k3.ops.doctor.busy_cpus) is printed, with its advice. The question it answers (issue 40, target 3): whether
fewer threads serve k3 better when another process holds a core; see docs/native-cpus.md "A shared machine".
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.ops.doctor import busy_cpus, shared_machine_advice
from k3.ops.roofline import machine_line


def load(args: argparse.Namespace) -> K3ForCausalLM:
    if args.checkpoint:
        model = K3ForCausalLM.from_pretrained(args.checkpoint, compute_dtype=torch.float32)
    else:
        model = K3ForCausalLM.from_config(K3Config.preset(args.preset), seed=0)
    model.tile_weights(False)  # as `k3 generate` loads it
    model.set_native_activations(True)
    return model.eval()


@torch.no_grad()
def timed_steps(model: K3ForCausalLM, cache, threads: list[int], rounds: int, steps: int) -> dict[int, list]:
    """{threads: [seconds of each step]}, the counts alternated round by round."""
    token = torch.ones(1, 1, dtype=torch.long)
    out: dict[int, list] = {t: [] for t in threads}
    for _ in range(rounds):
        for t in threads:
            torch.set_num_threads(t)
            model(token, cache)  # the first step at a new count starts its threads
            for _ in range(steps):
                start = time.perf_counter()
                model(token, cache)
                out[t].append(time.perf_counter() - start)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--checkpoint", help="a checkpoint instead of --preset's random weights")
    ap.add_argument("--threads", default="1,2", help="thread counts to compare")
    ap.add_argument("--busy", type=int, default=1, help="spinning processes beside k3 in the second phase")
    ap.add_argument("--context", type=int, default=512, help="tokens prefilled before the timed steps")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=40, help="timed steps per round and thread count")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    before = torch.get_num_threads()
    model = load(args)
    cache = model.new_cache(1)
    prompt = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, args.context), generator=prompt)
    with torch.no_grad():
        model(ids, cache, logits_to_keep=1)
    torch.set_num_threads(before)
    print(machine_line())
    print(f"{args.checkpoint or args.preset}, one sequence after {args.context} tokens, {args.rounds} rounds")
    spinners: list[subprocess.Popen] = []
    try:
        for phase, busy in (("alone", 0), (f"beside {args.busy} busy", args.busy), ("alone again", 0)):
            while len(spinners) < busy:
                spinners.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
            while len(spinners) > busy:
                spinners.pop().kill()
            time.sleep(0.5)
            other = busy_cpus(0.5)
            advice = shared_machine_advice(max(threads), len(os.sched_getaffinity(0)), other)
            seen = "?" if other is None else f"{other:.2f}"
            said = f"; doctor: {advice}" if advice else ""
            print(f"\n{phase}: other processes keep {seen} CPUs busy{said}")
            times = timed_steps(model, cache, threads, args.rounds, args.steps)
            for t, seconds in times.items():
                print(
                    f"  {t} threads: median {statistics.median(seconds) * 1e3:8.2f} ms/token, "
                    f"best {min(seconds) * 1e3:8.2f}, {len(seconds)} steps"
                )
    finally:
        for spinner in spinners:
            spinner.kill()


if __name__ == "__main__":
    main()
