"""Held-out accuracy of RL policies on 2-digit addition, split by carry: greedy, sampled, pass@k, and the
share of answers that are the carry-dropped sum (the error `k3 rl sft --wrong-carry` plants).

    python benchmarks/rl_carry.py benchmarks/results/_rl_runs/base_wc/policy-000400 [more policy folders]

A policy is a folder `k3 rl sft` writes (anything `k3 rl --init` opens) or an RL run folder (its newest
checkpoint). One line per policy, as CSV on stdout.
"""

from __future__ import annotations

import argparse
import sys

import torch


def load(policy: str):
    """A policy folder, or an RL run folder's newest checkpoint (as `k3 rl export` reads it)."""
    from pathlib import Path

    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    from k3.rl.policy_io import POLICY_FILE, load_policy
    from k3.train.state import list_checkpoints, load_model_state

    run = Path(policy)
    if (run / POLICY_FILE).is_file():
        return load_policy(policy)
    model = K3ForCausalLM.from_config(
        K3Config.from_pretrained(str(run / "config.json")), quantized_experts=False
    )
    load_model_state(list_checkpoints(run)[-1][1], model)
    return model


def probe(policy: str, seed: int, held_out: int, samples: int, temperature: float) -> dict:
    from k3.engine.generate import Engine
    from k3.engine.sampling import SamplingParams
    from k3.rl.sft import carry_dropped
    from k3.tasks.codec import CharCodec
    from k3.tasks.exact_match import Arithmetic

    model = load(policy).eval()
    codec = CharCodec(model.config.vocab_size)
    task = Arithmetic(digits=2, held_out_size=held_out)
    problems = task.held_out(seed)
    carry = [carry_dropped(p.prompt) != p.answer for p in problems]
    engine = Engine(model, max_batch=256)
    stop = frozenset({codec.eos})

    def answers(temp: float, k: int) -> list[list[str]]:
        params = [
            SamplingParams(temperature=temp, max_tokens=task.max_tokens, stop_ids=stop, seed=seed + i)
            for i in range(len(problems) * k)
        ]
        outs = engine.generate([codec.encode(p.prompt) for p in problems for _ in range(k)], params)
        text = [codec.decode(o).strip() for o in outs]
        return [text[i * k : (i + 1) * k] for i in range(len(problems))]

    greedy = [a[0] for a in answers(0.0, 1)]
    sampled = answers(temperature, samples)
    row = {"policy": policy, "carry_share": sum(carry) / len(problems)}
    for name, keep in (("all", lambda c: True), ("carry", lambda c: c), ("no_carry", lambda c: not c)):
        idx = [i for i, c in enumerate(carry) if keep(c)]
        right = [problems[i].answer for i in idx]
        wrong = [carry_dropped(problems[i].prompt) for i in idx]
        row[f"greedy_{name}"] = sum(greedy[i] == r for i, r in zip(idx, right, strict=True)) / len(idx)
        row[f"sampled_{name}"] = sum(s == r for i, r in zip(idx, right, strict=True) for s in sampled[i]) / (
            len(idx) * samples
        )
        row[f"pass@{samples}_{name}"] = sum(r in sampled[i] for i, r in zip(idx, right, strict=True)) / len(
            idx
        )
        if name == "carry":
            row["greedy_carry_dropped"] = sum(greedy[i] == w for i, w in zip(idx, wrong, strict=True)) / len(
                idx
            )
    return {k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in row.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("policies", nargs="+")
    p.add_argument("--seed", type=int, default=0, help="the held-out set of this seed")
    p.add_argument("--held-out", type=int, default=400)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    for i, policy in enumerate(a.policies):
        row = probe(policy, a.seed, a.held_out, a.samples, a.temperature)
        if i == 0:
            print(",".join(row))
        print(",".join(str(v) for v in row.values()))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
